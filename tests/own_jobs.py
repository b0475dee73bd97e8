"""Jobs of the "cronlock on its own" tests (CRON_JOBS=tests.own_jobs): the built-in scheduler,
missed-slot policies, retries, pause. Effects go to `job_effects`, as tests/jobs.py's do."""

from __future__ import annotations

import asyncio

from cronlock.core.jobs import JobContext, job
from tests.jobs import record


@job("tick", every=1, grace=1, missed="all", timeout=5, retries=2, retry_delay=0.2)
async def tick(ctx: JobContext) -> int:
    """Every second: record one effect."""
    await record(ctx)
    return 1


@job("tick-latest", every=1, grace=1, missed="latest", timeout=5)
async def tick_latest(ctx: JobContext) -> int:
    await record(ctx)
    return 1


@job("heartbeat", every=1, grace=1, timeout=5)
async def heartbeat(ctx: JobContext) -> int:
    """Every second, missed slots left alone (missed="none"): the pause proof's job."""
    await record(ctx)
    return 1


FAILED_BEFORE_SQL = """
SELECT count(*) FROM cronlock.runs
WHERE job = $1 AND slot = $2 AND status IN ('failed', 'timed_out', 'abandoned')
"""


@job("flaky", every=3600, retries=3, retry_delay=0.3, timeout=10)
async def flaky(ctx: JobContext) -> int:
    """Fails its first two attempts at a slot (counted in the ledger), then succeeds; each
    attempt holds the lock for half a second."""
    await asyncio.sleep(0.5)
    failed = await ctx.conn.fetchval(FAILED_BEFORE_SQL, ctx.job.name, ctx.slot)
    if failed < 2:
        raise RuntimeError(f"attempt {failed + 1} fails on purpose")
    await record(ctx)
    return 1


@job("always-fails", every=3600, retries=2, retry_delay=0.2, timeout=10)
async def always_fails(ctx: JobContext) -> int:
    raise RuntimeError("never works")


@job("hourly-late", every=3600, grace=1, timeout=5)
async def hourly_late(ctx: JobContext) -> int:
    """Overdue a second after each hour begins, until a run succeeds: the alerts' overdue job."""
    return 1


ATTEMPTS_BEFORE_SQL = "SELECT count(*) FROM cronlock.runs WHERE job = $1 AND slot = $2 AND id < $3"


@job("fragile", every=3600, retries=2, retry_delay=0.2, timeout=20)
async def fragile(ctx: JobContext) -> int:
    """Its first attempt at a slot takes 20 s (long enough to kill its instance); a retry
    succeeds at once."""
    if await ctx.conn.fetchval(ATTEMPTS_BEFORE_SQL, ctx.job.name, ctx.slot, ctx.run_id) == 0:
        await asyncio.sleep(20)
    await record(ctx)
    return 1
