"""Jobs of bench/schedules.py (CRON_JOBS=bench.schedule_jobs): two dynamic jobs whose runs do
nothing, so the figures are the dispatch path's own. Nothing here is part of the service."""

from __future__ import annotations

from pydantic import BaseModel

from cronlock.core.jobs import JobContext, job

# The lateness phase's spread: 10,000 keys due at one tick start over this minute.
SPREAD = 60.0


class Tenant(BaseModel):
    tenant_id: int


@job("bench-dyn", key="tenant_id", params=Tenant, schedule="dynamic", timeout=30)
async def bench_dyn(ctx: JobContext) -> int:
    """The throughput phase: every key due at once (no spread)."""
    return 0


@job(
    "bench-dyn-spread",
    key="tenant_id",
    params=Tenant,
    schedule="dynamic",
    spread=SPREAD,
    timeout=30,
)
async def bench_dyn_spread(ctx: JobContext) -> int:
    """The lateness phase: keys due at one tick, spread over a minute."""
    return 0
