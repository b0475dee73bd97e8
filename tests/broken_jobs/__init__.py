"""A job module whose migration collides with the application's own `public.users` (what a
module written for an empty database does on first contact with a real one)."""

from __future__ import annotations

from cronlock.core.jobs import JobContext, job

CRONLOCK_MIGRATIONS = "migrations"


@job("broken-noop")
async def broken_noop(ctx: JobContext) -> int:
    """Never reached while its module's migration fails."""
    return 0
