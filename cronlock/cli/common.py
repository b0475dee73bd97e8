"""What the commands share: exit codes, argument types, a database connection, the jobs,
and how answers are printed (cronlock/cli/main.py puts the commands together)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from datetime import datetime
from typing import Any

import asyncpg
import httpx

from cronlock import inputs
from cronlock.core.jobs import NAME_PATTERN, Registry, load
from cronlock.db.pool import connect, deadline
from cronlock.errors import DRIVER_ERRORS, JobDefinitionError, translate
from cronlock.settings import Settings, SettingsError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3

# A command gets its arguments and the settings, read once (from the environment and .env).
Command = Callable[[argparse.Namespace, Settings], Coroutine[Any, Any, int] | int]


@contextlib.contextmanager
def translated() -> Iterator[None]:
    """A command's database work outside `connection`: driver and OS errors become ours here,
    where they can only be the database's (main takes any other OSError for a file's)."""
    try:
        yield
    except DRIVER_ERRORS as exc:
        raise translate(exc) from exc


# Argument types check what the database (or the service) would refuse, so that a bad value
# is argparse's usage error (exit 2, the argument named), never a traceback.
JOB_NAME_MAX = 100
ID = inputs.int_range(1, inputs.BIGINT_MAX)
PARAMS = inputs.text(1_000_000)
# One line: options go into files of lines (a crontab) and HTTP query strings.
OPTION = inputs.line(2000)
# Who paused or cancelled: --by, or CRONLOCK_OPERATOR.
OPERATOR = inputs.line(200)
# A keyed job's key as its canonical text (cronlock/core/jobs.py MAX_KEY_LENGTH).
KEY = inputs.text(200)


def job_name(text: str) -> str:
    if not NAME_PATTERN.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"not a job name: {text[:40]!r} (letters, digits, '.', '_' or '-', at most "
            f"{JOB_NAME_MAX})"
        )
    return text


def service_url(text: str) -> str:
    inputs.line(2000)(text)
    try:
        url = httpx.URL(text)
    except (httpx.InvalidURL, TypeError, ValueError):
        url = None
    if url is None or url.scheme not in ("http", "https") or not url.host:
        raise argparse.ArgumentTypeError(f"not an http(s) URL: {text[:80]!r}")
    return text


def usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return EXIT_USAGE


def load_registry(settings: Settings) -> Registry:
    try:
        return load(settings.job_modules, settings.lock_namespace, settings.db_schema)
    except JobDefinitionError as exc:
        raise SettingsError(str(exc)) from exc


class UsageError(Exception):
    """A command line naming something that is not there: main prints the one line and exits
    2, as argparse does for a malformed argument."""


def known_job(registry: Registry, name: str | None) -> None:
    """The one rule of every command that names a job (`run`, `runs --job`, `cancel`, `pause`,
    `schedules ...`): a name the deployment does not declare is a usage error, never an empty
    answer."""
    if name is not None and name not in registry:
        raise UsageError(f"unknown job {name!r}; known: {', '.join(registry)}")


def fail(message: str, code: int) -> int:
    print(f"cronlock: {message}", file=sys.stderr)
    return code


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[("-" if v is None else str(v)) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)).rstrip()

    return "\n".join([line(headers), *(line(r) for r in cells)])


def when(value: datetime | None) -> str | None:
    """A UTC time as people read it in a table."""
    if value is None:
        return None
    return value.strftime("%Y-%m-%d %H:%M:%SZ")


def ms(value: float | None) -> str | None:
    if value is None:
        return None
    return f"{value:.0f} ms" if value < 10_000 else f"{value / 1000:.1f} s"


def seconds(value: float | None) -> str | None:
    return None if value is None else f"{value:.1f} s"


@contextlib.asynccontextmanager
async def connection(
    settings: Settings, *, bounded: bool = True
) -> AsyncIterator[asyncpg.Connection]:
    """A direct connection for one command; DatabaseUnavailable becomes exit code 3 in main.
    `bounded`: the command's statements together get DB_QUERY_TIMEOUT, as the service's read
    routes do, so a database or pooler that stops answering ends the command instead of
    hanging it; a command that waits on purpose bounds its own steps (`cancel`)."""
    conn = await connect(settings)
    try:
        try:
            if bounded:
                with deadline(conn, settings.db_query_timeout):
                    yield conn
            else:
                yield conn
        except DRIVER_ERRORS as exc:
            # The command's statements carry its arguments: a value the database refuses is
            # the caller's (exit 2), anything else is the database's (exit 3).
            raise translate(exc, input_from=("argument",)) from exc
    finally:
        # A frozen server never answers the goodbye either: past the timeout the socket is
        # simply closed (a connection the deadline closed is closed already).
        with contextlib.suppress(Exception):
            await conn.close(timeout=settings.db_connect_timeout)
