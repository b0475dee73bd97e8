"""One base exception; driver and OS errors are translated into these at the boundary."""

from __future__ import annotations


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


class UnknownJob(CronlockError):
    def __init__(self, name: str) -> None:
        super().__init__(f"unknown job {name!r}")
        self.name = name


class InvalidTrigger(CronlockError):
    """A trigger's parameters are wrong (bad backfill slot, bad params); answered as 422."""
