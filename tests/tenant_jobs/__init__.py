"""A job module that brings its own schema (its migrations create `tenant_jobs.visits`), as an
application's module would: the table outside cronlock's schema comes from the module."""

from __future__ import annotations

import asyncio

from cronlock.core.jobs import JobContext, job
from tests.jobs import Sleep

CRONLOCK_MIGRATIONS = "migrations"


@job("tenant-visit", params=Sleep, timeout=20)
async def tenant_visit(ctx: JobContext) -> int:
    """Record one visit, through the job's connection, in the module's own table; then hold
    the job's lock for `seconds`."""
    await ctx.conn.execute(
        "INSERT INTO tenant_jobs.visits (deployment, run_id) VALUES ($1, $2)",
        ctx.schema,
        ctx.run_id,
    )
    await asyncio.sleep(ctx.params.seconds)
    return 1
