"""One base exception; driver and OS errors are translated into these at the boundary."""

from __future__ import annotations

import asyncpg


class CronlockError(Exception):
    """Base of every error cronlock raises on purpose."""


class DatabaseUnavailable(CronlockError):
    """The database cannot serve this request now: down, no free connection, a standby,
    or migrations not current. Answered as 503 with Retry-After."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class JobDefinitionError(CronlockError):
    """A job is declared wrongly (bad name, schedule, colliding lock key); start-up stops."""


class InvalidTrigger(CronlockError):
    """A trigger's parameters are wrong (bad backfill slot, bad params); answered as 422."""


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
