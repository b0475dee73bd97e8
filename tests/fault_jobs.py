"""Jobs for the fault tests (CRON_JOBS=tests.jobs,tests.fault_jobs), next to tests/jobs.py.

Unlike `tests.jobs.record`, `record_side_by_side` holds no lock after it returns, so distinct
jobs can run at the same time; the fault tests create `job_effects` beforehand
(`tests.support.faults.reset`).
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from cronlock.core.jobs import JobContext, job
from tests.jobs import Sleep

# The key of the gate a `gated` run waits for, plus the run's `key` param: far from any
# hashtextextended job key a test could ask pg_locks about, and from tests.jobs' 424242.
GATE_BASE = 7_340_000_000
LONG_JOBS = 6


async def record_side_by_side(ctx: JobContext) -> None:
    await ctx.conn.execute(
        "INSERT INTO job_effects (job, run_id, slot) VALUES ($1, $2, $3)",
        ctx.job.name,
        ctx.run_id,
        ctx.slot,
    )


class Gate(BaseModel):
    key: int = Field(default=0, ge=0, le=1000)


@job("gated", params=Gate, timeout=60)
async def gated(ctx: JobContext) -> int:
    """Record one effect, then hold the lock until the test opens the gate (an advisory lock
    the test holds on a session of its own)."""
    await record_side_by_side(ctx)
    await ctx.conn.execute("SELECT pg_advisory_xact_lock($1)", GATE_BASE + ctx.params.key)
    return 1


@job("times-out-in-sql", params=Sleep, timeout=0.5)
async def times_out_in_sql(ctx: JobContext) -> int:
    """Record one effect, then run a statement past the 0.5 s timeout: the runner must end
    it by closing the connection, not with a cancel request through PgBouncer."""
    await record_side_by_side(ctx)
    await ctx.conn.execute("SELECT pg_sleep($1)", ctx.params.seconds or 10)
    return 1


def _long(number: int) -> None:
    @job(f"long-{number}", params=Sleep, timeout=20)
    async def long_job(ctx: JobContext) -> int:
        """Record one effect, then hold the lock and its connection for `seconds`."""
        await record_side_by_side(ctx)
        await ctx.conn.execute("SELECT pg_sleep($1)", ctx.params.seconds)
        return number


# Distinct jobs, so that several can hold a pooled connection each at the same time.
for _number in range(1, LONG_JOBS + 1):
    _long(_number)
