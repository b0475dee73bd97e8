"""Jobs of the dynamic-schedule tests (CRON_JOBS=tests.dynamic_jobs): schedules as rows, one per
key (cronlock/core/schedules.py). Effects go to `dyn_effects`, which `tests.dynamic` makes; no
lock of their own, so runs of different keys go at once."""

from __future__ import annotations

import asyncio

from pydantic import BaseModel, Field

from cronlock.core.jobs import JobContext, job


class Report(BaseModel):
    tenant_id: int
    name: str = "report"
    fail: bool = False
    sleep: float = Field(default=0.0, ge=0, le=30)


class Digest(BaseModel):
    user: str
    lang: str = "en"


async def _effect(ctx: JobContext) -> int:
    await ctx.conn.execute(
        "INSERT INTO dyn_effects (job, key, slot, run_id, instance) VALUES ($1, $2, $3, $4, $5)",
        ctx.job.name,
        ctx.key,
        ctx.slot,
        ctx.run_id,
        ctx.instance,
    )
    return 1


@job(
    "tenant-report",
    key="tenant_id",
    params=Report,
    schedule="dynamic",
    timeout=10,
    max_lateness=60,
)
async def tenant_report(ctx: JobContext) -> int:
    """Each tenant's report, on the tenant's schedule."""
    if ctx.params.sleep:
        await asyncio.sleep(ctx.params.sleep)
    if ctx.params.fail:
        raise RuntimeError("fails on purpose")
    return await _effect(ctx)


@job("user-digest", key="user", params=Digest, schedule="dynamic", spread=2, timeout=10)
async def user_digest(ctx: JobContext) -> int:
    """A str key, started within 2 s of its tick (spread)."""
    return await _effect(ctx)


@job("keyed-by-hand", key="tenant_id", params=Report, timeout=10)
async def keyed_by_hand(ctx: JobContext) -> int:
    """A keyed job that is not dynamic: triggered with its key, no schedules."""
    return await _effect(ctx)
