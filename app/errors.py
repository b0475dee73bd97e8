"""One base exception; driver and OS errors are translated into these at the boundary."""

from __future__ import annotations


class CronlockError(Exception):
    """Base of every error cronlock raises on purpose."""


class DatabaseUnavailable(CronlockError):
    """The database cannot serve this request now: down, no free connection, a standby,
    or migrations not current. Answered as 503 with Retry-After; never for a value the
    database refused (that is InvalidInput)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class JobDefinitionError(CronlockError):
    """A job is declared wrongly (bad name, schedule, colliding lock key); start-up stops."""


class UnknownJob(CronlockError):
    def __init__(self, name: str) -> None:
        super().__init__(f"unknown job {name!r}")
        self.name = name


class InvalidTrigger(CronlockError):
    """A trigger's parameters are wrong (bad backfill slot, bad params); answered as 422."""


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
