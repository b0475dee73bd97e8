"""Lease jobs for the tests (CRON_JOBS=tests.lease_jobs). Their leases are short (2 s), which
needs short database timeouts: LEASE_ENV is what an app serving them is started with.

`lease-items` works through items 1..n in steps and writes one row per item into
`lease_effects`, a table with no unique constraint (tests create it with
`create_effects`): an item committed twice would show as two rows.
"""

from __future__ import annotations

import asyncio
from typing import Literal

import asyncpg
from pydantic import BaseModel, Field

from cronlock.core.jobs import JobContext, job

LEASE = 2.0
LEASE_ENV = {"DB_QUERY_TIMEOUT": "0.5", "LEASE_MARGIN": "0.2", "LEASE_POLL_INTERVAL": "0.2"}
LEASE_SETTINGS = {"db_query_timeout": 0.5, "lease_margin": 0.2, "lease_poll_interval": 0.2}

EFFECTS_SQL = """
CREATE TABLE IF NOT EXISTS lease_effects (
    item     integer     NOT NULL,
    run_id   bigint      NOT NULL,
    job      text        NOT NULL,
    key      text,
    instance text        NOT NULL,
    at       timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""


async def create_effects(conn: asyncpg.Connection) -> None:
    await conn.execute(EFFECTS_SQL)


class Items(BaseModel):
    n: int = Field(default=50, ge=0, le=10_000_000)
    batch: int = Field(default=5, ge=1, le=100_000)
    # Seconds spent outside any step before each one (an API call the job awaits).
    pause: float = Field(default=0.05, ge=0, le=10)
    # Seconds spent inside each step, holding the run's row.
    hold: float = Field(default=0.0, ge=0, le=10)
    # Fail (raise) once the checkpoint reaches this item (0: never), on the first attempt.
    fail_at: int = Field(default=0, ge=0)
    # What it raises: an error of the job's own code, database or not.
    fail_with: Literal["RuntimeError", "OSError", "TimeoutError"] = "RuntimeError"


async def work(ctx: JobContext, p: Items) -> int:
    last = int((ctx.checkpoint or {}).get("last", 0))
    while last < p.n:
        if p.fail_at and last >= p.fail_at and ctx.attempt == 1:
            error = {"RuntimeError": RuntimeError, "OSError": OSError, "TimeoutError": TimeoutError}
            raise error[p.fail_with](f"failing on purpose at item {last}")
        await asyncio.sleep(p.pause)
        async with ctx.step() as conn:
            upto = min(p.n, last + p.batch)
            await conn.execute(
                "INSERT INTO lease_effects (item, run_id, job, key, instance) "
                "SELECT g, $1, $2, $3, $4 FROM generate_series($5::int + 1, $6::int) AS g",
                ctx.run_id,
                ctx.job.name,
                ctx.key,
                ctx.instance,
                last,
                upto,
            )
            if p.hold:
                await asyncio.sleep(p.hold)
            last = upto
            ctx.checkpoint = {"last": last}
            ctx.progress = {"done": last, "total": p.n}
    return last


@job("lease-items", params=Items, lease=LEASE, timeout=120)
async def lease_items(ctx: JobContext) -> int:
    """Items 1..n in steps of `batch`, one effect row per item."""
    return await work(ctx, ctx.params)


@job("lease-slot", schedule="* * * * *", params=Items, lease=LEASE, timeout=120)
async def lease_slot(ctx: JobContext) -> int:
    """As lease-items, once per minute's slot."""
    return await work(ctx, ctx.params)


@job(
    "lease-retried",
    schedule="* * * * *",
    params=Items,
    lease=LEASE,
    timeout=120,
    retries=2,
    retry_delay=0.2,
)
async def lease_retried(ctx: JobContext) -> int:
    """As lease-slot, retried by cronlock when an attempt fails."""
    return await work(ctx, ctx.params)


class Customer(BaseModel):
    customer_id: int = Field(ge=0)
    n: int = Field(default=20, ge=0, le=100_000)


@job("lease-customer", key="customer_id", params=Customer, lease=LEASE, timeout=60)
async def lease_customer(ctx: JobContext) -> int:
    """A keyed lease job: one run at a time per customer."""
    return await work(ctx, Items(n=ctx.params.n, batch=5, pause=0.02))


@job("lease-short", params=Items, lease=LEASE, timeout=3)
async def lease_short(ctx: JobContext) -> int:
    """Its timeout (3 s) bounds the whole run, takeovers included."""
    return await work(ctx, ctx.params)


@job("lease-outside", lease=LEASE, timeout=60)
async def lease_outside(ctx: JobContext) -> None:
    """Uses ctx.conn, which a lease job does not have."""
    await ctx.conn.execute("SELECT 1")
