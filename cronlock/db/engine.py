"""cronlock's connections taken from a SQLAlchemy AsyncEngine: one pool for the app and its
jobs (`Database(settings, engine=engine)`; the `sqlalchemy` extra).

`EnginePool` is what cronlock uses of an `asyncpg.Pool` (acquire with a timeout, as an awaitable
or a context manager; release; sizes; close), over the engine's own pool. A connection cronlock
holds is the engine's asyncpg connection, with cronlock's codecs while it holds it and the
engine's back when it returns it (cronlock/db/codecs.py); it goes back out of any transaction.

Refused in one line naming what to change (`check_engine`, `check_statement_caches`): an
engine that is not PostgreSQL through asyncpg, and, while DB_STATEMENT_CACHE_SIZE is 0 (the
default: PgBouncer in transaction mode may be in between), one that keeps prepared statements.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Generator
from typing import TYPE_CHECKING, Any, cast

import asyncpg

from cronlock.db import codecs
from cronlock.db.orm import require_sqlalchemy
from cronlock.errors import ConfigurationError, DatabaseMisconfigured

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

log = logging.getLogger("cronlock.db")

SAFE_CONNECT_ARGS = "connect_args={'statement_cache_size': 0, 'prepared_statement_cache_size': 0}"
# The codecs SQLAlchemy's asyncpg dialect sets on each connection it opens, replaced by ours
# while cronlock holds the connection.
DIALECT_CODECS = [("json", "pg_catalog"), ("jsonb", "pg_catalog")]


def _where(engine: Any) -> str:
    return str(engine.url.render_as_string(hide_password=True))


def check_engine(engine: Any) -> None:
    """An AsyncEngine of PostgreSQL through asyncpg, or ConfigurationError in one line."""
    require_sqlalchemy("Database(engine=...)")
    from sqlalchemy.ext.asyncio import AsyncEngine

    if not isinstance(engine, AsyncEngine):
        raise ConfigurationError(
            f"engine= takes a SQLAlchemy AsyncEngine (create_async_engine), not a "
            f"{type(engine).__name__}"
        )
    dialect = engine.dialect
    if dialect.name != "postgresql":
        raise ConfigurationError(
            f"engine {_where(engine)} is {dialect.name}: cronlock's locks are PostgreSQL's "
            "advisory locks; give it a postgresql+asyncpg:// engine"
        )
    if dialect.driver != "asyncpg":
        raise ConfigurationError(
            f"engine {_where(engine)} uses the {dialect.driver} driver: cronlock runs on "
            "asyncpg; create it with a postgresql+asyncpg:// URL"
        )


def statement_caches(dbapi_connection: Any) -> list[str]:
    """The statement caches a connection of the engine keeps, by their connect_args names:
    asyncpg's (named prepared statements it keeps on the server) and SQLAlchemy's (prepared
    statements it reuses). Both are private attributes, read here because the engine's
    connect_args are not kept anywhere public; tests/test_orm.py checks them."""
    found = []
    driver = getattr(dbapi_connection, "driver_connection", None) or getattr(
        dbapi_connection, "_connection", None
    )
    if getattr(driver, "_stmt_cache_enabled", False):
        found.append("statement_cache_size")
    if getattr(dbapi_connection, "_prepared_statement_cache", None) is not None:
        found.append("prepared_statement_cache_size")
    return found


def check_statement_caches(engine: Any, dbapi_connection: Any, cache_size: int) -> None:
    """While DB_STATEMENT_CACHE_SIZE is 0 (PgBouncer in transaction mode may be in between),
    an engine that keeps prepared statements is refused: a statement prepared on one server
    connection is missing on the next, or collides with another client's name."""
    if cache_size:
        return
    found = statement_caches(dbapi_connection)
    if found:
        raise DatabaseMisconfigured(
            f"engine {_where(engine)} keeps prepared statements ({', '.join(found)} above 0), "
            f"which PgBouncer in transaction mode breaks: create it with {SAFE_CONNECT_ARGS}, "
            "or set DB_STATEMENT_CACHE_SIZE above 0 if no PgBouncer is in between"
        )


