"""A job that opts into catching up (CRON_JOBS=tests.jobs,tests.catchup_jobs): kept out of
tests.jobs so that no other test's instance catches it up behind its back."""

from __future__ import annotations

from cronlock.core.jobs import JobContext, job
from tests.jobs import record


@job("catch-up-daily", schedule="0 0 * * *", grace=60, catch_up=True)
async def catch_up_daily(ctx: JobContext) -> str:
    """Daily at midnight UTC; a missed midnight is made up once."""
    await record(ctx)
    return ctx.trigger
