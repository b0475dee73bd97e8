"""Dynamic schedules dispatched by three real uvicorn instances with the built-in scheduler, two
of them killed with SIGKILL mid-stream: each (key, slot) is attempted once and succeeds once,
none is missed, and the survivor takes over the rows the killed ones had claimed. Scaled to run
in about 20 s; bench/schedules.py runs the issue's full figures (BENCHMARKS.md)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from datetime import timedelta

import asyncpg

from cronlock import Cronlock
from cronlock.settings import Settings
from tests.support.cluster import Instance
from tests.test_schedules import EFFECTS_SQL, JOBS

EVERY = 3
KEYS = 150
ENV = {
    "CRON_JOBS": JOBS,
    "SCHEDULER_ENABLED": "true",
    "SCHEDULER_POLL_INTERVAL": "0.2",
    "SCHEDULER_CLAIM_TIMEOUT": "1",
    "SCHEDULER_CONCURRENCY": "20",
    "GRACEFUL_SHUTDOWN_TIMEOUT": "2",
    "LOG_SKIPS": "false",
}


async def test_three_dispatchers_kill_two(
    start_instances: Callable[..., list[Instance]],
    make_settings: Callable[..., Settings],
    db: asyncpg.Connection,
) -> None:
    await db.execute(EFFECTS_SQL)
    cron = Cronlock(make_settings(cron_jobs=JOBS), housekeeping=False)
    async with db.transaction():
        for key in range(KEYS):
            await cron.schedules.set(db, "tenant-report", key, every=EVERY)
    i1, i2, i3 = start_instances(["i1", "i2", "i3"], env=ENV)
    await asyncio.sleep(2 * EVERY + 1)
    i1.kill()
    i2.kill()
    killed_at = await db.fetchval("SELECT now()")
    await asyncio.sleep(3 * EVERY + 1)
    ended_at = await db.fetchval("SELECT now()")
    i3.stop()

    runs = await db.fetch(
        "SELECT key, slot, status, instance FROM cronlock.runs WHERE job = 'tenant-report'"
    )
    by_key: dict[str, list[asyncpg.Record]] = {}
    for r in runs:
        by_key.setdefault(r["key"], []).append(r)
    assert len(by_key) == KEYS
    step = timedelta(seconds=EVERY)
    for tenant, attempts in by_key.items():
        slots = sorted(r["slot"] for r in attempts)
        # One attempt per slot, ever: no instance made a second one.
        assert len(slots) == len(set(slots)), (tenant, slots)
        # None missed: consecutive ticks, through the kill, up to the last one due well
        # before the end (the survivor's claim timeout and poll in hand).
        assert all(b - a == step for a, b in itertools.pairwise(slots)), (tenant, slots)
        assert slots[-1] >= ended_at - 2 * step, (tenant, slots, ended_at)
        # Only runs in flight on a killed instance may have failed to succeed.
        for r in attempts:
            if r["status"] != "succeeded":
                assert r["instance"] in ("i1", "i2"), r
                assert r["slot"] <= killed_at, r
    effects = await db.fetch(
        "SELECT key, slot, count(*) AS n FROM dyn_effects GROUP BY key, slot HAVING count(*) > 1"
    )
    assert effects == []
    after_kill = [r for r in runs if r["slot"] > killed_at + step]
    assert after_kill
    assert {r["instance"] for r in after_kill} == {"i3"}
