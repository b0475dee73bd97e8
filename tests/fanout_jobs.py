"""Fan-out jobs for the tests (CRON_JOBS=tests.fanout_jobs).

`fan-items` plans items 0..n-1; each item writes one row into `fanout_effects`, a table with
no unique constraint (an item committed twice would show as two rows), and `done` writes one
row into `fanout_done`. Tests create both with `create_effects`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
from pydantic import BaseModel, Field

from cronlock import DoneContext, ItemContext, JobContext, job

FANOUT_SETTINGS: dict[str, Any] = {
    "fanout_poll_interval": 0.2,
    "fanout_retry_delay": 0.05,
    "fanout_concurrency": 4,
    "db_timeout_margin": 1.0,
}
FANOUT_ENV = {
    "FANOUT_POLL_INTERVAL": "0.2",
    "FANOUT_RETRY_DELAY": "0.05",
    "FANOUT_CONCURRENCY": "4",
}

EFFECTS_SQL = """
CREATE TABLE IF NOT EXISTS fanout_effects (
    item     integer     NOT NULL,
    run_id   bigint      NOT NULL,
    job      text        NOT NULL,
    attempt  integer     NOT NULL,
    instance text        NOT NULL,
    at       timestamptz NOT NULL DEFAULT clock_timestamp()
);
-- Items that fail while listed here (`fixable`): a bug an operator fixes, then retries them.
CREATE TABLE IF NOT EXISTS fanout_broken (item integer PRIMARY KEY);
CREATE TABLE IF NOT EXISTS fanout_done (
    run_id   bigint      NOT NULL,
    job      text        NOT NULL,
    total    integer     NOT NULL,
    done     integer     NOT NULL,
    failed   integer     NOT NULL,
    instance text        NOT NULL
);
"""


async def create_effects(conn: asyncpg.Connection) -> None:
    await conn.execute(EFFECTS_SQL)


class Items(BaseModel):
    n: int = Field(default=20, ge=0, le=2_000_000)
    # Seconds each item awaits (an API call) inside its transaction.
    pause: float = Field(default=0.0, ge=0, le=60)
    # Items that fail this many attempts before they succeed.
    flaky: list[int] = []
    fail_times: int = 2
    # Items that always fail.
    broken: list[int] = []
    # Items that fail while listed in `fanout_broken`.
    fixable: bool = False
    # What `done` does: "ok", or "raise".
    done: str = "ok"


async def effect(ctx: ItemContext) -> None:
    await ctx.conn.execute(
        "INSERT INTO fanout_effects (item, run_id, job, attempt, instance) "
        "VALUES ($1, $2, $3, $4, $5)",
        ctx.item,
        ctx.run_id,
        ctx.job.name,
        ctx.attempt,
        ctx.instance,
    )


@job("fan-items", params=Items, fanout=True, timeout=120)
async def fan_items(ctx: JobContext) -> AsyncIterator[int]:
    """Items 0..n-1."""
    for i in range(ctx.params.n):
        yield i


@fan_items.each(timeout=10, retries=3)
async def fan_item(ctx: ItemContext) -> int:
    p: Items = ctx.params
    await effect(ctx)
    if p.pause:
        await asyncio.sleep(p.pause)
    if ctx.item in p.broken:
        raise RuntimeError(f"item {ctx.item} always fails")
    if p.fixable and await ctx.conn.fetchval(
        "SELECT EXISTS (SELECT 1 FROM fanout_broken WHERE item = $1)", ctx.item
    ):
        raise RuntimeError(f"item {ctx.item} is broken")
    if ctx.item in p.flaky and ctx.attempt <= p.fail_times:
        raise RuntimeError(f"item {ctx.item} fails attempt {ctx.attempt}")
    return int(ctx.item)


@fan_items.done
async def fan_done(ctx: DoneContext) -> dict[str, int]:
    await ctx.conn.execute(
        "INSERT INTO fanout_done (run_id, job, total, done, failed, instance) "
        "VALUES ($1, $2, $3, $4, $5, $6)",
        ctx.run_id,
        ctx.job.name,
        ctx.total,
        ctx.done,
        ctx.failed,
        ctx.instance,
    )
    if ctx.params.done == "raise":
        raise RuntimeError("done fails on purpose")
    return {"seen": ctx.done}


@job(
    "fan-slot",
    schedule="* * * * *",
    early_tolerance=0,
    params=Items,
    fanout=True,
    retries=2,
    retry_delay=0.2,
)
async def fan_slot(ctx: JobContext) -> list[int]:
    """Items 0..n-1 once per minute's slot, retried by cronlock when the run fails."""
    return list(range(ctx.params.n))


@fan_slot.each(timeout=10, retries=0)
async def fan_slot_item(ctx: ItemContext) -> None:
    await effect(ctx)
    p: Items = ctx.params
    # Broken on the first attempt of the run only: the run's retry continues and succeeds.
    run_attempt = await ctx.conn.fetchval(
        "SELECT attempt FROM cronlock.runs WHERE id = $1", ctx.run_id
    )
    if ctx.item in p.broken and run_attempt == 1:
        raise RuntimeError(f"item {ctx.item} fails in the run's first attempt")


@fan_slot.done
async def fan_slot_done(ctx: DoneContext) -> None:
    await fan_done(ctx)


class Planned(BaseModel):
    what: str = "nan"


@job("fan-bad-plan", params=Planned, fanout=True)
async def fan_bad_plan(ctx: JobContext) -> list[Any]:
    """Plans what it is told: something that is not JSON, or too many items."""
    if ctx.params.what == "nan":
        return [1, float("nan")]
    if ctx.params.what == "object":
        return [object()]
    if ctx.params.what == "many":
        return list(range(1001))
    raise RuntimeError("the planner fails")


@fan_bad_plan.each()
async def fan_bad_item(ctx: ItemContext) -> None:
    return None


@job("fan-slow", fanout=True)
async def fan_slow(ctx: JobContext) -> list[int]:
    return list(range(40))


@fan_slow.each(timeout=0.5, retries=1)
async def fan_slow_item(ctx: ItemContext) -> None:
    await effect(ctx)
    if ctx.item == 0:
        await asyncio.sleep(5)  # past its timeout, every attempt
    else:
        await asyncio.sleep(0.1)


@job("fan-proof", params=Items, fanout=True, timeout=120)
async def fan_proof(ctx: JobContext) -> AsyncIterator[int]:
    """As fan-items, with a short item timeout (2 s): a frozen worker's items are freed by
    the server within it (plus DB_TIMEOUT_MARGIN)."""
    for i in range(ctx.params.n):
        yield i


@fan_proof.each(timeout=2, retries=3)
async def fan_proof_item(ctx: ItemContext) -> int:
    return await fan_item(ctx)


@fan_proof.done
async def fan_proof_done(ctx: DoneContext) -> dict[str, int]:
    return await fan_done(ctx)
