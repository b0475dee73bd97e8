"""Jobs the bench scripts trigger (CRON_JOBS=bench.jobs); instances import them from the repo
root. Nothing here is part of the service or of the tests."""

from __future__ import annotations

import asyncio

from pydantic import BaseModel, Field

from cronlock.core.jobs import JobContext, job

EFFECTS_SQL = """
CREATE TABLE IF NOT EXISTS bench_effects (
    id     bigserial PRIMARY KEY,
    job    text NOT NULL,
    run_id bigint NOT NULL,
    slot   timestamptz
)
"""


# trigger.py rotates over several jobs of each kind, so that concurrent requests are for
# different jobs and each one takes the database probe (the in-process short-circuit answers
# a second concurrent trigger of one job "already running" without asking the database).
# Names interleave ("bench-00-done", "bench-00-running", ...): routes are matched in name
# order, one after another, so both kinds sit at the same depth on average.
ROTATION = 12


def done_job(n: int) -> str:
    return f"bench-{n:02d}-done"


def running_job(n: int) -> str:
    return f"bench-{n:02d}-running"


async def _never(ctx: JobContext) -> int:
    """Never runs in trigger.py: the bench holds its lock from another connection."""
    return 0


async def _once(ctx: JobContext) -> int:
    """Runs once per day (the priming trigger); every later trigger is 'already done'."""
    return 0


for _n in range(ROTATION):
    job(running_job(_n))(_never)
    job(done_job(_n), schedule="0 0 * * *", tz="UTC")(_once)


class Hold(BaseModel):
    seconds: float = Field(default=5.0, ge=0, le=60)


@job("bench-storm", schedule="0 0 * * *", tz="UTC", params=Hold, timeout=60)
async def bench_storm(ctx: JobContext) -> int:
    """Record one effect, then hold the lock for `seconds`: the storm's one run."""
    await ctx.conn.execute(EFFECTS_SQL)
    await ctx.conn.execute(
        "INSERT INTO bench_effects (job, run_id, slot) VALUES ($1, $2, $3)",
        ctx.job.name,
        ctx.run_id,
        ctx.slot,
    )
    await asyncio.sleep(ctx.params.seconds)
    return 1
