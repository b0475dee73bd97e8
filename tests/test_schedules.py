"""Dynamic schedules (cronlock/core/schedules.py): validation before any write, writes in the
caller's transaction (asyncpg, SQLAlchemy), and dispatch by the built-in scheduler in-process
(one run per key and slot, changed and removed schedules, failing keys, spread). The proofs with
real processes are tests/test_schedules_processes.py."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import asyncpg
import pytest

from cronlock import Cronlock, InvalidSchedule, JobDefinitionError
from cronlock.core.jobs import define
from cronlock.settings import Settings
from tests.support.asgi import StartApp
from tests.util import wait_for

JOBS = "tests.dynamic_jobs"
EFFECTS_SQL = """
CREATE TABLE IF NOT EXISTS dyn_effects (
    job text, key text, slot timestamptz, run_id bigint, instance text,
    at timestamptz DEFAULT clock_timestamp())
"""


@pytest.fixture
async def effects_table(db: asyncpg.Connection) -> asyncpg.Connection:
    await db.execute(EFFECTS_SQL)
    return db


@pytest.fixture
def cron(make_settings: Callable[..., Settings]) -> Cronlock:
    return Cronlock(make_settings(cron_jobs=JOBS), housekeeping=False)


async def rows(db: asyncpg.Connection) -> int:
    return int(await db.fetchval("SELECT count(*) FROM cronlock.schedules"))


async def noop(ctx: Any) -> None:
    return None


# --- declaring -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({}, "needs key="),
        ({"key": "tenant_id", "every": 5}, "drop every= and tz="),
        ({"key": "tenant_id", "tz": "Europe/Berlin"}, "drop every= and tz="),
        ({"key": "tenant_id", "missed": "all"}, "drop catch_up= and missed="),
        ({"key": "tenant_id", "fanout": True}, "does not take fanout="),
    ],
)
def test_dynamic_declaration_refused(options: dict[str, Any], words: str) -> None:
    """What schedule="dynamic" cannot be combined with, refused at declaration in one line."""
    from tests.dynamic_jobs import Report

    with pytest.raises(JobDefinitionError, match=words):
        define("d", schedule="dynamic", params=Report, **options)(noop)


def test_spread_only_for_dynamic_jobs() -> None:
    with pytest.raises(JobDefinitionError, match="spread= is for dynamic jobs"):
        define("d", every=5, spread=3)(noop)
    from tests.dynamic_jobs import Report

    made = define("d", schedule="dynamic", key="tenant_id", params=Report, spread=3)(noop)
    assert made.dynamic
    assert made.schedule is None
    assert made.spread == 3.0


# --- setting -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("job", "key", "fields", "loc"),
    [
        ("tenant-report", 1, {"schedule": "0 0 30 2 *"}, ("schedule",)),
        ("tenant-report", 1, {"schedule": "0 9 * *"}, ("schedule",)),
        ("tenant-report", 1, {"schedule": "0 9 * * *", "tz": "Mars/Olympus"}, ("tz",)),
        ("tenant-report", 1, {"every": 0}, ("every",)),
        ("tenant-report", 1, {"every": 60, "tz": "Europe/Berlin"}, ("tz",)),
        ("tenant-report", 1, {}, ("schedule",)),
        ("tenant-report", 1, {"schedule": "* * * * *", "params": {"name": 5}}, ("params", "name")),
        (
            "tenant-report",
            1,
            {"schedule": "* * * * *", "params": {"sleep": -1}},
            ("params", "sleep"),
        ),
        (
            "tenant-report",
            1,
            {"schedule": "* * * * *", "params": {"tenant_id": 2}},
            ("params", "tenant_id"),
        ),
        ("tenant-report", 1, {"schedule": "* * * * *", "params": [1]}, ("params",)),
        ("tenant-report", "abc", {"schedule": "* * * * *"}, ("key",)),
        ("tenant-report", True, {"schedule": "* * * * *"}, ("key",)),
        ("user-digest", "x" * 201, {"schedule": "* * * * *"}, ("key",)),
        ("user-digest", "a\x00b", {"schedule": "* * * * *"}, ("key",)),
        ("user-digest", "", {"schedule": "* * * * *"}, ("key",)),
        ("keyed-by-hand", 1, {"schedule": "* * * * *"}, ("job",)),
        ("no-such-job", 1, {"schedule": "* * * * *"}, ("job",)),
    ],
)
async def test_bad_schedule_refused_naming_the_field(
    cron: Cronlock,
    db: asyncpg.Connection,
    job: str,
    key: Any,
    fields: dict[str, Any],
    loc: tuple[str, ...],
) -> None:
    """Every refusal names its field, and nothing is written."""
    with pytest.raises(InvalidSchedule) as caught:
        await cron.schedules.set(db, job, key, **fields)
    assert caught.value.loc == loc, caught.value.reason
    assert await rows(db) == 0


async def test_limit_refused_when_configured(
    make_settings: Callable[..., Settings], db: asyncpg.Connection
) -> None:
    """SCHEDULES_MAX: the schedule beyond it is refused (key), replacing one is not."""
    cron = Cronlock(make_settings(cron_jobs=JOBS, schedules_max=2), housekeeping=False)
    for key in (1, 2):
        await cron.schedules.set(db, "tenant-report", key, schedule="0 9 * * *")
    with pytest.raises(InvalidSchedule, match="SCHEDULES_MAX") as caught:
        await cron.schedules.set(db, "tenant-report", 3, schedule="0 9 * * *")
    assert caught.value.loc == ("key",)
    await cron.schedules.set(db, "tenant-report", 2, schedule="0 10 * * *")
    assert await rows(db) == 2


async def test_set_get_list_pause_resume_remove(cron: Cronlock, db: asyncpg.Connection) -> None:
    """The row as set: the key's canonical text, the params with the key, the next tick in the
    key's zone; listing by key prefix and pages; pause and resume; remove."""
    s = cron.schedules
    row = await s.set(
        db,
        "tenant-report",
        "042",
        schedule="0 9 * * 1-5",
        tz="America/New_York",
        params={"name": "weekly"},
    )
    assert row.key == "42"
    assert row.params == {"tenant_id": 42, "name": "weekly", "fail": False, "sleep": 0.0}
    local = row.next_at.astimezone(__import__("zoneinfo").ZoneInfo("America/New_York"))
    assert (local.hour, local.minute) == (9, 0)
    assert local.weekday() < 5
    assert row.next_at == row.due_at
    assert row.to_json()["next_at_local"].endswith(("-05:00", "-04:00"))
    for key in ("user-1", "user-2", "admin"):
        await s.set(db, "user-digest", key, every=3600)
    users = await s.list(db, "user-digest", prefix="user-")
    assert [r.key for r in users] == ["user-1", "user-2"]
    page = await s.list(db, "user-digest", limit=2)
    rest = await s.list(db, "user-digest", after=page[-1].key)
    assert [r.key for r in page + rest] == ["admin", "user-1", "user-2"]
    # The spread puts each key's start within 2 s of its tick, the same at every set.
    digest = await s.get(db, "user-digest", "admin")
    assert digest is not None
    assert timedelta(0) <= digest.due_at - digest.next_at < timedelta(seconds=2)
    paused = await s.pause(db, "tenant-report", 42)
    assert paused is not None
    assert paused.paused
    assert paused.version == row.version + 1
    assert await s.list(db, "tenant-report", due_before=row.next_at + timedelta(days=9)) == []
    resumed = await s.resume(db, "tenant-report", 42)
    assert resumed is not None
    assert not resumed.paused
    assert await s.remove(db, "tenant-report", 42)
    assert not await s.remove(db, "tenant-report", 42)
    assert await s.get(db, "tenant-report", 42) is None
    assert await s.pause(db, "tenant-report", 42) is None


