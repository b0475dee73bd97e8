"""`ctx.session`: a SQLAlchemy 2 AsyncSession whose statements run on the lock's connection,
inside the lock's transaction (the `sqlalchemy` extra; SQLAlchemy is imported only when a
session is made, so cronlock works without it).

**One transaction.** The session never begins or ends the lock's transaction. Its own
"transaction" is a savepoint in it: `session.commit()` releases the savepoint (the writes become
part of the run's transaction and commit with its ledger row, or roll back with it if the job
fails later), `session.rollback()` rolls back to it (undoing the session's work since its
last commit; the lock stays held and the run's transaction stays usable, even after an SQL
error inside the session). The savepoint is taken at the session's first statement after a
begin or a commit, so a session that is never used costs nothing.

**Nothing leaks.** SQLAlchemy's asyncpg dialect sets its own json and jsonb codecs on every
connection it opens; those would change what a raw `select $1::jsonb` takes and gives, on this
run and on every later one of the pooled connection (issue 30). Here the dialect's codec calls
are recorded, not applied: they are put on the connection just around the statements
SQLAlchemy prepares (asyncpg fixes a statement's codecs when it prepares it) and cronlock's
are put back at once (cronlock/db/codecs.py), so raw SQL and the ORM can take turns within one
job. SQLAlchemy's own statement cache is off (`prepared_statement_cache_size=0`) and asyncpg
prepares unnamed statements while DB_STATEMENT_CACHE_SIZE is 0, so nothing named outlives a
statement (PgBouncer in transaction mode). SQLAlchemy never closes the connection: closing its
side hands it back; the connection stays cronlock's, and goes back to its pool as ever.

**Where the engine comes from.** SQLAlchemy needs an engine to build a session on; one is made
per physical connection, at the first session on it (its dialect then reads a few facts of the
server, once, in a savepoint), with a creator that lends that connection to the session open on
it, and only while one is: a session used after its run (or step) ended raises instead of
reaching another run's transaction.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import logging
import weakref
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, cast

import asyncpg

from cronlock.db import codecs
from cronlock.errors import ConfigurationError

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

log = logging.getLogger("cronlock.orm")

INSTALL = "pip install 'cronlock[sqlalchemy]'"

# What a session's statements run on: a pooled connection or a plain one.
_Conn = asyncpg.Connection | asyncpg.pool.PoolConnectionProxy


def require_sqlalchemy(what: str) -> None:
    """Raise one line naming the extra when SQLAlchemy's asyncio support is missing."""
    try:
        import sqlalchemy.ext.asyncio  # noqa: F401
    except ImportError as exc:
        raise ConfigurationError(f"{what} needs SQLAlchemy 2 (asyncio): {INSTALL}") from exc
    # SQLAlchemy imports without greenlet, then fails at the first statement.
    if importlib.util.find_spec("greenlet") is None:
        raise ConfigurationError(f"{what} needs greenlet (SQLAlchemy's asyncio): {INSTALL}")


class SessionEnded(RuntimeError):
    """A session (or a connection it handed out) used after its run or step ended."""


class _Savepoint:
    """What SQLAlchemy's asyncpg adapter takes for its transaction: a savepoint in the run's.
    Each statement is one simple query (one round trip, no prepared statement)."""

    def __init__(self, loan: _Loan, name: str) -> None:
        self._loan = loan
        self._name = name

    async def start(self) -> None:
        await self._loan._target().execute(f"SAVEPOINT {self._name}")

    async def commit(self) -> None:
        await self._loan._target().execute(f"RELEASE SAVEPOINT {self._name}")

    async def rollback(self) -> None:
        if self._loan.revoked:
            # Settled without committing: the run's (or step's) whole transaction is rolled
            # back next, so no round trip for this part of it.
            return
        # Works in an aborted transaction too: what a failed statement in the session left.
        await self._loan._target().execute(
            f"ROLLBACK TO SAVEPOINT {self._name}; RELEASE SAVEPOINT {self._name}"
        )