def _driver_error(exc: BaseException) -> BaseException:
    """The asyncpg (or OS) error under SQLAlchemy's wrapping of it, else `exc` itself."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, asyncpg.PostgresError | asyncpg.InterfaceError | OSError):
            return seen
        seen = getattr(seen, "orig", None) or seen.__cause__
    return exc


def capacity(engine: AsyncEngine) -> int:
    """The engine pool's capacity (pool_size + max_overflow); 0 when unbounded or unknown."""
    pool: Any = engine.sync_engine.pool
    size, overflow = getattr(pool, "size", None), getattr(pool, "_max_overflow", -1)
    if not callable(size) or not isinstance(overflow, int) or overflow < 0:
        return 0
    return int(size()) + overflow


class _Held:
    __slots__ = ("conn", "dbapi", "engine_conn")

    def __init__(self, engine_conn: AsyncConnection, dbapi: Any, conn: asyncpg.Connection) -> None:
        self.engine_conn = engine_conn
        self.dbapi = dbapi
        self.conn = conn


class _Acquire:
    """`await pool.acquire()` or `async with pool.acquire() as conn:`, as asyncpg's."""

    def __init__(self, pool: EnginePool, timeout: float | None) -> None:
        self._pool = pool
        self._timeout = timeout
        self._conn: asyncpg.Connection | None = None

    def __await__(self) -> Generator[Any, None, asyncpg.Connection]:
        return self._pool._acquire(self._timeout).__await__()

    async def __aenter__(self) -> asyncpg.Connection:
        self._conn = await self._pool._acquire(self._timeout)
        return self._conn

    async def __aexit__(self, *exc: object) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await self._pool.release(conn)


class EnginePool:
    """What cronlock uses of asyncpg.Pool, over a SQLAlchemy AsyncEngine's pool."""

    def __init__(self, engine: AsyncEngine, statement_cache_size: int) -> None:
        self.engine = engine
        self.statement_cache_size = statement_cache_size
        self._held: dict[int, _Held] = {}

    def acquire(self, *, timeout: float | None = None) -> _Acquire:
        return _Acquire(self, timeout)

    async def _acquire(self, timeout: float | None) -> asyncpg.Connection:  # noqa: ASYNC109 - asyncpg.Pool's signature
        from sqlalchemy.exc import DBAPIError

        try:
            engine_conn = await asyncio.wait_for(self.engine.connect(), timeout)
        except DBAPIError as exc:
            # The driver's own error, which cronlock translates (cronlock/errors.py).
            raise _driver_error(exc) from exc
        try:
            pooled = await engine_conn.get_raw_connection()
            dbapi = pooled.dbapi_connection
            conn = cast(asyncpg.Connection, pooled.driver_connection)
            check_statement_caches(self.engine, dbapi, self.statement_cache_size)
            await codecs.set_ours_over(conn, DIALECT_CODECS)
        except BaseException:
            await engine_conn.close()
            raise
        self._held[id(conn)] = _Held(engine_conn, dbapi, conn)
        return conn

    async def release(self, conn: Any, *, timeout: float | None = None) -> None:  # noqa: ASYNC109 - asyncpg.Pool's
        """Back to the engine's pool: out of any transaction, with the engine's codecs; a
        connection that broke (or was terminated) is invalidated, so the engine drops it."""
        raw = getattr(conn, "_con", None) or conn
        held = self._held.pop(id(raw), None)
        if held is None:
            return
        engine_conn = held.engine_conn
        try:
            if raw.is_closed():
                await engine_conn.invalidate()
            else:
                if raw.is_in_transaction():
                    await asyncio.wait_for(raw.execute("ROLLBACK"), timeout)
                dialect: Any = self.engine.sync_engine.dialect
                await dialect.setup_asyncpg_json_codec(held.dbapi)
                await dialect.setup_asyncpg_jsonb_codec(held.dbapi)
        except Exception:
            log.debug("returning a connection to the engine failed", exc_info=True)
            raw.terminate()
            with contextlib.suppress(Exception):
                await engine_conn.invalidate()
        finally:
            await engine_conn.close()

    def get_size(self) -> int:
        pool: Any = self.engine.sync_engine.pool
        return int(pool.checkedin()) + int(pool.checkedout())

    def get_idle_size(self) -> int:
        pool: Any = self.engine.sync_engine.pool
        return int(pool.checkedin())

    def get_max_size(self) -> int:
        return capacity(self.engine)

    async def close(self) -> None:
        """Wait for cronlock's connections to come back (the engine is the app's: it stays);
        cancelled (Database.close's timeout), terminate those still out."""
        try:
            while self._held:  # noqa: ASYNC110 - connections come back from other tasks
                await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            for held in list(self._held.values()):
                held.conn.terminate()
            raise
