"""The connection pool (PgBouncer-safe) and the migrations.

PgBouncer in transaction mode hands each transaction to whichever server connection is free,
so nothing here relies on session state: no session-level locks, no SET, no prepared
statements kept across transactions (`statement_cache_size=0` by default).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from importlib import resources
from typing import Any

import asyncpg

from app.errors import DatabaseUnavailable
from app.settings import Settings

log = logging.getLogger("cronlock.db")

# Errors that mean "the database cannot serve us now", as opposed to a bug in a query.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.exceptions.ConnectionDoesNotExistError,
    asyncpg.exceptions.InterfaceError,
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.exceptions.TooManyConnectionsError,
    asyncpg.exceptions.AdminShutdownError,
    asyncpg.exceptions.CrashShutdownError,
    asyncpg.exceptions.ConnectionFailureError,
    asyncpg.exceptions.InvalidAuthorizationSpecificationError,
    asyncpg.exceptions.InvalidCatalogNameError,
    asyncpg.exceptions.ProtocolViolationError,
    asyncpg.exceptions.InternalClientError,
)


def describe(exc: BaseException) -> str:
    """A short reason for a client or a log line: the kind of failure, never a stack trace."""
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, asyncpg.exceptions.TooManyConnectionsError):
        return "too many connections"
    if isinstance(exc, asyncpg.exceptions.CannotConnectNowError):
        return "database is starting up or shutting down"
    if isinstance(
        exc, asyncpg.exceptions.AdminShutdownError | asyncpg.exceptions.CrashShutdownError
    ):
        return "database connection terminated"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, asyncpg.exceptions.ConnectionDoesNotExistError):
        return "connection lost"
    if isinstance(exc, OSError):
        return f"network error: {exc.strerror or type(exc).__name__}"
    if isinstance(exc, asyncpg.PostgresError):
        return f"database error {exc.sqlstate}"
    return type(exc).__name__


async def _init_connection(conn: asyncpg.Connection) -> None:
    # jsonb in and out as Python values; the codec is per connection, set once when opened.
    await conn.set_type_codec(
        "jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog", format="text"
    )


async def _reset_connection(conn: asyncpg.Connection) -> None:
    """Pool reset: nothing to undo but an open transaction.

    asyncpg's default reset (advisory unlock all, CLOSE ALL, UNLISTEN *, RESET ALL) costs a
    round trip per release. cronlock never creates session state on pooled connections (only
    transaction-local settings and transaction-level locks, gone at commit or rollback), so
    a connection released outside a transaction is already clean.
    """
    if conn.is_in_transaction():
        await conn.execute("ROLLBACK")


async def create_pool(settings: Settings, dsn: str | None = None) -> asyncpg.Pool:
    """A pool that connects lazily: the service starts even while the database is down."""
    url = dsn or settings.database_url
    if not url:
        raise DatabaseUnavailable("DATABASE_URL is not set")
    pool = await asyncpg.create_pool(
        url,
        init_size=0,
        min_size=settings.db_pool_min_size,
        max_size=settings.db_pool_max_size,
        statement_cache_size=settings.db_statement_cache_size,
        timeout=settings.db_connect_timeout,
        command_timeout=None,
        max_inactive_connection_lifetime=60.0,
        init=_init_connection,
        reset=_reset_connection,
        # application_name is one of the parameters PgBouncer tracks per client, so
        # pg_stat_activity shows which instance holds a lock even through the pooler.
        server_settings={"application_name": application_name(settings.instance_name)},
    )
    assert pool is not None
    return pool


def application_name(instance: str) -> str:
    # PostgreSQL truncates application_name at 63 bytes.
    return f"cronlock:{instance}"[:63]


async def connect(settings: Settings, dsn: str | None = None) -> asyncpg.Connection:
    """One connection outside the pool (CLI, LISTEN, migrations at start-up)."""
    url = dsn or settings.database_url
    if not url:
        raise DatabaseUnavailable("DATABASE_URL is not set")
    try:
        conn = await asyncpg.connect(
            url,
            statement_cache_size=settings.db_statement_cache_size,
            timeout=settings.db_connect_timeout,
            server_settings={"application_name": application_name(settings.instance_name)},
        )
    except CONNECTION_ERRORS as exc:
        raise DatabaseUnavailable(describe(exc)) from exc
    await _init_connection(conn)
    return conn


# --- migrations ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


def migrations() -> list[Migration]:
    """The numbered `.sql` files shipped in `app/migrations`, in order."""
    found = []
    for entry in (resources.files("app") / "migrations").iterdir():
        if entry.name.endswith(".sql"):
            number, _, rest = entry.name.partition("_")
            found.append(Migration(int(number), rest.removesuffix(".sql"), entry.read_text()))
    found.sort(key=lambda m: m.version)
    return found


MIGRATION_LOCK_SQL = "SELECT pg_advisory_xact_lock(hashtextextended('cronlock:migrate', 0))"
MIGRATION_TABLE_SQL = """
CREATE TABLE IF NOT EXISTS cronlock_migrations (
    version    integer PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""


async def migrate(conn: asyncpg.Connection) -> list[str]:
    """Apply the pending migrations in one transaction; returns the names applied.

    The transaction-level advisory lock makes N instances booting together migrate once:
    the others wait for it, then find nothing left to do.
    """
    applied: list[str] = []
    async with conn.transaction():
        await conn.execute(MIGRATION_LOCK_SQL)
        await conn.execute(MIGRATION_TABLE_SQL)
        done = {r["version"] for r in await conn.fetch("SELECT version FROM cronlock_migrations")}
        for m in migrations():
            if m.version in done:
                continue
            await conn.execute(m.sql)
            await conn.execute(
                "INSERT INTO cronlock_migrations (version, name) VALUES ($1, $2)", m.version, m.name
            )
            applied.append(f"{m.version:04d}_{m.name}")
            log.info("applied migration %04d_%s", m.version, m.name)
    return applied


async def pending_migrations(conn: asyncpg.Connection) -> list[int]:
    """Versions shipped with this code that the database has not applied yet."""
    exists = await conn.fetchval("SELECT to_regclass('cronlock_migrations') IS NOT NULL")
    done: set[int] = set()
    if exists:
        done = {r["version"] for r in await conn.fetch("SELECT version FROM cronlock_migrations")}
    return [m.version for m in migrations() if m.version not in done]


def as_json(value: Any) -> Any:
    """Round-trip through JSON so a job's return value is stored exactly as clients see it."""
    return json.loads(json.dumps(value))
