"""Dynamic jobs through the rest of the ordinary trigger path (cronlock/core/schedules.py):
`retries=` (a key's failed slot retried for that key and slot by the retry loop, with the job's
backoff, while the key's schedule still has that slot) and `lease=` (each key's run a lease run
with fenced steps, its row advanced in the transaction that begins it). In-process apps, real
PostgreSQL (tests/dynamic_more_jobs.py)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any

import asyncpg
import httpx
import pytest

from cronlock import Cronlock, JobDefinitionError
from cronlock.core.jobs import define
from cronlock.settings import Settings
from tests.dynamic_jobs import Report
from tests.lease_jobs import LEASE_SETTINGS
from tests.support import auth_headers
from tests.support.asgi import StartApp
from tests.test_schedules import EFFECTS_SQL
from tests.util import wait_for

JOBS = "tests.dynamic_more_jobs"
DISPATCH = {
    "cron_jobs": JOBS,
    "scheduler_enabled": True,
    "scheduler_poll_interval": 0.2,
    "scheduler_claim_timeout": 2.0,
    "retry_poll_interval": 0.1,
    **LEASE_SETTINGS,
}
RUNS_SQL = """
SELECT id, key, slot, status, trigger, attempt, retry_of, lease_token, error
FROM cronlock.runs WHERE job = $1 ORDER BY id
"""


@pytest.fixture
async def db(db: asyncpg.Connection) -> asyncpg.Connection:
    await db.execute(EFFECTS_SQL)
    return db


@pytest.fixture
def cron(make_settings: Callable[..., Settings]) -> Cronlock:
    return Cronlock(make_settings(cron_jobs=JOBS, **LEASE_SETTINGS), housekeeping=False)


async def noop(ctx: Any) -> None:
    return None


def test_retries_and_lease_declared_fanout_refused() -> None:
    made = define("d", schedule="dynamic", key="tenant_id", params=Report, retries=2, lease=5)(noop)
    assert (made.retries, made.lease, made.dynamic) == (2, 5, True)
    with pytest.raises(JobDefinitionError, match="does not take fanout="):
        define("d", schedule="dynamic", key="tenant_id", params=Report, fanout=True)(noop)


async def effects(db: asyncpg.Connection, job: str) -> Counter[tuple[str, Any]]:
    rows = await db.fetch("SELECT key, slot FROM dyn_effects WHERE job = $1", job)
    return Counter((r["key"], r["slot"]) for r in rows)


def keys(found: Counter[tuple[str, Any]], key: str) -> int:
    return sum(1 for k, _ in found if k == key)


async def test_failing_key_is_retried_for_its_slot_and_others_unaffected(
    start_app: StartApp, cron: Cronlock, db: asyncpg.Connection
) -> None:
    """Key 1's first attempt at each slot fails; its retry (1 s later, by the retry loop) runs
    the same key and slot and succeeds. Key 2 runs each slot once, first time. Nothing runs
    twice, and key 1's row moved on at its failure (one first attempt per slot: no hot loop)."""
    await cron.schedules.set(db, "dyn-retry", 1, every=2, params={"fail": True})
    await cron.schedules.set(db, "dyn-retry", 2, every=2)
    await start_app("a", **DISPATCH)

    async def both_ran() -> bool:
        found = await effects(db, "dyn-retry")
        return keys(found, "1") >= 2 and keys(found, "2") >= 2

    await wait_for(both_ran, 20, "two retried slots of key 1, two slots of key 2")
    found = await effects(db, "dyn-retry")
    assert max(found.values()) == 1, found
    runs = await db.fetch(RUNS_SQL, "dyn-retry")
    by_id = {r["id"]: r for r in runs}
    for r in runs:
        if r["key"] == "2":
            assert (r["trigger"], r["status"], r["attempt"]) == ("scheduled", "succeeded", 1), r
        elif r["trigger"] == "scheduled":
            assert r["status"] == "failed", r
        else:  # key 1's retry: the attempt after a failed one, same key and slot
            assert r["trigger"] == "backfill", r
            failed = by_id[r["retry_of"]]
            assert (failed["key"], failed["slot"], r["attempt"]) == ("1", r["slot"], 2), r
    first = Counter((r["key"], r["slot"]) for r in runs if r["trigger"] == "scheduled")
    assert max(first.values()) == 1, first
    succeeded_1 = {r["slot"] for r in runs if r["key"] == "1" and r["status"] == "succeeded"}
    assert {s for k, s in found if k == "1"} == succeeded_1


