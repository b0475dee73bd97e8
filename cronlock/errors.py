"""One base exception; driver and OS errors are translated into these at the boundary."""

from __future__ import annotations

import logging
import re
import sys
from types import TracebackType
from typing import Any

import asyncpg


class CronlockError(Exception):
    """Base of every error cronlock raises on purpose."""


class DatabaseUnavailable(CronlockError):
    """The database cannot serve this request now: down, no free connection, a standby,
    or migrations not current. Answered as 503 with Retry-After; never for a value the
    database refused (that is InvalidInput)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class DatabaseMisconfigured(DatabaseUnavailable):
    """The driver refused DATABASE_URL itself (an unknown `sslmode`, say): configuration to fix,
    not an outage to wait out. Still a 503 for the service; the CLI's exit 2."""


STANDBY_REASON = (
    "database is a standby: advisory locks there do not coordinate with the primary, "
    "so jobs are refused"
)


class KeysUnavailable(CronlockError):
    """A trigger's token cannot be checked now: the keys to check it with (Google's, for
    TRIGGER_AUTH=oidc) could not be fetched and none are kept. A 503 for that token only."""


class ConfigurationError(CronlockError):
    """cronlock cannot start as configured; the message (one line) says what to change."""


class JobDefinitionError(ConfigurationError):
    """A job is declared wrongly (bad name, schedule, colliding lock key); start-up stops."""


def install_one_line_errors() -> None:
    """Make a ConfigurationError that stops a process print its one line, not a traceback.

    An app's module builds its `Cronlock` and declares its jobs at import time, where
    uvicorn (or any runner) would print the traceback of a mistake in them: the excepthook
    prints the line instead. A mistake found when the app's lifespan starts (the router
    included twice, two Cronlocks on one schema) reaches uvicorn as the traceback Starlette
    formats into its `lifespan.startup.failed` message: a filter on uvicorn's logger turns
    that into the same line. The line says what to change and the traceback adds nothing;
    every other exception is shown as before.
    """
    previous = sys.excepthook
    if getattr(previous, "cronlock", False):
        return

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, ConfigurationError):
            cause = cause.__cause__
        if cause is None:
            previous(kind, exc, tb)
            return
        print(f"{CANNOT_START}{cause}", file=sys.stderr)

    hook.cronlock = True  # type: ignore[attr-defined]
    sys.excepthook = hook
    logging.getLogger("uvicorn.error").addFilter(_lifespan_line)


CANNOT_START = "cronlock: cannot start: "


def _lifespan_line(record: logging.LogRecord) -> bool:
    """A logged traceback whose exception is a ConfigurationError becomes its one line."""
    text = record.getMessage()
    if not text.startswith("Traceback (most recent call last):"):
        return True
    last = text.rstrip().rpartition("\n")[2]
    for kind in _configuration_errors(ConfigurationError):
        name = f"{kind.__module__}.{kind.__qualname__}: "
        if last.startswith(name):
            record.msg, record.args = CANNOT_START + last.removeprefix(name), ()
            break
    return True


def _configuration_errors(kind: type[ConfigurationError]) -> list[type[ConfigurationError]]:
    found = [kind]
    for sub in kind.__subclasses__():
        found += _configuration_errors(sub)
    return found


class TransactionRequired(CronlockError):
    """`job_lock` was called outside a transaction (autocommit), where a transaction-level
    lock would be released as soon as it was taken."""


class InvalidTrigger(CronlockError):
    """A trigger's parameters are wrong (bad backfill slot, bad params); answered as 422.

    `detail` is always the documented list of `{"loc", "msg", "type"}`: pydantic's errors as
    they are, or one problem made from a text (with `loc` where the caller knows it)."""

    def __init__(self, detail: str | list[dict[str, Any]], loc: tuple[str, ...] = ()) -> None:
        if isinstance(detail, str):
            detail = [{"loc": list(loc), "msg": detail, "type": "value_error"}]
        super().__init__(detail)
        self.detail: list[dict[str, Any]] = detail

    def __str__(self) -> str:
        """The problems as one line (the CLI's, a log's): `loc: msg; ...`."""
        return "; ".join(
            ": ".join(filter(None, (".".join(map(str, e.get("loc", ()))), str(e.get("msg", "")))))
            for e in self.detail
        )


class LeaseLost(CronlockError):
    """A lease job's step (or its end) found the run no longer its own: the lease expired, or
    another instance took the run over with a newer token. Nothing of the step persisted; the
    job must stop (its holder cancels it if it does not)."""


class RunCancelled(CronlockError):
    """An operator asked a lease run to stop (`python -m cronlock cancel`); raised by its next
    step, which persisted nothing."""