class _Loan:
    """The run's connection as SQLAlchemy's asyncpg adapter sees it (its driver connection):
    transactions are savepoints, codecs are SQLAlchemy's only while it prepares, closing hands
    the connection back, and after `revoke` every use raises."""

    def __init__(self, conn: _Conn) -> None:
        self._conn = conn
        self.revoked = False
        # The dialect's set_type_codec calls, by (type, schema): applied around its statements.
        self._codecs: dict[tuple[str, str], dict[str, Any]] = {}
        self._savepoints = itertools.count(1)

    def _target(self) -> _Conn:
        if self.revoked:
            raise SessionEnded(
                "ctx.session was used after its run (or lease step) ended: a session lives "
                "only inside the run's transaction"
            )
        return self._conn

    def revoke(self) -> None:
        self.revoked = True

    async def set_type_codec(
        self,
        typename: str,
        *,
        schema: str = "public",
        encoder: Callable[[Any], Any],
        decoder: Callable[[Any], Any],
        format: str = "text",
    ) -> None:
        self._codecs[(typename, schema)] = {
            "encoder": encoder,
            "decoder": decoder,
            "schema": schema,
            "format": format,
        }

    async def reset_type_codec(self, typename: str, *, schema: str = "public") -> None:
        self._codecs.pop((typename, schema), None)

    @contextlib.asynccontextmanager
    async def _their_codecs(self, conn: _Conn) -> AsyncIterator[None]:
        # No round trip either way (pg_catalog's types are known to asyncpg), and no other
        # task can use the connection in between: asyncpg runs one operation at a time.
        for (typename, _), codec in self._codecs.items():
            await conn.set_type_codec(typename, **codec)
        try:
            yield
        finally:
            if not conn.is_closed():
                await codecs.set_ours_over(conn, list(self._codecs))

    async def prepare(self, query: str, **kwargs: Any) -> Any:
        conn = self._target()
        async with self._their_codecs(conn):
            return await conn.prepare(query, **kwargs)

    async def executemany(self, command: str, args: Any, **kwargs: Any) -> Any:
        conn = self._target()
        async with self._their_codecs(conn):
            return await conn.executemany(command, args, **kwargs)

    def transaction(
        self, *, isolation: str | None = None, readonly: bool = False, deferrable: bool = False
    ) -> _Savepoint:
        conn = self._target()
        if isolation is not None or readonly or deferrable:
            raise RuntimeError(
                "ctx.session runs in the lock's transaction (read committed, read-write): "
                "it cannot choose its own isolation level, READ ONLY or DEFERRABLE"
            )
        if not conn.is_in_transaction():
            raise SessionEnded("ctx.session needs its run's transaction, which is over")
        return _Savepoint(self, f"cronlock_orm_{next(self._savepoints)}")

    def is_closed(self) -> bool:
        return self.revoked or self._conn.is_closed()

    async def close(self, *, timeout: float | None = None) -> None:  # noqa: ASYNC109 - asyncpg's
        """SQLAlchemy closing its side: the connection is cronlock's, it stays open."""

    def terminate(self) -> None:
        """Likewise: a connection that broke under the session fails the run, which closes it."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target(), name)


class _Binding:
    """One physical connection's SQLAlchemy engine, which lends the connection to the session
    open on it (`loan`), and only while one is."""

    def __init__(self) -> None:
        from sqlalchemy.ext.asyncio import create_async_engine
        from sqlalchemy.pool import NullPool

        self.loan: _Loan | None = None
        engine: AsyncEngine | None = None

        def creator() -> Any:
            # create_async_engine's `async_creator` cannot pass adapter arguments; this is
            # the form SQLAlchemy's own comment there gives for it.
            assert engine is not None
            dbapi: Any = engine.sync_engine.dialect.loaded_dbapi
            return dbapi.connect(async_creator_fn=self._lend, prepared_statement_cache_size=0)

        # NullPool: SQLAlchemy keeps nothing between checkouts; each one lends the connection
        # again (no round trip: the dialect's codec calls are only recorded).
        engine = create_async_engine("postgresql+asyncpg://", creator=creator, poolclass=NullPool)
        self.engine = engine

    async def _lend(self) -> _Loan:
        loan = self.loan
        if loan is None or loan.revoked:
            raise SessionEnded(
                "ctx.session was used after its run (or lease step) ended: a session lives "
                "only inside the run's transaction"
            )
        return loan


SessionFactory = Callable[..., "AsyncSession"]


class Sessions:
    """Makes `ctx.session`s for one runner: `session_class` is what is called with the engine
    (`bind=`); by default `sqlalchemy.ext.asyncio.AsyncSession` with `expire_on_commit=False`
    (a commit here ends no transaction, so nothing loaded goes stale). A class (SQLModel's
    `AsyncSession`) gets `expire_on_commit=False` too; a sessionmaker keeps its own settings."""

    def __init__(self, session_class: SessionFactory | None = None) -> None:
        if session_class is not None:
            require_sqlalchemy("session_class=")
        self.session_class = session_class
        self._bindings: weakref.WeakKeyDictionary[asyncpg.Connection, _Binding] = (
            weakref.WeakKeyDictionary()
        )

    def scope(self, conn: _Conn) -> SessionScope:
        """A lazy session on `conn` (made at its first use), for one run, step or item."""
        return SessionScope(self, conn)

    def _open(self, conn: _Conn) -> tuple[AsyncSession, _Loan]:
        require_sqlalchemy("ctx.session")
        from sqlalchemy.ext.asyncio import AsyncSession

        physical = cast(asyncpg.Connection, getattr(conn, "_con", None) or conn)
        binding = self._bindings.get(physical)
        if binding is None:
            binding = self._bindings[physical] = _Binding()
        if binding.loan is not None and not binding.loan.revoked:
            raise RuntimeError("a session is already open on this connection")
        loan = binding.loan = _Loan(conn)
        factory: SessionFactory = self.session_class or AsyncSession
        if isinstance(factory, type):
            session = factory(bind=binding.engine, expire_on_commit=False)
        else:
            session = factory(bind=binding.engine)
        return session, loan


class SessionScope:
    """The session of one run, step or fan-out item: made at the first `session` access, then
    settled once by `finish`."""

    def __init__(self, sessions: Sessions, conn: _Conn) -> None:
        self._sessions = sessions
        self._conn = conn
        self._session: AsyncSession | None = None
        self._loan: _Loan | None = None
        self._finished = False

    @property
    def used(self) -> bool:
        return self._session is not None

    @property
    def session(self) -> AsyncSession:
        if self._finished:
            raise SessionEnded(
                "ctx.session was used after its run (or lease step) ended: a session lives "
                "only inside the run's transaction"
            )
        if self._session is None:
            self._session, self._loan = self._sessions._open(self._conn)
        return self._session

    async def finish(self, *, commit: bool) -> None:
        """Commit the session into the run's transaction (its pending changes flushed, its
        savepoint released; an error here is the job's) or roll it back, then close it and
        take the connection back from SQLAlchemy."""
        if self._finished:
            return
        self._finished = True
        session, loan = self._session, self._loan
        if session is None or loan is None:
            return
        if not commit:
            # The run's (or step's) transaction is rolled back next, the session's work with
            # it: closing then costs no round trip (see `_Savepoint.rollback`).
            loan.revoke()
        try:
            if commit:
                await session.commit()
        finally:
            try:
                await session.close()
            except Exception:
                log.debug("closing a job's session failed", exc_info=True)
            finally:
                loan.revoke()
