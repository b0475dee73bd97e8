"""The job of the 40-zone proof (CRON_JOBS=tests.zone_jobs; tests/support/zones.py drives it,
from bench/schedules_proof.py at full size and tests/test_schedules_zones.py scaled down).

One dynamic job whose run writes one row into `zone_effects` in its own transaction: a run
made twice, or lost, shows there as well as in the ledger (whose unique index of succeeded
slots would hide a second success behind a failed insert)."""

from __future__ import annotations

from pydantic import BaseModel

from cronlock.core.jobs import JobContext, job

JOB = "zone-report"
# A key's run starts at most this long after its tick, or not at all ("too late"). Five
# minutes, as a daily report might allow: wide enough for one survivor to run a whole due
# minute's backlog after two instances die, and still a bound the proof checks every run
# against.
MAX_LATENESS = 300.0


class Tenant(BaseModel):
    tenant_id: int


@job(
    JOB,
    key="tenant_id",
    params=Tenant,
    schedule="dynamic",
    max_lateness=MAX_LATENESS,
    # A run in flight on a killed instance is abandoned: retried for its slot by a survivor.
    retries=2,
    retry_delay=1,
    timeout=30,
)
async def zone_report(ctx: JobContext) -> int:
    """One customer's report, at the customer's local time."""
    return await record_effect(ctx)


async def record_effect(ctx: JobContext) -> int:
    """The run's effect row, in its transaction (tests/dst_jobs.py's jobs write one too)."""
    await ctx.conn.execute(
        "INSERT INTO zone_effects (key, slot, run_id, instance) VALUES ($1, $2, $3, $4)",
        ctx.key,
        ctx.slot,
        ctx.run_id,
        ctx.instance,
    )
    return 1
