"""Start-up against a real server: migrations once, a database that is down, a standby."""

from __future__ import annotations

import asyncio
import contextlib
import random
import string
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

import cronlock.core.runner as runner_module
from cronlock.cli.embedded import free_port
from cronlock.core.jobs import Job, Registry, job, load
from cronlock.core.runner import Runner
from cronlock.core.schedule import Schedule, slot_window
from cronlock.db.lock import done_already, done_question, hashtextextended, lock_key, probe
from cronlock.db.pool import Database
from cronlock.db.schema import LOCK_SQL, cronlock_migrations, migrate_lock
from cronlock.errors import DatabaseUnavailable, JobDefinitionError
from cronlock.settings import Settings
from tests.support.postgres import ScratchPostgres, start_standby
from tests.util import AUTH, post, runs, wait_for

Starter = Callable[..., Any]


async def test_python_hash_matches_the_server(db: asyncpg.Connection) -> None:
    rnd = random.Random(7)
    names = ["", "daily-digest", "x" * 11, "y" * 12, "z" * 25, "héllo ✓"]
    names += ["".join(rnd.choices(string.printable, k=rnd.randint(0, 40))) for _ in range(200)]
    for seed in (0, 1, -1, 2**63 - 1, -(2**63), 987654321):
        rows = await db.fetch(
            "SELECT n, hashtextextended(n, $2) AS k FROM unnest($1::text[]) n", names, seed
        )
        for row in rows:
            assert hashtextextended(row["n"], seed) == row["k"], (row["n"], seed)


async def test_lock_key_as_pg_locks_shows_it(db: asyncpg.Connection) -> None:
    key = lock_key("daily-digest", 5)
    async with db.transaction():
        await db.execute("SELECT pg_advisory_xact_lock(hashtextextended('daily-digest', 5))")
        row = await db.fetchrow(
            "SELECT classid, objid, objsubid FROM pg_locks WHERE locktype = 'advisory'"
        )
    assert row is not None
    assert (row["classid"], row["objid"], row["objsubid"]) == (key.classid, key.objid, 1)
    assert type(key).from_pg_locks(row["classid"], row["objid"]) == key


async def test_probe_reads_the_lock_unless_the_hinted_slot_is_done(
    db: asyncpg.Connection, database_url: str
) -> None:
    name, key = "yearly", lock_key("yearly", 0)
    slot = datetime(2026, 1, 1, tzinfo=UTC)
    other = await asyncpg.connect(database_url, statement_cache_size=0)
    try:
        async with other.transaction():
            await other.execute("SELECT pg_advisory_xact_lock(hashtextextended('yearly', 0))")
            row = await probe(db, "cronlock", name, key)
            assert (row["running"], row["done_slot"], row["standby"]) == (True, None, False)
            await db.execute(
                """INSERT INTO cronlock.runs (job, slot, status, trigger, instance)
                   VALUES ('yearly', $1, 'succeeded', 'scheduled', 'earlier')""",
                slot,
            )
            # The hinted slot is done: the lock table is not read.
            row = await probe(db, "cronlock", name, key, done_hint=slot)
            assert (row["running"], row["done_slot"]) == (None, slot)
            # A hint for another slot (an instance clock a tick off) reads it.
            row = await probe(db, "cronlock", name, key, done_hint=slot + timedelta(days=365))
            assert (row["running"], row["done_slot"]) == (True, slot)
            # A job without a schedule: no ledger look, the lock only.
            row = await probe(db, "cronlock", name, key, scheduled=False, done_hint=slot)
            assert (row["running"], row["done_slot"]) == (True, None)
        row = await probe(db, "cronlock", name, key, done_hint=slot + timedelta(days=365))
        assert row["running"] is False
    finally:
        await other.close()