async def test_set_in_a_transaction_that_rolls_back_leaves_nothing(
    cron: Cronlock, db: asyncpg.Connection
) -> None:
    """asyncpg: the schedule commits with the caller's transaction or not at all."""
    tx = db.transaction()
    await tx.start()
    await cron.schedules.set(db, "tenant-report", 7, every=1)
    assert await rows(db) == 1
    await tx.rollback()  # the sign-up failed
    assert await rows(db) == 0


async def test_sqlalchemy_session_and_connection(cron: Cronlock, database_url: str) -> None:
    """An AsyncSession's and an AsyncConnection's transactions: rolled back, nothing; committed,
    the row."""
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    url = database_url.replace("postgresql://", "postgresql+asyncpg://", 1)
    engine = create_async_engine(url)
    try:
        async with AsyncSession(engine) as session, session.begin():
            await cron.schedules.set(session, "tenant-report", 1, schedule="0 9 * * *")
            assert await cron.schedules.get(session, "tenant-report", 1) is not None
            await session.rollback()
        async with engine.connect() as conn:
            assert await cron.schedules.get(conn, "tenant-report", 1) is None
            await conn.rollback()  # the get autobegan SQLAlchemy's transaction
            async with conn.begin():
                await cron.schedules.set(conn, "tenant-report", 1, schedule="0 9 * * *")
        async with AsyncSession(engine) as session:
            found = await cron.schedules.list(session, "tenant-report")
            assert [r.key for r in found] == ["1"]
    finally:
        await engine.dispose()
    with pytest.raises(TypeError, match="asyncpg connection, a SQLAlchemy"):
        await cron.schedules.get(object(), "tenant-report", 1)


# --- dispatching ---------------------------------------------------------------------------------

DISPATCH = {
    "cron_jobs": JOBS,
    "scheduler_enabled": True,
    "scheduler_poll_interval": 0.2,
    "scheduler_claim_timeout": 2.0,
}


async def effects_by_key(
    db: asyncpg.Connection, job: str = "tenant-report"
) -> dict[str, list[Any]]:
    found: dict[str, list[Any]] = {}
    for r in await db.fetch("SELECT key, slot FROM dyn_effects WHERE job = $1 ORDER BY slot", job):
        found.setdefault(r["key"], []).append(r["slot"])
    return found


