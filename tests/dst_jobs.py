"""Code-scheduled jobs of the daylight-saving test (CRON_JOBS=tests.zone_jobs,tests.dst_jobs;
tests/test_schedules_dst.py), beside its dynamic job: the built-in scheduler ticks these on the
database's clock as its `Clock` measures it, there months ahead of the instances' own. Each run
writes its effect into `zone_effects` (key NULL) in its transaction, as the dynamic job does."""

from __future__ import annotations

from cronlock.core.jobs import JobContext, job
from tests.zone_jobs import record_effect


@job("berlin-two", schedule="0 2 * * *", tz="Europe/Berlin", timeout=10)
async def berlin_two(ctx: JobContext) -> int:
    """A fixed hour: the gap's 02:00 runs at the change, the repeated 02:00 CET does not."""
    return await record_effect(ctx)


@job("berlin-minutely", schedule="* * * * *", tz="Europe/Berlin", timeout=10)
async def berlin_minutely(ctx: JobContext) -> int:
    """A wildcard hour: the real clock's minutes."""
    return await record_effect(ctx)