async def test_the_one_round_trip_probe_says_done_only_for_the_database_s_slot(
    db: asyncpg.Connection,
) -> None:
    """`done_already`: the slot is done, it is the slot of the database's clock now, the job
    is not paused (a standby: test_standby_refuses_jobs). Anything else is False, for the
    full probe to tell."""
    name, key = "minutely", lock_key("minutely", 0)
    schedule = Schedule.parse("* * * * *")
    db_now = await db.fetchval("SELECT now()")
    slot = schedule.slot_for(db_now, 0)
    window = slot_window(schedule, slot, 0)
    if not window[0] <= db_now < window[1] - timedelta(seconds=5):  # too near the next tick
        await asyncio.sleep((window[1] - db_now).total_seconds() + 0.1)
        db_now = await db.fetchval("SELECT now()")
        slot = schedule.slot_for(db_now, 0)
        window = slot_window(schedule, slot, 0)
    await db.execute(
        """INSERT INTO cronlock.runs (job, slot, status, trigger, instance)
           VALUES ('minutely', $1, 'succeeded', 'scheduled', 'earlier')""",
        slot,
    )

    async def done(**changes: Any) -> bool:
        given: dict[str, Any] = {"slot": slot, "window": window, **changes}
        return await done_already(db, done_question("cronlock", name, key, **given))

    assert await done()
    before = slot - timedelta(minutes=1)
    assert not await done(slot=before, window=slot_window(schedule, before, 0))  # not done
    assert not await done(window=(slot - timedelta(minutes=2), slot - timedelta(minutes=1)))
    await db.execute("INSERT INTO cronlock.pauses (job, paused_by) VALUES ('minutely', 'op')")
    assert not await done()
    await db.execute("DELETE FROM cronlock.pauses")
    assert await done(lease=True)


@contextlib.asynccontextmanager
async def runner_on(settings: Settings, kind: type[Runner] = Runner) -> AsyncIterator[Runner]:
    """A runner (of `kind`) over the settings' jobs, its database open for the block."""
    database = Database(settings)
    await database.open()
    try:
        yield kind(settings, load(settings.job_modules), database)
    finally:
        await database.close()


class LaggingRunner(Runner):
    """An instance whose clock is a tick behind the database's: its hint names the previous
    slot, which is done, so the probe skips the lock table and `running` comes back NULL."""

    def _done_hint(self, job: Job) -> datetime | None:
        hint = super()._done_hint(job)
        return hint - timedelta(minutes=1) if hint is not None else None


async def test_a_wrong_hint_costs_speed_never_a_decision(
    make_settings: Callable[..., Settings], db: asyncpg.Connection, database_url: str
) -> None:
    await db.execute(
        """INSERT INTO cronlock.runs (job, slot, status, trigger, instance)
           VALUES ('minutely', date_trunc('minute', now()) - interval '1 minute',
                   'succeeded', 'scheduled', 'earlier')"""
    )
    other = await asyncpg.connect(database_url, statement_cache_size=0)
    try:
        async with runner_on(make_settings(), LaggingRunner) as runner:
            job = runner.registry["minutely"]
            async with other.transaction():
                await other.execute(
                    "SELECT pg_advisory_xact_lock(hashtextextended('cronlock:minutely', 0))"
                )
                held = await runner.trigger(job)
                assert (held.kind, held.reason) == ("skipped", "already running")
            ran = await runner.trigger(job)
            assert ran.kind == "succeeded"
            again = await runner.trigger(job)
            assert (again.kind, again.reason, again.slot) == ("skipped", "already done", ran.slot)
    finally:
        await other.close()
    assert [r["status"] for r in await runs(db, "minutely")] == ["succeeded", "succeeded"]


def calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[tuple[Any, ...]]:
    """The calls of the runner's `name` (a cronlock/db/lock.py statement), their arguments."""
    called: list[tuple[Any, ...]] = []
    original = getattr(runner_module, name)

    async def counted(*args: Any, **kwargs: Any) -> Any:
        called.append(args)
        return await original(*args, **kwargs)

    monkeypatch.setattr(runner_module, name, counted)
    return called