async def test_two_dispatchers_one_run_per_key_and_slot(
    start_app: StartApp, cron: Cronlock, effects_table: asyncpg.Connection
) -> None:
    """20 keys every second, two instances: each (key, slot) runs once."""
    db = effects_table
    for key in range(20):
        await cron.schedules.set(db, "tenant-report", key, every=1)
    await start_app("a", **DISPATCH)
    await start_app("b", **DISPATCH)

    async def three_each() -> bool:
        found = await effects_by_key(db)
        return len(found) == 20 and all(len(v) >= 3 for v in found.values())

    await wait_for(three_each, 15, "three runs of each key")
    await asyncio.sleep(0.5)
    for tenant, slots in (await effects_by_key(db)).items():
        assert len(slots) == len(set(slots)), (tenant, slots)
        # Ticks: a dispatcher that falls more than a tick behind (a loaded machine) runs the
        # latest due one, so a gap is a whole number of ticks; none missed is proven where the
        # ticks are further apart (tests/test_schedules_processes.py).
        gaps = {b - a for a, b in itertools.pairwise(slots)}
        assert all(g.total_seconds() % 1 == 0 for g in gaps), (tenant, slots)
    runs = await db.fetch(
        "SELECT key, slot, count(*) FROM cronlock.runs WHERE job = 'tenant-report'"
        " GROUP BY key, slot HAVING count(*) > 1"
    )
    assert runs == []


async def test_failing_key_advances_and_blocks_nobody(
    start_app: StartApp, cron: Cronlock, effects_table: asyncpg.Connection
) -> None:
    """A key whose runs fail moves on at each failure (one attempt per slot, no hot loop); the
    other keys run."""
    db = effects_table
    await cron.schedules.set(db, "tenant-report", 1, every=1, params={"fail": True})
    await cron.schedules.set(db, "tenant-report", 2, every=1)
    await start_app("a", **DISPATCH)

    async def ran() -> bool:
        return len((await effects_by_key(db)).get("2", [])) >= 3

    await wait_for(ran, 10, "the healthy key's runs")
    failed = await db.fetch(
        "SELECT slot FROM cronlock.runs WHERE job = 'tenant-report' AND key = '1'"
        " AND status = 'failed'"
    )
    slots = [r["slot"] for r in failed]
    assert 1 <= len(slots) <= 6
    assert len(slots) == len(set(slots))


async def test_changed_schedule_runs_nothing_more_of_the_old_and_set_never_waits(
    start_app: StartApp, cron: Cronlock, effects_table: asyncpg.Connection
) -> None:
    """A run under way when its schedule is replaced finishes; no later slot of the old schedule
    runs; the set answers while the run holds its key's lock; a removed schedule runs nothing."""
    db = effects_table
    await cron.schedules.set(db, "tenant-report", 5, every=1, params={"sleep": 2})
    await start_app("a", **DISPATCH)

    async def running() -> bool:
        return bool(
            await db.fetchval(
                "SELECT count(*) FROM cronlock.runs WHERE job = 'tenant-report'"
                " AND status = 'running'"
            )
        )

    await wait_for(running, 10, "a run under way")
    started = time.monotonic()
    async with db.transaction():
        await cron.schedules.set(db, "tenant-report", 5, every=3600)
    assert time.monotonic() - started < 0.5

    async def finished() -> bool:
        return not await running()

    await wait_for(finished, 10, "the run's end")
    await asyncio.sleep(1.5)
    done = await db.fetch(
        "SELECT slot, status FROM cronlock.runs WHERE job = 'tenant-report' AND key = '5'"
    )
    assert len(done) == 1, done
    assert done[0]["status"] == "succeeded"
    row = await cron.schedules.get(db, "tenant-report", 5)
    assert row is not None
    assert row.every == 3600
    assert row.next_at > done[0]["slot"] + timedelta(seconds=1)

    await cron.schedules.set(db, "user-digest", "u", every=1)

    async def digest_ran() -> bool:
        return await _count(db, "user-digest") > 0

    await wait_for(digest_ran, 10, "a run of the digest")
    await cron.schedules.remove(db, "user-digest", "u")
    before = await _count(db, "user-digest")
    await asyncio.sleep(3.5)  # longer than the spread (2 s) plus a tick
    assert await _count(db, "user-digest") <= before + 1  # one may have been under way


async def _count(db: asyncpg.Connection, job: str) -> int:
    return int(await db.fetchval("SELECT count(*) FROM dyn_effects WHERE job = $1", job))


async def test_paused_schedule_is_not_dispatched(
    start_app: StartApp, cron: Cronlock, effects_table: asyncpg.Connection
) -> None:
    db = effects_table
    await cron.schedules.set(db, "tenant-report", 8, every=1, paused=True)
    await cron.schedules.set(db, "tenant-report", 9, every=1)
    await start_app("a", **DISPATCH)

    async def nine_ran() -> bool:
        return len((await effects_by_key(db)).get("9", [])) >= 2

    await wait_for(nine_ran, 10, "key 9's runs")
    assert "8" not in await effects_by_key(db)
