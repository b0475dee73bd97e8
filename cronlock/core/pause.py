"""Pause and resume: the only module that speaks SQL about `<DB_SCHEMA>.pauses` (migration
0008).

A paused job is skipped ("paused") by every run that is not manual: scheduled triggers, the
built-in scheduler, backfill, catch-up and retries; `force=true` still runs it. The state is a
row in the database, so every instance agrees the moment it commits. It is checked twice: in
the probe (one round trip for the skip, see migration 0008) and under the job's lock, so that a
pause committed between the probe and the lock still stops the run.

A pause with `until` ends on its own at that time (the database's clock); resume deletes the
row. Who paused it, when, and why (an optional note) are kept and shown in `/cron/jobs`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

import asyncpg
from pydantic import BaseModel, PlainSerializer

from cronlock.db.pool import Conn
from cronlock.errors import InvalidTrigger
from cronlock.sql import qualify

# As cronlock/ops/views.py shows timestamps (ops imports this module, so the alias is not shared).
Timestamp = Annotated[datetime, PlainSerializer(lambda d: d.isoformat(), return_type=str)]

# A note a person reads in a table; long enough for a ticket link and a sentence.
MAX_NOTE = 500
MAX_BY = 200


class Paused(BaseModel):
    """A job's pause as /cron/jobs shows it."""

    by: str
    at: Timestamp
    note: str | None
    until: Timestamp | None  # None: until resumed


# The active pauses (an expired `until` counts as resumed).
ACTIVE_SQL = """
SELECT job, paused_by, paused_at, note, until FROM {schema}.pauses
WHERE (until IS NULL OR until > now()) AND ($1::text IS NULL OR job = $1)
"""

PAUSED_SQL = """
SELECT EXISTS (
    SELECT 1 FROM {schema}.pauses WHERE job = $1 AND (until IS NULL OR until > now())
)
"""

PAUSE_SQL = """
INSERT INTO {schema}.pauses AS p (job, paused_by, note, until) VALUES ($1, $2, $3, $4)
ON CONFLICT (job) DO UPDATE
SET paused_by = excluded.paused_by, note = excluded.note, until = excluded.until,
    -- An active pause keeps its start (paused for how long?); an expired one starts anew.
    paused_at = CASE WHEN p.until IS NULL OR p.until > now() THEN p.paused_at ELSE now() END
RETURNING job, paused_by, paused_at, note, until
"""

RESUME_SQL = """
DELETE FROM {schema}.pauses WHERE job = $1 RETURNING (until IS NULL OR until > now()) AS active
"""


def _view(r: asyncpg.Record) -> Paused:
    return Paused(by=r["paused_by"], at=r["paused_at"], note=r["note"], until=r["until"])


async def active(conn: Conn, schema: str, job: str | None = None) -> dict[str, Paused]:
    """The jobs paused now (all of them, or `job` alone), by name."""
    rows = await conn.fetch(qualify(ACTIVE_SQL, schema), job)
    return {r["job"]: _view(r) for r in rows}


async def is_paused(conn: Conn, schema: str, job: str) -> bool:
    """Whether `job` is paused now; run under the job's lock (see the module's docstring)."""
    return bool(await conn.fetchval(qualify(PAUSED_SQL, schema), job))


async def pause(
    conn: Conn,
    schema: str,
    job: str,
    *,
    by: str,
    note: str | None = None,
    until: datetime | None = None,
) -> Paused:
    """Pause `job` (again: the note and `until` are replaced, an active pause keeps its start).
    InvalidTrigger for an `until` that is not in the future of the database's clock."""
    if until is not None:
        if until.tzinfo is None:
            raise InvalidTrigger(
                "until needs a time zone offset, e.g. 2026-01-01T07:00:00Z", ("until",)
            )
        now: datetime = await conn.fetchval("SELECT now()")
        if until <= now:
            raise InvalidTrigger(
                f"until must be in the future (database time {now.isoformat()})", ("until",)
            )
    row = await conn.fetchrow(qualify(PAUSE_SQL, schema), job, by[:MAX_BY], note, until)
    assert row is not None
    return _view(row)


async def resume(conn: Conn, schema: str, job: str) -> bool:
    """Resume `job`; whether it was paused (an expired pause was not)."""
    return bool(await conn.fetchval(qualify(RESUME_SQL, schema), job))
