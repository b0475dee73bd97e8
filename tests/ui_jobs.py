"""Jobs for the dashboard's tests (CRON_JOBS=tests.jobs,tests.ui_jobs): hostile text in an
error and in params, to check that every page escapes what it shows."""

from __future__ import annotations

from pydantic import BaseModel, Field

from cronlock.core.jobs import JobContext, job

HOSTILE = "<script>alert('x')</script>"


class Text(BaseModel):
    text: str = Field(default="", max_length=200)


@job("hostile-error", params=Text)
async def hostile_error(ctx: JobContext) -> int:
    """Fail with an error that carries markup."""
    raise RuntimeError(f"{HOSTILE} {ctx.params.text}")


@job("hourly", schedule="0 * * * *")
async def hourly(ctx: JobContext) -> int:
    """A scheduled job whose slots the timeline draws."""
    return 1


# The browser tests' jobs (beside the demo's daily digest): one quick, one that waits in the
# database until it is cancelled.


@job("refresh-cache")
async def refresh_cache(ctx: JobContext) -> int:
    """Rebuild a cache table; quick."""
    await ctx.conn.execute("SELECT 1")
    return 1


class Export(BaseModel):
    seconds: float = Field(default=0.0, ge=0, le=60)


@job("long-export", params=Export, timeout=60)
async def long_export(ctx: JobContext) -> int:
    """Export a large table: one long statement."""
    await ctx.conn.execute("SELECT pg_sleep($1)", ctx.params.seconds)
    return 1