class RetryRefused(CronlockError):
    """A retry of a fan-out run's failed items that cannot be made (cronlock/core/fanout_retry.py),
    with its reason in one line: `missing` when the run or item named does not exist (404; CLI
    exit 2), else the state of the run or its job forbids it now (409; CLI exit 1)."""

    def __init__(self, reason: str, *, missing: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.missing = missing


class InvalidInput(CronlockError):
    """The database refused a value the request (or the command line) gave it: a data
    exception, SQLSTATE class 22. The client's mistake, answered as 422 (CLI: exit 2), not a
    503 that would page someone and invite the client to send it again.

    `loc` says where the value came from ("query", "body", ...) as far as the caller knows:
    the database does not say which parameter it refused."""

    def __init__(self, reason: str, loc: tuple[str, ...] = ()) -> None:
        super().__init__(reason)
        self.reason = reason
        self.loc = loc


class InvalidSchedule(InvalidInput):
    """A dynamic schedule refused before anything is written (cronlock/core/schedules.py): a bad
    cron expression, zone, key or params, a job that is not dynamic, the configured limit.
    `loc` names the field (`schedule`, `tz`, `every`, `params`, `key`, `job`); 422, CLI exit 2."""

    kind = "invalid_schedule"


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
    if isinstance(exc, asyncpg.exceptions.TargetServerAttributeNotMatched):
        # target_session_attrs=read-write and every host reached is a standby or read-only.
        return "no host is a writable primary (target_session_attrs)"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, asyncpg.exceptions.ConnectionDoesNotExistError):
        return "connection lost"
    if isinstance(exc, OSError):
        return f"network error: {exc.strerror or type(exc).__name__}"
    if isinstance(exc, asyncpg.PostgresError):
        return server_message(exc)
    return type(exc).__name__


# A server message is one line of a reason, not a page.
MAX_SERVER_MESSAGE = 300


def server_message(exc: asyncpg.PostgresError) -> str:
    """PostgreSQL's own words with the code (`28000: role "nobody" does not exist`), so a
    person can act on them. Never a data exception's (class 22) message: that quotes the value
    refused, which may be anything a request carried; and never DETAIL (it quotes key values).
    The server never puts a password in a message."""
    code = exc.sqlstate or "?????"
    if isinstance(exc, asyncpg.DataError) or code.startswith("22"):
        return refused(exc) if isinstance(exc, asyncpg.DataError) else f"data exception ({code})"
    message = " ".join(str(getattr(exc, "message", None) or exc).split())
    if not message:
        return f"database error {code}"
    if len(message) > MAX_SERVER_MESSAGE:
        message = message[:MAX_SERVER_MESSAGE] + "..."
    return f"{code}: {message}"


# Everything `translate` turns into one of ours.
DRIVER_ERRORS: tuple[type[BaseException], ...] = (asyncpg.PostgresError, *CONNECTION_ERRORS)
# The driver's own errors, without the OSErrors of its sockets (which no one can tell from a
# file's): what the CLI translates wherever a command left one untranslated.
DATABASE_DRIVER_ERRORS: tuple[type[BaseException], ...] = tuple(
    e for e in DRIVER_ERRORS if not issubclass(e, OSError)
)
# A statement of ours that failed for any database reason, translated or not yet (a block that
# overran DB_QUERY_TIMEOUT raises DatabaseUnavailable): what a background write retries later.
DATABASE_ERRORS: tuple[type[BaseException], ...] = (*DRIVER_ERRORS, DatabaseUnavailable)


def translate(exc: BaseException, *, input_from: tuple[str, ...] | None = None) -> CronlockError:
    """The one translation of a driver or OS error into ours; raise it `from exc`.

    `input_from` is given where the statements carry values of the request or command line
    (it says where they came from: "query", "body"...). There a data exception (SQLSTATE class
    22: a number out of range, a NUL in text, a date the server cannot hold) is the caller's
    InvalidInput; everywhere else, as for every other error, the database is unavailable. A
    job's own statements never come here: their errors are the job's failure (500, run id).
    """
    if isinstance(exc, asyncpg.ClientConfigurationError):
        # asyncpg's message may quote the URL, password and all: not repeated.
        return DatabaseMisconfigured(
            "DATABASE_URL has a parameter the driver refuses (check its ?options, e.g. sslmode)"
        )
    if isinstance(exc, CONNECTION_ERRORS):
        return DatabaseUnavailable(f"database unreachable: {describe(exc)}")
    if isinstance(exc, asyncpg.UndefinedTableError | asyncpg.InvalidSchemaNameError):
        return DatabaseUnavailable("migrations not applied (python -m cronlock migrate)")
    if input_from is not None and isinstance(exc, asyncpg.DataError):
        return InvalidInput(f"a value the database cannot take: {refused(exc)}", input_from)
    return DatabaseUnavailable(f"database error {describe(exc)}")


def refused(exc: asyncpg.DataError) -> str:
    """What kind of value was refused, from the condition's name, never from the message:
    that quotes the value, which may be anything a client sent."""
    if type(exc) is asyncpg.DataError:
        # 22000 itself is what asyncpg raises when it cannot even encode an argument (an
        # integer beyond bigint, a str with a lone surrogate), before the server sees it.
        return "out of range or of the wrong type for its parameter (SQLSTATE 22000)"
    words = re.sub(r"(?<!^)(?=[A-Z])", " ", type(exc).__name__.removesuffix("Error")).lower()
    return f"{words} (SQLSTATE {exc.sqlstate})"
