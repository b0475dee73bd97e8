"""The connection pool (PgBouncer-safe) and the migrations.

PgBouncer in transaction mode hands each transaction to whichever server connection is free,
so nothing here relies on session state: no session-level locks, no SET, no prepared
statements kept across transactions (`statement_cache_size=0` by default).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from types import TracebackType
from typing import TYPE_CHECKING, cast

import asyncpg

from cronlock.db import codecs, schema
from cronlock.db.primary import Hosts, ServerConnection, read_timeline, record_timeline, timeline_of
from cronlock.errors import (
    CONNECTION_ERRORS,
    DRIVER_ERRORS,
    ConfigurationError,
    DatabaseMisconfigured,
    DatabaseUnavailable,
    describe,
    translate,
)
from cronlock.settings import Settings
from cronlock.sql import Conn as Conn  # where most modules take it from, with the pool

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

log = logging.getLogger("cronlock.db")


def terminate(conn: Conn) -> None:
    """Close a connection's socket now, without the cancel request asyncpg sends when a task
    awaiting a query is cancelled (PgBouncer before 1.21 can crash on those, see the README).
    The server ends the session's transaction as soon as it sees the socket closed. A
    connection the server already dropped is closed already (asyncpg then detaches it from
    its pool proxy, which would make `terminate` raise)."""
    with contextlib.suppress(asyncpg.InterfaceError):
        conn.terminate()


class deadline:  # lower case: it reads as a function, `with deadline(conn, seconds):`
    """Bound a block of statements on `conn`: past `seconds` the connection is closed and the
    block fails with DatabaseUnavailable. The server's own timeouts cannot help when it, or a
    pooler in between, stops answering with the socket still open (a frozen process, a
    network that drops packets): the request would wait for ever. A block that overran is a
    failure even if its last statement came back meanwhile: the connection is gone.

    A class, not a generator-based context manager: it wraps the statements of every trigger
    and every fan-out item (three times an item), and costs about 4 µs a block instead of 6
    this way, most of what is left being the event loop's timer."""

    __slots__ = ("conn", "expired", "handle", "seconds")

    def __init__(self, conn: Conn, seconds: float) -> None:
        self.conn = conn
        self.seconds = seconds
        self.expired = False
        self.handle: asyncio.TimerHandle | None = None

    def _expire(self) -> None:
        self.expired = True
        terminate(self.conn)

    def __enter__(self) -> None:
        self.handle = asyncio.get_running_loop().call_later(self.seconds, self._expire)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self.handle is not None
        self.handle.cancel()
        if self.expired and (exc is None or isinstance(exc, Exception)):
            reason = f"no answer from the database within {self.seconds:g} s"
            raise DatabaseUnavailable(reason) from exc


async def _init_connection(conn: asyncpg.Connection) -> None:
    # jsonb in and out as Python values; the codec is per connection, set once when opened
    # (cronlock/db/codecs.py: what an ORM session sets meanwhile is put back at once).
    await codecs.set_ours(conn)


async def _reset_connection(conn: asyncpg.Connection) -> None:
    """Pool reset: nothing to undo but an open transaction.

    asyncpg's default reset (advisory unlock all, CLOSE ALL, UNLISTEN *, RESET ALL) costs a
    round trip per release. cronlock never creates session state on pooled connections (only
    transaction-local settings and transaction-level locks, gone at commit or rollback), and
    what a job leaves behind is cleared inside its own transaction before it commits
    (`lock.reset_session`; a job that fails is rolled back, which undoes its SETs, though
    not a session-level advisory lock it took: jobs use the `_xact_` forms), so a connection
    released outside a transaction is already clean.
    """
    if conn.is_in_transaction():
        await conn.execute("ROLLBACK")


