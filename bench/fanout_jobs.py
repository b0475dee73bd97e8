"""Fan-out jobs bench/fanout.py triggers (CRON_JOBS=bench.fanout_jobs). Nothing here is part
of the service or of the tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from pydantic import BaseModel, Field

from cronlock import ItemContext, JobContext, job

EFFECTS_SQL = """
CREATE TABLE IF NOT EXISTS bench_fan_effects (
    item   integer NOT NULL,
    run_id bigint  NOT NULL
)
"""


class Items(BaseModel):
    n: int = Field(default=600, ge=0, le=2_000_000)


@job("bench-fan-io", params=Items, fanout=True, timeout=600)
async def plan_io(ctx: JobContext) -> AsyncIterator[int]:
    """n items that each await 100 ms, as an API call would."""
    for i in range(ctx.params.n):
        yield i


@plan_io.each(timeout=30)
async def io_item(ctx: ItemContext) -> None:
    await asyncio.sleep(0.1)
    await ctx.conn.execute(
        "INSERT INTO bench_fan_effects (item, run_id) VALUES ($1, $2)", ctx.item, ctx.run_id
    )


@job("bench-fan-db", params=Items, fanout=True, timeout=600)
async def plan_db(ctx: JobContext) -> AsyncIterator[int]:
    """n items of one small write each."""
    for i in range(ctx.params.n):
        yield i


@plan_db.each(timeout=30)
async def db_item(ctx: ItemContext) -> None:
    await ctx.conn.execute(
        "INSERT INTO bench_fan_effects (item, run_id) VALUES ($1, $2)", ctx.item, ctx.run_id
    )
