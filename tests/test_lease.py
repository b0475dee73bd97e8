"""Lease mode, in process: the 202 answer, one live run per (job, key) whatever the trigger,
fenced steps and checkpoints, attempts that resume, takeover after a holder gives its lease
up, cancel, the run's timeout, and the declarations refused up front. The crash and freeze
proofs with real processes are in tests/test_lease_faults.py."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import httpx
import pytest

from cronlock.core import lease
from cronlock.core.jobs import job, load
from cronlock.errors import JobDefinitionError
from cronlock.ops import views as ops
from cronlock.settings import Settings
from tests.lease_jobs import LEASE_SETTINGS, create_effects
from tests.util import AUTH, successor, wait_for

Starter = Callable[..., Any]


@pytest.fixture
async def effects_table(db: asyncpg.Connection) -> asyncpg.Connection:
    await create_effects(db)
    return db


async def start(start_app: Starter, name: str = "a", **overrides: Any) -> Any:
    return await start_app(name, cron_jobs="tests.lease_jobs", **{**LEASE_SETTINGS, **overrides})


async def view(client: httpx.AsyncClient, app: Any, run_id: int) -> dict[str, Any]:
    r = await client.get(f"{app.url}/cron/runs/{run_id}", headers=AUTH)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


async def settled(client: httpx.AsyncClient, app: Any, run_id: int, within: float = 20) -> Any:
    async def done() -> bool:
        return bool((await view(client, app, run_id))["status"] != "running")

    await wait_for(done, within, f"run {run_id} to end")
    return await view(client, app, run_id)


async def duplicates(db: asyncpg.Connection, job: str) -> list[Any]:
    return await db.fetch(
        "SELECT item, count(*) FROM lease_effects WHERE job = $1 GROUP BY item HAVING count(*) > 1",
        job,
    )


async def items(db: asyncpg.Connection, job: str) -> int:
    return int(await db.fetchval("SELECT count(*) FROM lease_effects WHERE job = $1", job))


async def items_under_way(
    client: httpx.AsyncClient, url: str, effects_table: asyncpg.Connection, done: int
) -> int:
    """A lease-items run of 16 items in steps of 2 (0.3 s each), once `done` items are in;
    its run id."""
    r = await client.post(
        f"{url}/cron/lease-items", headers=AUTH, json={"n": 16, "batch": 2, "pause": 0.3}
    )
    run_id: int = r.json()["run_id"]

    async def some_done() -> bool:
        return await items(effects_table, "lease-items") >= done

    await wait_for(some_done, 10, f"{done} items")
    return run_id


async def test_a_lease_run_answers_202_and_works_in_fenced_steps(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    a = await start(start_app)
    r = await client.post(
        f"{a.url}/cron/lease-items", headers=AUTH, json={"n": 60, "batch": 5, "pause": 0.03}
    )
    assert r.status_code == 202, r.text
    body = r.json()
    assert set(body) == {"job", "run_id", "slot", "lease_expires_at"}
    assert body["job"] == "lease-items"
    assert body["slot"] is None
    run_id = body["run_id"]

    running = await view(client, a, run_id)
    assert running["status"] == "running"
    assert running["running"] is True
    assert running["holder"] == "a"
    assert running["attempt"] == 1
    assert running["token"] >= 1
    locks = (await client.get(f"{a.url}/cron/locks", headers=AUTH)).json()["locks"]
    held = [lk for lk in locks if lk["kind"] == "lease"]
    assert [(lk["job"], lk["run_id"], lk["instance"]) for lk in held] == [
        ("lease-items", run_id, "a")
    ]
    jobs = (await client.get(f"{a.url}/cron/jobs", headers=AUTH)).json()["jobs"]
    mine = next(j for j in jobs if j["name"] == "lease-items")
    assert mine["running"] is True
    assert mine["running_on"]["run_id"] == run_id

    done = await settled(client, a, run_id)
    assert done["status"] == "succeeded"
    assert done["result"] == 60
    assert done["checkpoint"] == {"last": 60}
    assert done["progress"] == {"done": 60, "total": 60}
    assert done["steps"] == 12
    assert done["running"] is False
    assert done["holder"] is None
    assert await items(effects_table, "lease-items") == 60
    assert await duplicates(effects_table, "lease-items") == []


async def test_while_a_lease_is_live_every_trigger_on_every_instance_is_already_running(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    a = await start(start_app, "a")
    b = await start(start_app, "b")
    r = await client.post(
        f"{a.url}/cron/lease-items", headers=AUTH, json={"n": 40, "batch": 2, "pause": 0.05}
    )
    assert r.status_code == 202
    # The probe's answer (a plain trigger), the lock statement's (force skips the probe), on
    # the holder and on the other instance: the lease decides, not the advisory lock.
    for app in (a, b):
        for query in ("", "?force=true"):
            skip = await client.post(f"{app.url}/cron/lease-items{query}", headers=AUTH, json={})
            assert skip.status_code == 200, skip.text
            assert skip.json() == {
                "job": "lease-items",
                "skipped": True,
                "reason": "already running",
            }
    await settled(client, a, r.json()["run_id"])
    assert await items(effects_table, "lease-items") == 40
    assert await duplicates(effects_table, "lease-items") == []


async def test_a_stale_token_commits_nothing_and_says_why(
    start_app: Starter,
    client: httpx.AsyncClient,
    effects_table: asyncpg.Connection,
    make_settings: Callable[..., Settings],
) -> None:
    """The fence itself: a step whose token is not the row's raises LeaseLost and its writes
    roll back; the run's own holder goes on."""
    a = await start(start_app)
    r = await client.post(
        f"{a.url}/cron/lease-items", headers=AUTH, json={"n": 30, "batch": 3, "pause": 0.05}
    )
    run_id = r.json()["run_id"]
    row = await effects_table.fetchrow(
        "SELECT lease_token FROM cronlock.runs WHERE id = $1", run_id
    )
    assert row is not None
    settings = make_settings(cron_jobs="tests.lease_jobs", **LEASE_SETTINGS)
    registry = load(settings.job_modules)
    from cronlock.core.jobs import JobContext
    from cronlock.db.pool import Database
    from cronlock.errors import LeaseLost

    db = Database(settings)
    await db.open()
    try:
        stale = lease.Fence(
            db,
            settings,
            job="lease-items",
            run_id=run_id,
            token=row["lease_token"] - 1,
            lease=2.0,
            checkpoint=None,
        )
        ctx: Any = JobContext(
            conn=None,  # type: ignore[arg-type]
            job=registry["lease-items"],
            run_id=run_id,
            slot=None,
            now=datetime.now(UTC),
            params=None,
            trigger="manual",
            instance="stale",
            settings=settings,
            steps=stale,
        )
        with pytest.raises(LeaseLost, match="newer token"):
            async with ctx.step() as conn:
                await conn.execute("INSERT INTO lease_effects VALUES (-1, 0, 'x', null, 'stale')")
    finally:
        await db.close()
    done = await settled(client, a, run_id)
    assert done["status"] == "succeeded"
    assert await effects_table.fetchval("SELECT count(*) FROM lease_effects WHERE item = -1") == 0
    assert await items(effects_table, "lease-items") == 30


