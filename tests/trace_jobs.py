"""Jobs for tests/test_tracing.py (CRON_JOBS=tests.trace_jobs). Each makes a span of its own
with `TRACER` (set by the test, standing in for a user's asyncpg or SQLAlchemy
instrumentation), which must nest under the run's span or the open step's."""

from __future__ import annotations

from typing import Any

from cronlock.core.fanout import ItemContext
from cronlock.core.jobs import JobContext, job
from cronlock.delivery import outbox

# The tracer a test hands its jobs: OpenTelemetry's, from the test's provider.
TRACER: Any = None


async def query(ctx: JobContext, conn: Any) -> int:
    """A statement in a span of the job's own, as an instrumented driver makes one."""
    with TRACER.start_as_current_span("SELECT"):
        return int(await conn.fetchval("SELECT 1"))


@job("traced")
async def traced(ctx: JobContext) -> int:
    return await query(ctx, ctx.conn)


@job("traced-yearly", schedule="0 0 1 1 *")
async def traced_yearly(ctx: JobContext) -> int:
    return await query(ctx, ctx.conn)


@job("traced-fails")
async def traced_fails(ctx: JobContext) -> int:
    await query(ctx, ctx.conn)
    raise RuntimeError("failing on purpose")


@job("traced-lease", lease=20.0, timeout=30)
async def traced_lease(ctx: JobContext) -> int:
    done = 0
    for _ in range(2):
        async with ctx.step() as conn:
            done += await query(ctx, conn)
    return done


@job("traced-mail")
async def traced_mail(ctx: JobContext) -> int:
    await outbox.enqueue(
        ctx.conn,
        schema=ctx.settings.db_schema,
        job=ctx.job.name,
        slot=None,
        user_id=1,
        recipient="someone@example.com",
        subject="traced",
        body="hello",
        sender="cron@example.com",
    )
    return 1


# Items of `traced-fanout` that fail (a test empties it before retrying them).
FAILING: set[int] = {2}


@job("traced-fanout", fanout=True)
async def traced_fanout(ctx: JobContext) -> list[int]:
    return [0, 1, 2]


@traced_fanout.each(timeout=10, retries=0)
async def traced_item(ctx: ItemContext) -> int:
    await query(ctx, ctx.conn)
    if ctx.item in FAILING:
        raise RuntimeError(f"item {ctx.item} fails")
    return int(ctx.item)
