"""Jobs of the "cronlock on its own" tests (CRON_JOBS=tests.own_jobs): the built-in scheduler,
missed-slot policies, retries, pause. Effects go to `job_effects`, as tests/jobs.py's do."""

from __future__ import annotations

from app.jobs import JobContext, job
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