async def test_a_removed_or_paused_schedule_is_not_retried(
    start_app: StartApp, cron: Cronlock, db: asyncpg.Connection
) -> None:
    """A key whose schedule is removed while its slot's run is failing has that slot retried
    never; a paused one not while paused (the retry waits, and is made once resumed)."""
    slot = await db.fetchval("SELECT date_trunc('minute', now()) - interval '2 minutes'")
    daily = f"{slot.minute} {slot.hour} * * *"  # its next tick is tomorrow's
    for key in (3, 4):
        params = {"fail": True, "sleep": 1.5}
        await cron.schedules.set(db, "dyn-retry", key, schedule=daily, params=params)
    # Due now, as a row whose tick came two minutes ago while no dispatcher ran.
    await db.execute(
        "UPDATE cronlock.schedules SET next_at = $1, due_at = $1 WHERE job = 'dyn-retry'", slot
    )
    await start_app("a", **DISPATCH)

    async def both_running() -> bool:
        running = await db.fetchval(
            "SELECT count(*) FROM cronlock.runs WHERE job = 'dyn-retry' AND status = 'running'"
        )
        return int(running) == 2

    await wait_for(both_running, 10, "the first attempts of keys 3 and 4 under way")
    await cron.schedules.remove(db, "dyn-retry", 3)
    await cron.schedules.pause(db, "dyn-retry", 4)

    async def both_failed() -> bool:
        runs = await db.fetch(RUNS_SQL, "dyn-retry")
        return sum(1 for r in runs if r["status"] == "failed") == 2

    await wait_for(both_failed, 10, "the first attempts' failures")
    await asyncio.sleep(2.5)  # the retry delay (1 s) and many passes of the retry loop
    runs = await db.fetch(RUNS_SQL, "dyn-retry")
    assert [(r["trigger"], r["slot"]) for r in runs] == [("scheduled", slot)] * 2, runs
    assert await effects(db, "dyn-retry") == Counter()

    await cron.schedules.resume(db, "dyn-retry", 4)

    async def retried() -> bool:
        return keys(await effects(db, "dyn-retry"), "4") == 1

    await wait_for(retried, 10, "key 4's retry once resumed")
    await asyncio.sleep(1.0)
    assert await effects(db, "dyn-retry") == Counter({("4", slot): 1})


async def test_lease_mode_dynamic_runs(
    start_app: StartApp, cron: Cronlock, db: asyncpg.Connection
) -> None:
    """Each key's run is a lease run (a token, fenced steps); key 1's first attempt fails
    between its steps and its retry resumes after the checkpoint: one effect per (key, slot)."""
    await cron.schedules.set(db, "dyn-lease", 1, every=2, params={"fail": True})
    await cron.schedules.set(db, "dyn-lease", 2, every=2)
    await start_app("a", **DISPATCH)

    async def both_ran() -> bool:
        found = await effects(db, "dyn-lease")
        return keys(found, "1") >= 2 and keys(found, "2") >= 2

    await wait_for(both_ran, 20, "two slots of each key")
    found = await effects(db, "dyn-lease")
    assert max(found.values()) == 1, found
    runs = await db.fetch(RUNS_SQL, "dyn-lease")
    assert all(r["lease_token"] is not None for r in runs), runs
    first = Counter((r["key"], r["slot"]) for r in runs if r["trigger"] == "scheduled")
    assert max(first.values()) == 1, first
    by_id = {r["id"]: r for r in runs}
    for r in runs:
        if r["key"] == "2":
            assert r["status"] in ("succeeded", "running"), r
            assert r["attempt"] == 1, r
        elif r["retry_of"] is not None:
            assert by_id[r["retry_of"]]["status"] == "failed", r
            assert (by_id[r["retry_of"]]["slot"], r["attempt"]) == (r["slot"], 2), r
    retried = [r for r in runs if r["key"] == "1" and r["status"] == "succeeded"]
    assert {s for k, s in found if k == "1"} == {r["slot"] for r in retried}
    assert all(r["retry_of"] is not None for r in retried), retried
    # The row advanced with each run's beginning: its next tick is ahead of every slot run.
    row = await cron.schedules.get(db, "dyn-lease", 2)
    assert row is not None
    assert row.next_at > max(s for k, s in found if k == "2")


async def test_a_dynamic_job_takes_no_backfill(
    start_app: StartApp, client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """`slot=` on a trigger of a dynamic job is a 422 naming the slot (its slots are its keys'
    rows', run by the dispatcher and the retry loop), and nothing is run."""
    app = await start_app("a", cron_jobs=JOBS, **LEASE_SETTINGS)
    answer = await client.post(
        f"{app.url}/cron/dyn-retry",
        params={"slot": "2026-01-01T00:00:00Z"},
        json={"tenant_id": 1},
        headers=auth_headers(),
    )
    assert answer.status_code == 422, answer.text
    detail = answer.json()["detail"][0]
    assert detail["loc"][-1] == "slot"
    assert "is dynamic" in detail["msg"]
    assert await db.fetchval("SELECT count(*) FROM cronlock.runs") == 0
