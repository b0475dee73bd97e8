"""Dynamic jobs with retries and in lease mode (CRON_JOBS=tests.dynamic_more_jobs): each key's
failed slot retried for that key and slot, and each key's run a lease run with fenced steps.
Effects go to `dyn_effects` (tests/test_schedules.py makes it), one row per run that did its
work, so a slot done twice shows as two rows."""

from __future__ import annotations

import asyncio

from cronlock.core.jobs import JobContext, job
from tests.dynamic_jobs import Report

EFFECT_SQL = (
    "INSERT INTO dyn_effects (job, key, slot, run_id, instance) VALUES ($1, $2, $3, $4, $5)"
)


@job(
    "dyn-retry",
    key="tenant_id",
    params=Report,
    schedule="dynamic",
    timeout=10,
    max_lateness=600,
    retries=2,
    retry_delay=1.0,
)
async def dyn_retry(ctx: JobContext) -> int:
    """A key with `fail` fails its slot's first attempt (the dispatcher's), after `sleep`
    seconds, and succeeds at its retry (trigger backfill)."""
    if ctx.params.sleep and ctx.trigger == "scheduled":
        await asyncio.sleep(ctx.params.sleep)
    if ctx.params.fail and ctx.trigger == "scheduled":
        raise RuntimeError("the first attempt fails on purpose")
    await ctx.conn.execute(EFFECT_SQL, ctx.job.name, ctx.key, ctx.slot, ctx.run_id, ctx.instance)
    return 1


@job(
    "dyn-lease",
    key="tenant_id",
    params=Report,
    schedule="dynamic",
    timeout=10,
    lease=2,
    max_lateness=60,
    retries=1,
    retry_delay=0.5,
)
async def dyn_lease(ctx: JobContext) -> int:
    """Two fenced steps: a checkpoint, then the effect. A key with `fail` raises between them
    on its first attempt; the retry resumes after the checkpoint and writes the effect once."""
    if not (ctx.checkpoint or {}).get("first"):
        async with ctx.step():
            ctx.checkpoint = {"first": True}
    if ctx.params.fail and ctx.attempt == 1:
        raise RuntimeError("fails between its steps on purpose")
    async with ctx.step() as conn:
        await conn.execute(EFFECT_SQL, ctx.job.name, ctx.key, ctx.slot, ctx.run_id, ctx.instance)
    return 1