async def test_a_known_done_slot_is_asked_in_one_round_trip_and_anything_else_falls_back(
    make_settings: Callable[..., Settings],
    db: asyncpg.Connection,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once a probe saw the slot done, the next trigger asks only whether it still is (one
    round trip, no full probe); a pause, or the run gone from the ledger, goes through the full
    probe and answers as before."""
    full = calls(monkeypatch, "probe")
    settings = make_settings()
    job = load(settings.job_modules)["minutely"]
    assert job.schedule is not None
    db_now = await db.fetchval("SELECT now()")
    slot = job.schedule.slot_for(db_now, job.early_tolerance)
    left = (slot_window(job.schedule, slot, job.early_tolerance)[1] - db_now).total_seconds()
    if left < 25:  # all of it within one slot, on a loaded machine too
        await asyncio.sleep(left + 0.1)
    async with runner_on(settings) as runner:
        ran = await runner.trigger(job)
        assert ran.kind == "succeeded"
        assert len(full) == 1
        second = await runner.trigger(job)
        assert (second.reason, second.slot, len(full)) == ("already done", ran.slot, 2)
        third = await runner.trigger(job)
        assert (third.reason, third.slot, len(full)) == ("already done", ran.slot, 2)
        await db.execute("INSERT INTO cronlock.pauses (job, paused_by) VALUES ('minutely', 'op')")
        paused = await runner.trigger(job)
        assert (paused.reason, len(full)) == ("paused", 3)
        await db.execute("DELETE FROM cronlock.pauses")
        assert ((await runner.trigger(job)).reason, len(full)) == ("already done", 4)
        assert ((await runner.trigger(job)).reason, len(full)) == ("already done", 4)
        # The run gone from the ledger (by hand): the one-round-trip question says no, the full
        # probe sends the trigger on, and the slot runs again.
        await db.execute("DELETE FROM cronlock.runs")
        assert ((await runner.trigger(job)).kind, len(full)) == ("succeeded", 5)
        assert ((await runner.trigger(job)).reason, len(full)) == ("already done", 6)


async def test_a_keyed_run_is_never_asked_in_one_round_trip(
    make_settings: Callable[..., Settings],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run's key is a caller's: it stays a bind parameter, so a keyed job always takes the
    full probe (which answers "already done" as before)."""
    asked = calls(monkeypatch, "done_already")
    async with runner_on(make_settings()) as runner:
        job = runner.registry["keyed-yearly"]
        assert job.params is not None
        params = job.params.model_validate({"customer_id": 7})
        ran = await runner.trigger(job, params=params)
        again = [await runner.trigger(job, params=params) for _ in range(3)]
        assert ran.kind == "succeeded"
        assert {(o.reason, o.slot) for o in again} == {("already done", ran.slot)}
        assert asked == []


class DayBehind(datetime):
    """This instance's clock, a day behind the database's."""

    @classmethod
    def now(cls, tz: Any = None) -> DayBehind:
        real = datetime.now(tz)
        return cls.fromtimestamp(real.timestamp() - 86400, tz)


async def test_the_hint_reads_the_database_s_clock_as_the_last_probe_saw_it(
    make_settings: Callable[..., Settings],
    db: asyncpg.Connection,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An instance whose clock is a day off still hints the slot the database's clock is in
    once it has probed (the hint only saves the lock-table scan, but that is the probe's
    dearest part): it corrects its clock with the offset each probe sees."""
    monkeypatch.setattr("cronlock.core.runner.datetime", DayBehind)
    async with runner_on(make_settings()) as runner:
        job = runner.registry["minutely"]
        assert job.schedule is not None
        db_now = await db.fetchval("SELECT now()")
        now_slot = job.schedule.slot_for(db_now, job.early_tolerance)
        assert runner._done_hint(job) == now_slot - timedelta(days=1)
        assert (await runner.trigger(job)).kind == "succeeded"
        db_now = await db.fetchval("SELECT now()")
        seen = {job.schedule.slot_for(db_now - timedelta(seconds=s), job.early_tolerance)
                for s in (0, 5)}  # fmt: skip
        assert runner._done_hint(job) in seen


def test_colliding_lock_keys_refuse_to_start() -> None:
    registry = load(["tests.jobs"])
    keys = {name: registry.key(name) for name in registry}
    keys["slow"] = keys["fast"]  # what a 64-bit collision would look like
    with pytest.raises(JobDefinitionError, match="same lock key"):
        registry.check_keys(keys)
    Registry(registry.jobs, registry.namespace).check_keys()


async def test_a_trigger_waits_for_migrations_at_most_the_query_timeout(
    make_settings: Callable[..., Settings], db: asyncpg.Connection
) -> None:
    """Another instance mid-migration holds the migration lock: a trigger arriving before this
    instance has seen the database ready answers 503 after DB_QUERY_TIMEOUT instead of queueing
    behind the migration for as long as it takes; once the lock goes, the shared check ends."""
    # The probe's migration is pending, as after an upgrade of the code.
    await db.execute("DROP FUNCTION cronlock.probe(text, oid, oid, boolean, timestamptz)")
    await db.execute("DELETE FROM cronlock.migrations WHERE module = 'cronlock' AND version = 3")
    database = Database(make_settings(db_query_timeout=1.0))
    await database.open()
    try:
        async with db.transaction():
            await db.execute(LOCK_SQL, migrate_lock("cronlock"))
            started = time.monotonic()
            with pytest.raises(DatabaseUnavailable, match="did not finish within 1 s"):
                await database.ensure_ready()
            assert time.monotonic() - started < 3
        await database.ensure_ready()
        assert database.migrated
    finally:
        await database.close()


def test_a_job_must_be_async() -> None:
    def plain(ctx: Any) -> int:
        return 1

    with pytest.raises(JobDefinitionError, match="must be an async def"):
        job("plain-function")(plain)  # type: ignore[arg-type]  # what mypy would catch too


async def test_instances_booting_together_migrate_once(
    pg_server: Any, start_instances: Callable[..., list[Any]]
) -> None:
    admin = await asyncpg.connect(pg_server.dsn("postgres"))
    name = "boot_" + "".join(random.choices(string.ascii_lowercase, k=8))
    await admin.execute(f"CREATE DATABASE {name}")
    try:
        url = pg_server.dsn(name)
        instances = start_instances(["b0", "b1", "b2"], {"DATABASE_URL": url})
        async with httpx.AsyncClient(timeout=10) as client:
            for instance in instances:

                async def ready(i: Any = instance) -> bool:
                    return (await client.get(i.url + "/readyz")).status_code == 200

                await wait_for(ready, 20, "instances to be ready")
        conn = await asyncpg.connect(url)
        try:
            rows = await conn.fetch(
                "SELECT module, version FROM cronlock.migrations ORDER BY module, version"
            )
        finally:
            await conn.close()
        expected = [("cronlock", m.version) for m in cronlock_migrations().migrations]
        assert [(r["module"], r["version"]) for r in rows] == expected
        for instance in instances:
            instance.kill()
    finally:
        await admin.execute(f"DROP DATABASE {name} WITH (FORCE)")
        await admin.close()


async def test_instance_started_while_database_is_down(
    tmp_path: Path, start_instance: Starter
) -> None:
    port = free_port()
    server = ScratchPostgres(tmp_path / "pg", port)
    instance = start_instance("early", {"DATABASE_URL": server.dsn("postgres")})
    async with httpx.AsyncClient(timeout=10) as client:
        assert (await client.get(instance.url + "/healthz")).status_code == 200
        r = await client.get(instance.url + "/readyz")
        assert r.status_code == 503
        assert r.json()["reason"]
        r = await post(client, instance.url + "/cron/fast")
        assert r.status_code == 503
        assert r.headers["retry-after"]
        assert r.json()["error"] == "database unavailable"
        server.start()
        try:

            async def ready() -> bool:
                return (await client.get(instance.url + "/readyz")).status_code == 200

            await wait_for(ready, 20, "the instance to become ready")
            r = await post(client, instance.url + "/cron/fast")
            assert r.status_code == 200, r.text
            assert r.json()["processed"] == 1
        finally:
            instance.kill()
            server.stop()


async def test_standby_refuses_jobs(
    pg_server: Any, tmp_path: Path, start_instance: Starter, template_database: str
) -> None:
    if not hasattr(pg_server, "bindir"):
        pytest.skip("needs a local server to clone (DATABASE_URL points elsewhere)")
    # A done slot in a database the standby copies: the one-round-trip probe's "done" is never
    # a standby's (the primary says it, then the standby, which has the same ledger, does not).
    admin = await asyncpg.connect(pg_server.dsn())
    await admin.execute("DROP DATABASE IF EXISTS standby_done")
    await admin.execute(f"CREATE DATABASE standby_done TEMPLATE {template_database}")
    await admin.close()
    primary = await asyncpg.connect(pg_server.dsn("standby_done"))
    slot = Schedule.parse("0 0 1 1 *").prev_tick(await primary.fetchval("SELECT now()"))
    window = (slot, slot + timedelta(days=3660))
    try:
        await primary.execute(
            """INSERT INTO cronlock.runs (job, slot, status, trigger, instance)
               VALUES ('yearly', $1, 'succeeded', 'scheduled', 'earlier')""",
            slot,
        )
        key = lock_key("y", 0)
        question = done_question("cronlock", "yearly", key, slot=slot, window=window)
        assert await done_already(primary, question)
    finally:
        await primary.close()
    standby = await asyncio.to_thread(start_standby, pg_server, tmp_path / "standby")
    try:
        copy = await asyncpg.connect(standby.dsn("standby_done"))
        try:
            assert await copy.fetchval("SELECT count(*) FROM cronlock.runs") == 1
            assert not await done_already(copy, question)
        finally:
            await copy.close()
        instance = start_instance("standby", {"DATABASE_URL": standby.dsn(template_database)})
        async with httpx.AsyncClient(timeout=10) as client:
            r = await client.get(instance.url + "/readyz")
            assert r.status_code == 503
            assert "standby" in r.json()["reason"]
            r = await client.post(instance.url + "/cron/fast", headers=AUTH)
            assert r.status_code == 503
            assert "standby" in r.json()["reason"]
            assert (await client.get(instance.url + "/healthz")).status_code == 200
        instance.kill()
    finally:
        standby.stop()
        admin = await asyncpg.connect(pg_server.dsn())
        await admin.execute("DROP DATABASE IF EXISTS standby_done")
        await admin.close()
