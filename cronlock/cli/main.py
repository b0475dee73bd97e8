"""The command line: `cronlock <command>` (the console script), or `python -m cronlock <command>`
(`python -m app <command>` in a checkout).

Exit codes scripts can rely on: 0 ran or skipped, 1 the job failed or timed out (or the
output could not be written), 2 bad usage or configuration, 3 the database is unavailable or
not migrated (only `migrate` applies migrations).

Operations (`jobs`, `runs`, `locks`, `cancel`, `outbox`) read the database directly, as the
HTTP routes do; `trigger` goes through a running service. `--json` prints what the HTTP API
answers, for scripts; without it, tables for people. `cancel` exits 1 when the job is not
running or its lock was not released in time; `trigger` exits 3 when the service or its
database is unreachable.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from cronlock.cli import control, migrate, outbox, reads, run, schedule, schedules, serve, trigger
from cronlock.cli.common import (
    EXIT_FAILED,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    Command,
    UsageError,
    fail,
)
from cronlock.db.schema import MigrationError
from cronlock.errors import (
    DATABASE_DRIVER_ERRORS,
    DatabaseMisconfigured,
    DatabaseUnavailable,
    InvalidInput,
    translate,
)
from cronlock.settings import Settings, SettingsError


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog or program_name())
    args = parser.parse_args(argv)
    handler: Command | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        code = _dispatch(handler, args)
        # Written now, so that a failing stdout (a closed pipe, a full disk) is seen here.
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # The reader went away (`| head`): no message, as any pipe producer. Python's own
        # convention: stdout to /dev/null (so its flush at exit does not fail again), exit 1.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_FAILED
    except OSError as exc:
        # The commands' database work is translated where it runs: an OSError here is a file
        # or stdout the command could not write (ENOSPC, EIO...).
        what = exc.filename or "cannot write output"
        return fail(f"{what}: {exc.strerror or type(exc).__name__}", EXIT_FAILED)


def program_name(argv0: str | None = None) -> str:
    """The program as the user typed it, for `--help` and usage errors: `python -m cronlock`
    (or `python -m app`) when run as a module, else the script's name (`cronlock`)."""
    path = Path(sys.argv[0] if argv0 is None else argv0)
    if path.name == "__main__.py":
        return f"python -m {path.parent.name}"
    return path.name or "cronlock"


def _dispatch(handler: Command, args: argparse.Namespace) -> int:
    settings: Settings | None = None
    try:
        try:
            settings = _settings()
            if not settings.database_url and handler is not serve.cmd_serve:
                # The embedded server a `serve` of this folder runs (never started here).
                url = serve.running_embedded_url(settings)
                if url is not None:
                    settings = Settings(database_url=url)
            result = handler(args, settings)
            if asyncio.iscoroutine(result):
                return asyncio.run(result)
            assert isinstance(result, int)
            return result
        except DATABASE_DRIVER_ERRORS as exc:
            # A driver error no command translated: the same translation as everywhere, then
            # the same exit codes.
            raise translate(exc) from exc
    except (SettingsError, UsageError) as exc:
        print(f"cronlock: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except InvalidInput as exc:
        # A value of the command line the database refused (argument types catch the rest).
        return fail(f"invalid argument: {exc.reason}", EXIT_USAGE)
    except DatabaseMisconfigured as exc:
        return fail(f"invalid configuration: {exc.reason}", EXIT_USAGE)
    except DatabaseUnavailable as exc:
        if settings is not None and not settings.database_url and handler is not serve.cmd_serve:
            # No database was ever named: configuration, and the line says what to set.
            return fail(serve.no_database_url(settings), EXIT_USAGE)
        return fail(f"database unavailable: {exc.reason}", EXIT_UNAVAILABLE)
    except MigrationError as exc:
        return fail(exc.reason, EXIT_UNAVAILABLE)
    except ValidationError as exc:
        # A setting from the environment or .env that does not parse: name it, no traceback
        # (and never its value, which may be a password).
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])).upper() or 'settings'}: {e['msg']}"
            for e in exc.errors()
        )
        return fail(f"invalid configuration: {problems}", EXIT_USAGE)
    except KeyboardInterrupt:
        return 130


def _settings() -> Settings:
    """The settings, from the environment and .env (read once)."""
    try:
        return Settings()
    except UnicodeDecodeError as exc:
        raise SettingsError(f"cannot read .env: not UTF-8 (byte {exc.start + 1})") from None


def build_parser(prog: str = "cronlock") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    sub = parser.add_subparsers(metavar="command")
    # In this order in `--help`.
    serve.add_commands(sub)
    migrate.add_commands(sub)
    run.add_run(sub)
    reads.add_commands(sub)
    trigger.add_commands(sub)
    control.add_cancel(sub)
    outbox.add_commands(sub)
    schedule.add_commands(sub)
    run.add_catch_up(sub)
    control.add_pause(sub)
    run.add_retry_items(sub)
    schedules.add_schedules_commands(sub)
    return parser