async def test_a_trigger_takes_an_expired_run_over_and_the_old_holder_is_fenced_off(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    """No watcher (its poll is longer than the test): the next trigger takes over. The old
    holder is alive and unaware (as one paused long enough would be), so nothing but the
    fence stops it: its next step finds the run no longer its own and commits nothing."""
    a = await start(start_app, "a", lease_poll_interval=600)
    b = await start(start_app, "b", lease_poll_interval=600)
    first = await items_under_way(client, a.url, effects_table, 4)
    # The lease runs out under the holder's feet (a pause it did not see).
    await effects_table.execute(
        "UPDATE cronlock.runs SET lease_expires_at = now() - interval '1 second' WHERE id = $1",
        first,
    )
    # "already running" while the old holder has the row for a moment (NOWAIT): try again.
    for _ in range(20):
        taken = await client.post(f"{b.url}/cron/lease-items", headers=AUTH, json={"n": 1})
        if taken.status_code == 202:
            break
        assert taken.json()["reason"] == "already running", taken.text
        await asyncio.sleep(0.05)
    assert taken.status_code == 202, taken.text
    second = taken.json()["run_id"]
    assert second != first
    done = await settled(client, b, second)
    # The takeover kept the run's own params (n=16), not the trigger's.
    assert (done["status"], done["result"], done["attempt"], done["retry_of"]) == (
        "succeeded",
        16,
        2,
        first,
    )
    old = await view(client, a, first)
    assert old["status"] == "abandoned"
    assert f"taken over by run {second}" in old["error"]

    # Its log says so (the note it also adds to the row is best effort, bounded by the short
    # query timeout these tests run with).
    async def noticed() -> bool:
        return "stopped: lease lost" in a.log()

    await wait_for(noticed, 10, "the old holder to notice")
    assert await items(effects_table, "lease-items") == 16
    assert await duplicates(effects_table, "lease-items") == []


async def test_a_holder_whose_newest_steps_the_database_lost_hands_the_run_over(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    """What a failover to a standby that was behind does (tests/test_failover.py shows it
    on real servers), made here in one transaction: the run's row keeps its token and its
    lease but loses its newest steps, their items with them. The holder's next renewal finds
    fewer steps than it committed, so it gives the run up instead of carrying on from its own
    checkpoint; the takeover resumes from the database's, and every item is there once."""
    a = await start(start_app)
    first = await items_under_way(client, a.url, effects_table, 6)
    async with effects_table.transaction():
        # The row first: its lock waits for a step in flight, and holds off the next one.
        await effects_table.execute(
            """UPDATE cronlock.runs SET steps = 1, checkpoint = '{"last": 2}'::jsonb
               WHERE id = $1""",
            first,
        )
        await effects_table.execute("DELETE FROM lease_effects WHERE item > 2")
    taken = await successor(effects_table, first, 15)
    done = await settled(client, a, taken["id"])
    assert (done["status"], done["attempt"], done["retry_of"]) == ("succeeded", 2, first)
    old = await view(client, a, first)
    assert old["status"] == "abandoned"
    assert "lost commits" in a.log()
    assert await items(effects_table, "lease-items") == 16
    assert await duplicates(effects_table, "lease-items") == []


async def test_a_failed_attempt_is_resumed_by_the_next_trigger_for_its_slot(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    a = await start(start_app)
    slot = (datetime.now(UTC) - timedelta(minutes=5)).replace(second=0, microsecond=0)
    url = f"{a.url}/cron/lease-slot?slot={slot.isoformat().replace('+00:00', 'Z')}"
    params = {"n": 30, "batch": 5, "pause": 0.01, "fail_at": 15}
    r = await client.post(url, headers=AUTH, json=params)
    assert r.status_code == 202, r.text
    failed = await settled(client, a, r.json()["run_id"])
    assert failed["status"] == "failed"
    assert "failing on purpose at item 15" in failed["error"]
    assert failed["checkpoint"] == {"last": 15}

    again = await client.post(url, headers=AUTH, json=params)
    assert again.status_code == 202, again.text
    second = await settled(client, a, again.json()["run_id"])
    assert second["status"] == "succeeded"
    assert second["result"] == 30
    assert (second["attempt"], second["retry_of"]) == (2, failed["id"])
    assert await items(effects_table, "lease-slot") == 30
    assert await duplicates(effects_table, "lease-slot") == []
    # Once per slot holds for lease runs too.
    third = await client.post(url, headers=AUTH, json=params)
    assert third.json()["reason"] == "already done"


async def test_cronlock_retries_a_failed_lease_attempt_from_its_checkpoint(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    a = await start(start_app, retry_poll_interval=0.2)
    slot = (datetime.now(UTC) - timedelta(minutes=3)).replace(second=0, microsecond=0)
    url = f"{a.url}/cron/lease-retried?slot={slot.isoformat().replace('+00:00', 'Z')}"
    r = await client.post(
        url, headers=AUTH, json={"n": 30, "batch": 5, "pause": 0.01, "fail_at": 15}
    )
    assert r.status_code == 202, r.text

    async def succeeded() -> bool:
        return bool(
            await effects_table.fetchval(
                "SELECT EXISTS (SELECT 1 FROM cronlock.runs "
                "WHERE job = 'lease-retried' AND status = 'succeeded')"
            )
        )

    await wait_for(succeeded, 15, "the retry to succeed")
    rows = await effects_table.fetch(
        "SELECT id, status, attempt, retry_of, source, slot FROM cronlock.runs ORDER BY id"
    )
    assert [(x["status"], x["attempt"], x["source"]) for x in rows] == [
        ("failed", 1, "http"),
        ("succeeded", 2, "retry"),
    ]
    assert rows[1]["retry_of"] == rows[0]["id"]
    assert rows[1]["slot"] == slot
    # Resumed from the failed attempt's checkpoint: each item once.
    assert await items(effects_table, "lease-retried") == 30
    assert await duplicates(effects_table, "lease-retried") == []


async def test_cancel_reaches_a_lease_run_through_its_holder(
    start_app: Starter,
    client: httpx.AsyncClient,
    effects_table: asyncpg.Connection,
    make_settings: Callable[..., Settings],
) -> None:
    a = await start(start_app)
    r = await client.post(
        f"{a.url}/cron/lease-items", headers=AUTH, json={"n": 10_000, "batch": 1, "pause": 0.1}
    )
    run_id = r.json()["run_id"]
    settings = make_settings(cron_jobs="tests.lease_jobs", **LEASE_SETTINGS)
    registry = load(settings.job_modules, settings.lock_namespace, settings.db_schema)
    conn = await asyncpg.connect(settings.database_url)
    try:
        done = await ops.cancel(conn, registry, settings, "lease-items", terminate=False, wait=5.0)
    finally:
        await conn.close()
    assert done is not None
    assert done.holder.kind == "lease"
    assert done.released
    assert done.run is not None
    assert done.run.status == "cancelled"
    assert (await view(client, a, run_id))["cancel_requested_at"] is not None
    written = await items(effects_table, "lease-items")
    await asyncio.sleep(0.5)
    assert await items(effects_table, "lease-items") == written  # nothing after the cancel


async def test_the_timeout_bounds_the_whole_run(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    a = await start(start_app)
    r = await client.post(
        f"{a.url}/cron/lease-short", headers=AUTH, json={"n": 10_000, "batch": 1, "pause": 0.1}
    )
    done = await settled(client, a, r.json()["run_id"], within=10)
    assert done["status"] == "timed_out"
    assert "timeout of 3" in done["error"]
    assert 2900 < done["duration_ms"] < 5000


async def test_a_lease_job_has_no_connection_of_its_own(
    start_app: Starter, client: httpx.AsyncClient
) -> None:
    a = await start(start_app)
    r = await client.post(f"{a.url}/cron/lease-outside", headers=AUTH)
    done = await settled(client, a, r.json()["run_id"])
    assert done["status"] == "failed"
    assert "is a lease job: it has no ctx.conn" in done["error"]


async def test_keys_of_a_lease_job_run_at_once_one_run_per_key(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    """200 concurrent triggers for 20 keys over 3 instances: one run per key, and runs of
    different keys overlap in time."""
    # The longest query timeout a 2 s lease allows (cronlock/core/jobs.py `check_leases`): the
    # storm's decisions queue behind one another on two cores.
    roomy = {"db_pool_max_size": 20, "db_query_timeout": 1.2, "lease_margin": 0.1}
    apps = [await start(start_app, name, **roomy) for name in ("a", "b", "c")]
    answers = await asyncio.gather(
        *(
            client.post(
                f"{apps[n % 3].url}/cron/lease-customer",
                headers=AUTH,
                json={"customer_id": n % 20, "n": 20},
            )
            for n in range(200)
        )
    )
    assert {r.status_code for r in answers} <= {200, 202}, {r.text for r in answers}
    accepted = [r.json() for r in answers if r.status_code == 202]
    assert sorted(int(x["key"]) for x in accepted) == list(range(20))
    assert all(r.json()["reason"] == "already running" for r in answers if r.status_code == 200)
    for x in accepted:
        assert (await settled(client, apps[0], x["run_id"]))["status"] == "succeeded"
    per_key = await effects_table.fetch(
        "SELECT key, count(*), count(DISTINCT item) AS items, min(at) AS first, max(at) AS last "
        "FROM lease_effects WHERE job = 'lease-customer' GROUP BY key"
    )
    assert sorted((int(x["key"]), x["count"], x["items"]) for x in per_key) == [
        (k, 20, 20) for k in range(20)
    ]
    spans = sorted((x["first"], x["last"]) for x in per_key)
    overlapping = sum(1 for one, two in itertools.pairwise(spans) if two[0] < one[1])
    assert overlapping >= 1, spans


async def test_the_probe_reads_a_live_lease(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    """The trigger path's first look answers "already running" from the lease alone (no
    advisory lock is held between steps), for lease jobs only."""
    from cronlock.db.lock import lock_key, lock_text, probe

    a = await start(start_app)
    r = await client.post(
        f"{a.url}/cron/lease-items", headers=AUTH, json={"n": 40, "batch": 2, "pause": 0.05}
    )
    key = lock_key(lock_text("cronlock", "lease-items"), 0)
    as_lease = await probe(effects_table, "cronlock", "lease-items", key, lease=True)
    as_plain = await probe(effects_table, "cronlock", "lease-items", key)
    assert (as_lease["running"], as_plain["running"]) == (True, False)
    await settled(client, a, r.json()["run_id"])
    after = await probe(effects_table, "cronlock", "lease-items", key, lease=True)
    assert after["running"] is False


def test_a_lease_is_declared_within_its_timeout() -> None:
    with pytest.raises(JobDefinitionError, match="at most the timeout"):
        job("lease-too-long", lease=120, timeout=60)


def test_a_lease_too_short_for_the_timeouts_refuses_to_start(
    make_settings: Callable[..., Settings],
) -> None:
    from cronlock.service import create_app

    with pytest.raises(JobDefinitionError, match=r"lease=2\.0 s is too short for DB_QUERY_TIMEOUT"):
        create_app(make_settings(cron_jobs="tests.lease_jobs"))


def test_the_chunked_digest_is_a_lease_job() -> None:
    registry = load(["cronlock.demo.chunked"])
    assert registry["chunked-digest"].lease == 30
    assert json.dumps(registry["chunked-digest"].schedule.expr) == '"0 7 * * *"'  # type: ignore[union-attr]


async def test_the_cli_runs_a_lease_job_to_its_end(
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    effects_table: asyncpg.Connection,
) -> None:
    from cronlock.cli import main as cli
    from tests.lease_jobs import LEASE_ENV

    for name, value in {
        "DATABASE_URL": database_url,
        "CRON_JOBS": "tests.lease_jobs",
        "INSTANCE_NAME": "cli",
        **LEASE_ENV,
    }.items():
        monkeypatch.setenv(name, value)
    code = await asyncio.to_thread(
        cli.main, ["run", "lease-items", "--params", '{"n": 12, "batch": 4, "pause": 0}', "--json"]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert (out["processed"], out["job"]) == (12, "lease-items")
    assert await items(effects_table, "lease-items") == 12
    row = await effects_table.fetchrow("SELECT status, source, steps FROM cronlock.runs")
    assert row is not None
    assert tuple(row) == ("succeeded", "cli", 3)


# --- runs whose holder is gone -----------------------------------------------------------------


async def dead_run(
    db: asyncpg.Connection,
    job: str,
    params: dict[str, Any],
    *,
    key: str | None = None,
    deadline_in: float = 60.0,
    cancel: bool = False,
) -> int:
    """A lease run whose holder died: `running`, its lease run out a second ago."""
    run_id: int = await db.fetchval(
        """INSERT INTO cronlock.runs
               (job, key, trigger, source, instance, params, lease_token, lease_seconds,
                lease_expires_at, deadline_at, checkpoint, cancel_requested_at)
           VALUES ($1, $2, 'manual', 'http', 'gone', $3::jsonb,
                   nextval('cronlock.lease_tokens'), 2, now() - interval '1 second',
                   now() + make_interval(secs => $4), '{"last": 0}',
                   CASE WHEN $5 THEN now() END)
           RETURNING id""",
        job,
        key,
        json.dumps(params),
        deadline_in,
        cancel,
    )
    return run_id


async def status_of(db: asyncpg.Connection, run_id: int) -> str:
    return str(await db.fetchval("SELECT status FROM cronlock.runs WHERE id = $1", run_id))


async def test_the_watcher_skips_past_a_run_it_cannot_resume(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    """A run whose params this release no longer accepts is closed as failed, with why; a
    run with a pending cancel request is closed as cancelled rather than resumed; the one
    after them is taken over all the same."""
    bad = await dead_run(effects_table, "lease-customer", {"customer_id": -5}, key="-5")
    cancelled = await dead_run(
        effects_table, "lease-customer", {"customer_id": 6}, key="6", cancel=True
    )
    good = await dead_run(effects_table, "lease-customer", {"customer_id": 7, "n": 10}, key="7")
    await start(start_app)

    async def all_closed() -> bool:
        return all([await status_of(effects_table, r) != "running" for r in (bad, cancelled, good)])

    await wait_for(all_closed, 10, "the watcher to close the three runs")
    bad_row = await effects_table.fetchrow(
        "SELECT status, error FROM cronlock.runs WHERE id = $1", bad
    )
    assert bad_row is not None
    assert bad_row["status"] == "failed"
    assert "its params are not valid for this release" in bad_row["error"]
    assert await status_of(effects_table, cancelled) == "cancelled"
    successor = await effects_table.fetchval(
        "SELECT id FROM cronlock.runs WHERE retry_of = $1", good
    )
    assert successor is not None
    assert (
        await effects_table.fetchval(
            "SELECT count(*) FROM cronlock.runs WHERE retry_of = ANY($1::bigint[])",
            [bad, cancelled],
        )
        == 0
    )

    async def resumed() -> bool:
        return await status_of(effects_table, successor) == "succeeded"

    await wait_for(resumed, 10, "the taken-over run to finish")
    assert await items(effects_table, "lease-customer") == 10


async def test_the_timeout_bounds_a_run_across_its_takeover(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    first = await dead_run(
        effects_table, "lease-short", {"n": 10_000, "batch": 1, "pause": 0.1}, deadline_in=1.5
    )
    a = await start(start_app)

    second = (await successor(effects_table, first, 5))["id"]
    done = await settled(client, a, second, within=10)
    assert done["status"] == "timed_out"
    # At the deadline the first attempt set (1.5 s after it), not a fresh 3 s timeout.
    row = await effects_table.fetchrow(
        "SELECT r.finished_at - d.deadline_at AS late FROM cronlock.runs r, cronlock.runs d "
        "WHERE r.id = $1 AND d.id = $2",
        second,
        first,
    )
    assert row is not None
    assert abs(row["late"].total_seconds()) < 1.0


async def test_cancel_closes_a_run_with_no_live_holder(
    start_app: Starter, effects_table: asyncpg.Connection, make_settings: Callable[..., Settings]
) -> None:
    await start(start_app, lease_poll_interval=600)  # no watcher to take it over first
    run_id = await dead_run(effects_table, "lease-items", {"n": 10})
    settings = make_settings(cron_jobs="tests.lease_jobs", **LEASE_SETTINGS)
    registry = load(settings.job_modules, settings.lock_namespace, settings.db_schema)
    conn = await asyncpg.connect(settings.database_url)
    try:
        done = await ops.cancel(conn, registry, settings, "lease-items", terminate=False, wait=2)
    finally:
        await conn.close()
    assert done is not None
    assert done.released
    assert done.run is not None
    assert (done.run.id, done.run.status) == (run_id, "cancelled")


@pytest.mark.parametrize("error", ["OSError", "TimeoutError"])
async def test_an_error_of_the_jobs_own_code_fails_the_run_without_a_takeover(
    error: str, start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    """OSError and TimeoutError are also what a lost database raises; raised by the job's own
    code (a file, an HTTP call) they are its failure, recorded once, not a run handed over
    again and again."""
    a = await start(start_app)
    params = {"n": 20, "batch": 5, "pause": 0.01, "fail_at": 10, "fail_with": error}
    r = await client.post(f"{a.url}/cron/lease-items", headers=AUTH, json=params)
    done = await settled(client, a, r.json()["run_id"])
    assert done["status"] == "failed"
    assert f"{error}: failing on purpose at item 10" in done["error"]
    await asyncio.sleep(1.0)  # a watcher poll would have taken a handed-over run by now
    assert await effects_table.fetchval("SELECT count(*) FROM cronlock.runs") == 1


async def test_steps_longer_than_a_third_of_the_lease_are_not_stopped(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    """Each step holds its transaction 0.9 s of a 2 s lease, back to back: longer than the
    heartbeat's interval, within what the step's own renewal covers."""
    a = await start(start_app)
    r = await client.post(
        f"{a.url}/cron/lease-items",
        headers=AUTH,
        json={"n": 3, "batch": 1, "pause": 0, "hold": 0.9},
    )
    done = await settled(client, a, r.json()["run_id"])
    assert (done["status"], done["attempt"], done["steps"]) == ("succeeded", 1, 3)
    assert await effects_table.fetchval("SELECT count(*) FROM cronlock.runs") == 1


async def test_a_commit_whose_answer_is_lost_hands_the_run_over_and_nothing_is_done_twice(
    start_app: Starter,
    client: httpx.AsyncClient,
    effects_table: asyncpg.Connection,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The step's COMMIT lands but its answer never comes back (a connection reset at that
    moment, injected here at the driver: the commit really happens on the real server). The
    holder cannot know the step's outcome, so it must not carry on from its own idea of the
    checkpoint: it gives the run up, and the takeover resumes from what committed."""
    original = asyncpg.transaction.Transaction.commit
    lost: list[int] = []

    async def commit_then_lose_the_answer(self: asyncpg.transaction.Transaction) -> None:
        await original(self)
        if not lost:
            lost.append(1)
            raise ConnectionResetError("connection reset after the COMMIT was sent")

    a = await start(start_app)
    monkeypatch.setattr(asyncpg.transaction.Transaction, "commit", commit_then_lose_the_answer)
    r = await client.post(
        f"{a.url}/cron/lease-items", headers=AUTH, json={"n": 30, "batch": 3, "pause": 0.01}
    )
    first = r.json()["run_id"]

    async def finished() -> bool:
        return bool(
            await effects_table.fetchval(
                "SELECT EXISTS (SELECT 1 FROM cronlock.runs WHERE status = 'succeeded')"
            )
        )

    await wait_for(finished, 15, "the run to finish")
    assert lost == [1]
    rows = await effects_table.fetch("SELECT id, status, error FROM cronlock.runs ORDER BY id")
    assert [x["status"] for x in rows] == ["abandoned", "succeeded"]
    assert rows[0]["id"] == first
    assert "may or may not have landed" in rows[0]["error"]
    assert await items(effects_table, "lease-items") == 30
    assert await duplicates(effects_table, "lease-items") == []


async def test_the_chunked_digest_queues_one_email_per_enabled_user_in_steps(
    start_app: Starter, client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """The demo's lease job end to end: its users in chunks, the checkpoint the last user id,
    one email per enabled user for the slot, and a second trigger for the slot "already done"."""
    a = await start_app("a", cron_jobs="cronlock.demo.chunked")
    await db.execute(
        "INSERT INTO cronlock_demo.users (email, digest_enabled) "
        "SELECT 'user' || g || '@example.com', g % 5 <> 0 FROM generate_series(1, 25) AS g"
    )
    r = await client.post(f"{a.url}/cron/chunked-digest", headers=AUTH, json={"chunk": 7})
    assert r.status_code == 202, r.text
    done = await settled(client, a, r.json()["run_id"])
    last_enabled = await db.fetchval("SELECT max(id) FROM cronlock_demo.users WHERE digest_enabled")
    assert done["status"] == "succeeded"
    assert done["result"] == 20
    assert done["checkpoint"] == {"last_id": last_enabled, "queued": 20}
    assert done["steps"] == 4  # three chunks of 7, 7 and 6 users, then one that finds none
    rows = await db.fetch(
        "SELECT user_id, count(*) FROM cronlock.email_outbox WHERE job = 'chunked-digest' "
        "GROUP BY user_id"
    )
    assert len(rows) == 20
    assert {x["count"] for x in rows} == {1}
    again = await client.post(f"{a.url}/cron/chunked-digest", headers=AUTH)
    assert again.json()["reason"] == "already done"