async def create_pool(
    settings: Settings, dsn: str | None = None, hosts: Hosts | None = None
) -> asyncpg.Pool:
    """A pool that connects lazily: the service starts even while the database is down.
    Connections are opened host by host (`Hosts.connect`: a multi-host URL follows the
    primary, each host with its own connect timeout) and refused on a stale primary."""
    url = dsn or settings.database_url
    if not url:
        raise DatabaseUnavailable("DATABASE_URL is not set")
    hosts = hosts or Hosts(url)
    pool = await asyncpg.create_pool(
        url,
        connect=hosts.connect,
        connection_class=ServerConnection,
        # Lazy: no connection until the first request, so start-up never waits for the
        # database; idle connections close after a minute.
        init_size=0,
        min_size=0,
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


async def connect(
    settings: Settings, dsn: str | None = None, *, database: str | None = None
) -> asyncpg.Connection:
    """One connection outside the pool (CLI, LISTEN, migrations at start-up); `database`: to
    that database of the same server instead of the URL's."""
    url = dsn or settings.database_url
    if not url:
        raise DatabaseUnavailable("DATABASE_URL is not set")
    other = {} if database is None else {"database": database}
    try:
        conn = await Hosts(url).connect(
            url,
            **other,
            statement_cache_size=settings.db_statement_cache_size,
            timeout=settings.db_connect_timeout,
            server_settings={"application_name": application_name(settings.instance_name)},
        )
    except CONNECTION_ERRORS as exc:
        # Only an outage: any other refusal (an unknown setting in the URL) is not one, and
        # its callers say so (the outbox's listener logs it rather than waiting quietly).
        raise translate(exc) from exc
    await _init_connection(conn)
    return conn


class Database:
    """The pool and what the service knows about the server behind it.

    The pool connects lazily and `watch` keeps the facts fresh in the background, so an
    instance starts (and answers 503 with a reason) while the database is down, a standby, or
    not migrated yet.

    `engine`: take connections from this SQLAlchemy AsyncEngine's pool instead of a pool of
    cronlock's own (cronlock/db/engine.py; DATABASE_URL is then not needed for them). Refused
    here, in one line, unless it is PostgreSQL through asyncpg; its statement caches are
    checked when `open` reaches the database (and on every connection taken).

    `on_ready`: run once, on the connection of the check that first finds a migrated primary,
    before jobs are let run (the instance records the jobs it declares: core/ledger.py
    `see_jobs`); if it fails, the database is not ready yet and the next check tries again.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        engine: AsyncEngine | None = None,
        on_ready: Callable[[Conn], Awaitable[None]] | None = None,
    ) -> None:
        self.settings = settings
        self._on_ready = on_ready
        if engine is not None:
            from cronlock.db.engine import check_engine

            check_engine(engine)
        self.engine = engine
        self._pool: asyncpg.Pool | None = None
        self.server_version = 0
        self.migrated = False
        self.standby = False
        self.problem: str | None = "database not checked yet"
        # Said on /readyz while the instance serves: migrations newer than this code.
        self.note: str | None = None
        # The last migration failure, said on /readyz until a migration run succeeds.
        self.migration_error: str | None = None
        # The migrations this deployment applies: cronlock's, then its job modules'.
        self.migration_sets = schema.migration_sets(settings.job_modules)
        self._checking: asyncio.Future[str | None] | None = None
        # The URL's hosts, the one that worked last and the newest timeline seen.
        self.hosts = Hosts(settings.database_url or "")

    async def open(self) -> None:
        if self._pool is None and self.engine is not None:
            await self._open_engine(self.engine)
        elif self._pool is None and self.settings.database_url:
            self._pool = await create_pool(self.settings, hosts=self.hosts)

    async def _open_engine(self, engine: AsyncEngine) -> None:
        """Use the engine's pool; a statement cache it keeps behind PgBouncer stops start-up
        (ConfigurationError) when the database answers now, else its first connection."""
        from cronlock.db.engine import EnginePool

        pool = EnginePool(engine, self.settings.db_statement_cache_size)
        self._pool = cast(asyncpg.Pool, pool)
        try:
            conn = await self.acquire()
        except DatabaseMisconfigured as exc:
            self._pool = None
            raise ConfigurationError(exc.reason) from exc
        except DatabaseUnavailable as exc:
            log.warning("engine not checked at start-up: %s", exc.reason)
            return
        await self.release(conn)

    @property
    def max_connections(self) -> int:
        """How many connections cronlock may hold at once: DB_POOL_MAX_SIZE, or the engine
        pool's capacity (DB_POOL_MAX_SIZE when that is unbounded)."""
        if self.engine is not None:
            from cronlock.db.engine import capacity

            return capacity(self.engine) or self.settings.db_pool_max_size
        return self.settings.db_pool_max_size

    async def close(self) -> None:
        """Close the pool once every connection is back, terminating what is still out after
        `db_connect_timeout`. The pool stays reachable meanwhile: a request cancelled at
        shutdown is still returning its connection, and asyncpg's `close` waits for each one
        (for ever, if `release` could no longer reach the pool)."""
        if self._pool is None:
            return
        try:
            # On timeout asyncpg's close() is cancelled and terminates the pool itself.
            await asyncio.wait_for(self._pool.close(), self.settings.db_connect_timeout)
        except TimeoutError:
            log.warning("connections still in use at shutdown were terminated")
        finally:
            self._pool = None

    @property
    def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise DatabaseUnavailable("DATABASE_URL is not set")
        return self._pool

    async def acquire(self) -> asyncpg.pool.PoolConnectionProxy:
        """A pooled connection within the acquire timeout, or DatabaseUnavailable."""
        pool = self.pool
        try:
            # asyncio.timeout, not the pool's `timeout=`: on Python 3.11 that one runs the
            # acquire in a task of its own, a cost paid at every trigger and fan-out item.
            async with asyncio.timeout(self.settings.db_acquire_timeout):
                conn = await pool.acquire()
        except TimeoutError as exc:
            # The pool's timeout covers opening a connection too: with one free, the wait
            # was for a database (or pooler) that accepts connections but does not answer.
            if pool.get_size() - pool.get_idle_size() < pool.get_max_size():
                raise DatabaseUnavailable("database unreachable: connecting timed out") from exc
            raise DatabaseUnavailable("no database connection free (pool exhausted)") from exc
        except CONNECTION_ERRORS as exc:
            raise translate(exc) from exc
        # Opened before this instance saw a newer timeline elsewhere (new connections to a
        # stale primary are refused as they open).
        reason = self.hosts.stale(timeline_of(conn))
        if reason is not None:
            terminate(conn)
            await self.release(conn)
            raise DatabaseUnavailable(reason)
        if not self.server_version:
            self.server_version = conn.get_server_version().major * 10000
        return conn

    @contextlib.asynccontextmanager
    async def connection(
        self, *, bounded: bool = True
    ) -> AsyncIterator[asyncpg.pool.PoolConnectionProxy]:
        """A pooled connection for a few short statements, with the acquire timeout (the
        pool's own `fetch` helpers would wait for ever when long jobs hold every connection)
        and, unless `bounded=False` (a block something else bounds, such as a job run inside
        it), DB_QUERY_TIMEOUT for the whole block (see `deadline`)."""
        conn = await self.acquire()
        try:
            if bounded:
                with deadline(conn, self.settings.db_query_timeout):
                    yield conn
            else:
                yield conn
        finally:
            await self.release(conn)

    async def release(self, conn: asyncpg.pool.PoolConnectionProxy) -> None:
        try:
            await self.pool.release(conn, timeout=self.settings.db_connect_timeout)
        except Exception:  # a broken connection is dropped by the pool either way
            log.debug("connection release failed", exc_info=True)

    async def check(self, *, apply_migrations: bool) -> str | None:
        """Look at the server once: reachable, primary, migrated. Returns the problem, if any."""
        try:
            conn = await self.acquire()
        except DatabaseUnavailable as exc:
            self.problem = exc.reason
            return self.problem
        try:
            # Migrations are not bounded: one may rightly take long (an index on a big table).
            with deadline(conn, self.settings.db_query_timeout):
                # One round trip for both: the timeline is None exactly on a standby. A
                # connection opened to a standby that was promoted since learns its timeline
                # here, and so does the instance.
                timeline = await read_timeline(conn)
                self.standby = timeline is None
            record_timeline(conn, timeline)
            stale = self.hosts.stale(timeline)
            if stale is not None:
                raise DatabaseUnavailable(stale)
            self.hosts.observe(timeline)
            if apply_migrations and not self.standby and not self.migrated:
                await self.migrate(conn)
            with deadline(conn, self.settings.db_query_timeout):
                found = await schema.status(conn, self.settings.db_schema, self.migration_sets)
            pending = [m.label for m in found.pending]
            ready = not pending and not found.legacy
            if ready and not self.standby and self._on_ready is not None:
                with deadline(conn, self.settings.db_query_timeout):
                    await self._on_ready(conn)
                self._on_ready = None
            self.migrated = ready
            self.note = found.note
            if self.standby:
                self.problem = (
                    "database is a standby (pg_is_in_recovery): advisory locks taken there do "
                    "not coordinate with the primary, so jobs are refused"
                )
            elif found.legacy:
                self.problem = "cronlock 0.1's tables in public are not moved yet: run migrate"
            elif pending and self.migration_error is not None:
                self.problem = self.migration_error
            elif pending:
                self.problem = "migrations not applied: " + ", ".join(pending)
            else:
                self.problem = None
        except schema.MigrationError as exc:
            self.problem = self.migration_error = exc.reason
        except DatabaseUnavailable as exc:
            self.problem = exc.reason
        except DRIVER_ERRORS as exc:
            if not isinstance(exc, CONNECTION_ERRORS):
                # The server's own message goes to the log, not to clients (/readyz, 503s).
                log.warning("database check failed: %s: %s", describe(exc), exc)
            self.problem = str(translate(exc))
        finally:
            await self.release(conn)
        return self.problem

    async def migrate(self, conn: Conn) -> list[str]:
        """Apply this deployment's pending migrations (not bounded by DB_QUERY_TIMEOUT: one may
        rightly take long, an index on a big table; MIGRATE_LOCK_TIMEOUT bounds lock waits)."""
        applied = await schema.migrate(
            conn,
            self.settings.db_schema,
            self.migration_sets,
            lock_timeout=self.settings.migrate_lock_timeout,
        )
        self.migration_error = None
        return applied

    def require_ready(self) -> None:
        """Jobs run only once migrations are current; reachability is found out per request."""
        if not self.migrated:
            raise DatabaseUnavailable(self.problem or "migrations not applied yet")

    async def ensure_ready(self) -> None:
        """`require_ready`, but a database not known ready yet is looked at now rather than at
        the watcher's next round: the first trigger after start-up or an outage need not wait.
        Concurrent callers share one check."""
        if self.migrated:
            return
        if self._checking is None or self._checking.done():
            self._checking = asyncio.ensure_future(
                self.check(apply_migrations=self.settings.migrate_on_start)
            )
        try:
            # Bounded: the check may wait behind another instance's migrations, or on a
            # database that stopped answering while migrating (migrations are not bounded).
            await asyncio.wait_for(asyncio.shield(self._checking), self.settings.db_query_timeout)
        except TimeoutError as exc:
            raise DatabaseUnavailable(
                f"database not ready: its check (migrations) did not finish within "
                f"{self.settings.db_query_timeout:g} s"
            ) from exc
        self.require_ready()

    async def watch(self, stop: asyncio.Event) -> None:
        """Re-check the server: soon after a problem, backing off while it lasts (a migration
        that fails fails the same way until someone acts), then now and then when ready (a
        primary can be demoted, a standby promoted). A problem is logged when it changes."""
        first = self.settings.migrate_retry_interval
        delay = first
        logged: str | None = None
        while not stop.is_set():
            problem = await self.check(apply_migrations=self.settings.migrate_on_start)
            if problem != logged:
                if problem is not None:
                    log.warning("database not ready: %s", problem)
                elif logged is not None:
                    log.info("database ready")
                logged = problem
            if problem is None:
                delay = first
                wait = max(first, 10.0)
            else:
                wait = delay
                delay = min(delay * 2, self.settings.migrate_retry_max)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)
