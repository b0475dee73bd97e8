"""The soak's jobs (CRON_JOBS=tests.soak_jobs,cronlock.demo.digest): one of every shape. Each
writes one effect row in its run's transaction, with its writer (instance, backend pid) and
the database clock when it started and when it wrote: the span [started, ended] lies inside
the span the run held its lock, so two runs of one job (or key) whose spans overlap held the
lock at once (tests/support/soak.py checks it)."""

from __future__ import annotations

import asyncio

from pydantic import BaseModel, Field

from cronlock.core.jobs import JobContext, job

EFFECTS_SQL = """
CREATE TABLE IF NOT EXISTS soak_effects (
    id       bigserial PRIMARY KEY,
    job      text NOT NULL,
    key      text,
    run_id   bigint NOT NULL,
    slot     timestamptz,
    instance text NOT NULL,
    pid      integer NOT NULL,
    started  timestamptz NOT NULL,
    ended    timestamptz NOT NULL
)
"""


async def effect(ctx: JobContext, hold: float = 0.0) -> None:
    started = await ctx.conn.fetchval("SELECT clock_timestamp()")
    if hold:
        await asyncio.sleep(hold)
    await ctx.conn.execute(
        """INSERT INTO soak_effects (job, key, run_id, slot, instance, pid, started, ended)
           VALUES ($1, $2, $3, $4, $5, pg_backend_pid(), $6, clock_timestamp())""",
        ctx.job.name,
        ctx.key,
        ctx.run_id,
        ctx.slot,
        ctx.instance,
        started,
    )


class Hold(BaseModel):
    seconds: float = Field(default=0.0, ge=0, le=5)


class Account(BaseModel):
    account: str = Field(min_length=1, max_length=50)
    seconds: float = Field(default=0.0, ge=0, le=5)


@job("soak-fast")
async def soak_fast(ctx: JobContext) -> int:
    await effect(ctx)
    return 1


@job("soak-slow", params=Hold, timeout=10)
async def soak_slow(ctx: JobContext) -> int:
    await effect(ctx, ctx.params.seconds)
    return 1


@job("soak-fails")
async def soak_fails(ctx: JobContext) -> int:
    """Writes its effect, then fails: the effect must never be seen."""
    await effect(ctx)
    raise RuntimeError("soak-fails fails on purpose")


@job("soak-times-out", timeout=0.3)
async def soak_times_out(ctx: JobContext) -> int:
    """Writes its effect, then overruns its timeout: rolled back, never seen."""
    await effect(ctx)
    await asyncio.sleep(2)
    return 1


@job("soak-keyed", key="account", params=Account, timeout=10)
async def soak_keyed(ctx: JobContext) -> int:
    await effect(ctx, ctx.params.seconds)
    return 1


@job("soak-minutely", schedule="* * * * *", timeout=10)
async def soak_minutely(ctx: JobContext) -> int:
    """Backfilled slot by slot: once per slot."""
    await effect(ctx, 0.05)
    return 1


# --- dynamic schedules ---------------------------------------------------------------------


class Tenant(BaseModel):
    tenant: str = Field(min_length=1, max_length=50)
    seconds: float = Field(default=0.0, ge=0, le=5)


@job("soak-dynamic", key="tenant", params=Tenant, schedule="dynamic", timeout=10)
async def soak_dynamic(ctx: JobContext) -> int:
    """Each tenant on the schedule its row says, changed all along by the soak's changers
    (tests/support/soak.py checks every run against the row's history)."""
    await effect(ctx, ctx.params.seconds)
    return 1


# --- lease mode ----------------------------------------------------------------------------

# Above what the soak's DB_QUERY_TIMEOUT (3 s) and LEASE_MARGIN (1 s) need (cronlock/core/jobs.py
# check_leases): a holder renews every third of it and stops with 4 s still left.
LEASE = 8.0

LEASE_ITEMS_SQL = """
CREATE TABLE IF NOT EXISTS soak_lease_items (
    run_id   bigint NOT NULL,
    item     integer NOT NULL,
    instance text NOT NULL,
    at       timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""


class Steps(BaseModel):
    n: int = Field(default=5, ge=1, le=100)
    pause: float = Field(default=0.1, ge=0, le=5)


@job("soak-lease", params=Steps, lease=LEASE, timeout=120)
async def soak_lease(ctx: JobContext) -> int:
    """Items 1..n, one per fenced step; a takeover resumes after the last committed one, so
    each item is committed once per run and its takeovers (tests/support/soak.py checks)."""
    last = int((ctx.checkpoint or {}).get("last", 0))
    while last < ctx.params.n:
        await asyncio.sleep(ctx.params.pause)
        async with ctx.step() as conn:
            last += 1
            await conn.execute(
                "INSERT INTO soak_lease_items (run_id, item, instance) VALUES ($1, $2, $3)",
                ctx.run_id,
                last,
                ctx.instance,
            )
            ctx.checkpoint = {"last": last}
    return last
