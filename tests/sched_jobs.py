"""A job for the built-in scheduler's attempts test (CRON_JOBS=tests.sched_jobs): it fails at
once, every second, and has no retries, so each slot should see exactly one attempt."""

from __future__ import annotations

from cronlock.core.jobs import JobContext, job


@job("fails-each-second", every=1, grace=1, timeout=5)
async def fails_each_second(ctx: JobContext) -> int:
    raise RuntimeError("fails on purpose")
