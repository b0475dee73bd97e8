"""Cancel requests, routed to the run's holder through the database.

A database-side cancel (`pg_cancel_backend`) only reaches a statement in progress: a job that
awaits something else (an HTTP call, a sleep) sits idle in its transaction and ignores it. So
`python -m cronlock cancel JOB` writes the request on the run's ledger row
(`cancel_requested_at/by`, migration 0007), where any instance can see it; the holder watches
its own row (`watch`, every CANCEL_POLL_INTERVAL seconds), cancels its job, rolls back and
records `cancelled`, and the trigger answers `500 {"error": "job cancelled"}`.

A holder that does not react within CANCEL_GRACE (frozen, its loop blocked) gets the
database-side fallback: `pg_cancel_backend` for a statement in progress, else
`pg_terminate_backend`; `--terminate` goes there at once. Behind PgBouncer a backend pid may
already serve someone else by then, so the fallback signals the pid only if, in the same
statement, it still holds the job's lock (`SIGNAL_HOLDER_SQL`).

Lease runs (cronlock/core/lease.py) are watched the same way: `watch` takes any run id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from cronlock.db.lock import PG_LOCKS_KEY, PG_LOCKS_OURS, LockKey
from cronlock.db.pool import Conn, Database
from cronlock.errors import DATABASE_ERRORS
from cronlock.sql import qualify

log = logging.getLogger("cronlock.cancel")

REQUEST_SQL = """
UPDATE {schema}.runs SET cancel_requested_at = now(), cancel_requested_by = $2
WHERE id = $1 AND status = 'running' AND cancel_requested_at IS NULL
RETURNING id
"""

REQUESTED_SQL = """
SELECT coalesce(cancel_requested_by, 'an operator') FROM {schema}.runs
WHERE id = $1 AND cancel_requested_at IS NOT NULL
"""

# The signal goes to the pid only while it still holds the job's lock: one statement, so a
# pooled backend that moved on to another client between the look and the signal is spared.
SIGNAL_HOLDER_SQL = f"""
SELECT CASE WHEN $3 THEN pg_terminate_backend(l.pid) ELSE pg_cancel_backend(l.pid) END
FROM pg_locks l
WHERE l.pid = $1 AND l.granted AND {PG_LOCKS_OURS} AND {PG_LOCKS_KEY} = $2
LIMIT 1
"""


async def request(conn: Conn, schema: str, run_id: int, by: str) -> bool:
    """Ask the holder of `run_id` to cancel it; False when the run is not running (or a
    request is pending already)."""
    return await conn.fetchval(qualify(REQUEST_SQL, schema), run_id, by[:200]) is not None


async def requested(conn: Conn, schema: str, run_id: int) -> str | None:
    """Who asked for `run_id` to be cancelled, if anyone did."""
    found: str | None = await conn.fetchval(qualify(REQUESTED_SQL, schema), run_id)
    return found


async def signal_holder(conn: Conn, pid: int, key: LockKey, *, terminate: bool) -> bool:
    """pg_cancel_backend / pg_terminate_backend of `pid`, only if it still holds `key`."""
    return bool(await conn.fetchval(SIGNAL_HOLDER_SQL, pid, key.key, terminate))


async def watch(
    db: Database, schema: str, run_id: int, interval: float, stop: asyncio.Event
) -> str | None:
    """Return (who asked) once a cancel of `run_id` is requested, or None once `stop` is set;
    polls the run's row on a pooled connection of its own (the job's is busy). A poll that
    fails is skipped: the database-side fallback still reaches a holder that cannot see its
    row. Stopped by the event, never cancelled: a task cancelled in the middle of a query
    makes asyncpg send a cancel request, which PgBouncer 1.18 can crash on."""
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)
        if stop.is_set():
            return None
        with contextlib.suppress(*DATABASE_ERRORS):
            async with db.connection() as conn:
                by = await requested(conn, schema, run_id)
            if by is not None:
                return by
