"""The article's helper, for those who want only the primitive:

    async with conn.transaction():                       # or session.begin(), conn.begin()
        async with job_lock(conn, "daily-digest") as lock:
            if not lock.acquired:
                return "already running"
            ...                                          # the work, on the same conn

`pg_try_advisory_xact_lock` on exactly the key cronlock's runner takes for that job (the same
text, `'<DB_SCHEMA>:<job>'`, hashed with LOCK_NAMESPACE: pass `schema=` and `namespace=` when
the deployment changed them), inside the caller's transaction. A run of that job by cronlock and
a block holding this lock exclude each other. The lock is the transaction's: it is held until
the caller commits or rolls back, not until the block ends (there is no unlock).

`conn`: an asyncpg connection (pooled or not), a SQLAlchemy `AsyncConnection` or an
`AsyncSession` (SQLModel's too). Outside a transaction (autocommit), where the lock would be
released as soon as it was taken, it raises TransactionRequired instead of pretending.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import asyncpg

from cronlock.db.lock import LockKey, lock_key, lock_text
from cronlock.errors import TransactionRequired
from cronlock.settings import Settings

TRY_SQL = "SELECT pg_try_advisory_xact_lock(hashtextextended($1, $2))"
# The same, in SQLAlchemy's bind style.
TRY_SA_SQL = "SELECT pg_try_advisory_xact_lock(hashtextextended(:text, :namespace))"

# The service's defaults (Settings): DB_SCHEMA and LOCK_NAMESPACE.
DEFAULT_SCHEMA: str = Settings.model_fields["db_schema"].default
DEFAULT_NAMESPACE: int = Settings.model_fields["lock_namespace"].default

OUTSIDE = (
    "job_lock needs an open transaction ({how}): outside one, a transaction-level lock is "
    "released as soon as it is taken"
)


@dataclass(frozen=True, slots=True)
class JobLock:
    """What `job_lock` tried: the job, the text hashed, the 64-bit key, and whether it got it."""

    job: str
    text: str
    key: LockKey
    acquired: bool


@contextlib.asynccontextmanager
async def job_lock(
    conn: Any,
    job: str,
    *,
    schema: str = DEFAULT_SCHEMA,
    namespace: int = DEFAULT_NAMESPACE,
    key: str | None = None,
) -> AsyncIterator[JobLock]:
    """Try the job's lock in `conn`'s transaction (see the module docstring); `key`: one key
    of a keyed job (its canonical text, as cronlock locks it)."""
    text = lock_text(schema, job, key)
    acquired = await _try(conn, text, namespace)
    yield JobLock(job, text, lock_key(text, namespace), acquired)


async def _try(conn: Any, text: str, namespace: int) -> bool:
    if isinstance(conn, asyncpg.Connection | asyncpg.pool.PoolConnectionProxy):
        if not conn.is_in_transaction():
            raise TransactionRequired(OUTSIDE.format(how="`async with conn.transaction():`"))
        return bool(await conn.fetchval(TRY_SQL, text, namespace))
    return await _try_sqlalchemy(conn, text, namespace)


async def _try_sqlalchemy(conn: Any, text: str, namespace: int) -> bool:
    wrong = TypeError(
        "job_lock takes an asyncpg connection, a SQLAlchemy AsyncConnection or an "
        f"AsyncSession, not a {type(conn).__name__}"
    )
    try:
        from sqlalchemy import text as sql
        from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
    except ImportError:
        raise wrong from None
    if not isinstance(conn, AsyncConnection | AsyncSession):
        raise wrong
    how = (
        "`async with session.begin():`"
        if isinstance(conn, AsyncSession)
        else ("`async with conn.begin():`")
    )
    if not conn.in_transaction():
        raise TransactionRequired(OUTSIDE.format(how=how))
    result = await conn.execute(sql(TRY_SA_SQL), {"text": text, "namespace": namespace})
    acquired = bool(result.scalar())
    # SQLAlchemy's transaction is its own bookkeeping: under isolation_level="AUTOCOMMIT" the
    # driver has none, and the lock just taken is already gone. Only the driver can tell.
    connection = await conn.connection() if isinstance(conn, AsyncSession) else conn
    raw = await connection.get_raw_connection()
    if not _driver_in_transaction(raw.driver_connection):
        raise TransactionRequired(
            OUTSIDE.format(how=f"{how}, not under isolation_level='AUTOCOMMIT'")
        )
    return acquired


def _driver_in_transaction(driver: Any) -> bool:
    """asyncpg's, or psycopg's (3) view of the server's transaction status."""
    if hasattr(driver, "is_in_transaction"):
        return bool(driver.is_in_transaction())
    info = getattr(driver, "info", None)
    status = getattr(info, "transaction_status", None)
    if status is not None:
        # psycopg.pq.TransactionStatus: IDLE = 0 (outside a transaction block).
        return int(status) != 0
    return True  # a driver we cannot ask: SQLAlchemy's answer stands
