"""The command line: `python -m cronlock <command>`.

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
import contextlib
import json
import math
import os
import secrets
import signal
import sys
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import asyncpg
from pydantic import ValidationError

from cronlock import inputs
from cronlock.db.schema import MigrationError
from cronlock.errors import (
    DATABASE_DRIVER_ERRORS,
    DRIVER_ERRORS,
    DatabaseMisconfigured,
    DatabaseUnavailable,
    InvalidInput,
    translate,
)
from cronlock.settings import Settings, SettingsError

if TYPE_CHECKING:
    from cronlock.cli.embedded import LocalPostgres

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3

# A command gets its arguments and the settings, read once (from the environment and .env).
Command = Callable[[argparse.Namespace, Settings], Coroutine[Any, Any, int] | int]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
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
        return _fail(f"{what}: {exc.strerror or type(exc).__name__}", EXIT_FAILED)


def _dispatch(handler: Command, args: argparse.Namespace) -> int:
    try:
        try:
            result = handler(args, _settings())
            if asyncio.iscoroutine(result):
                return asyncio.run(result)
            assert isinstance(result, int)
            return result
        except DATABASE_DRIVER_ERRORS as exc:
            # A driver error no command translated: the same translation as everywhere, then
            # the same exit codes.
            raise translate(exc) from exc
    except SettingsError as exc:
        print(f"cronlock: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except InvalidInput as exc:
        # A value of the command line the database refused (argument types catch the rest).
        return _fail(f"invalid argument: {exc.reason}", EXIT_USAGE)
    except DatabaseMisconfigured as exc:
        return _fail(f"invalid configuration: {exc.reason}", EXIT_USAGE)
    except DatabaseUnavailable as exc:
        return _fail(f"database unavailable: {exc.reason}", EXIT_UNAVAILABLE)
    except MigrationError as exc:
        return _fail(exc.reason, EXIT_UNAVAILABLE)
    except ValidationError as exc:
        # A setting from the environment or .env that does not parse: name it, no traceback
        # (and never its value, which may be a password).
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])).upper() or 'settings'}: {e['msg']}"
            for e in exc.errors()
        )
        return _fail(f"invalid configuration: {problems}", EXIT_USAGE)
    except KeyboardInterrupt:
        return 130


def _settings() -> Settings:
    """The settings, from the environment and .env (read once)."""
    try:
        return Settings()
    except UnicodeDecodeError as exc:
        raise SettingsError(f"cannot read .env: not UTF-8 (byte {exc.start + 1})") from None


@contextlib.contextmanager
def _translated() -> Iterator[None]:
    """A command's database work outside `_connection`: driver and OS errors become ours here,
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
    from cronlock.core.jobs import NAME_PATTERN

    if not NAME_PATTERN.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"not a job name: {text[:40]!r} (letters, digits, '.', '_' or '-', at most "
            f"{JOB_NAME_MAX})"
        )
    return text


def service_url(text: str) -> str:
    import httpx

    inputs.line(2000)(text)
    try:
        url = httpx.URL(text)
    except (httpx.InvalidURL, TypeError, ValueError):
        url = None
    if url is None or url.scheme not in ("http", "https") or not url.host:
        raise argparse.ArgumentTypeError(f"not an http(s) URL: {text[:80]!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cronlock", description=__doc__)
    sub = parser.add_subparsers(metavar="command")

    serve = sub.add_parser("serve", help="run the HTTP service (embedded PostgreSQL if needed)")
    serve.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
    serve.add_argument(
        "--port", type=inputs.int_range(0, 65535), default=os.environ.get("PORT", "8000")
    )
    serve.add_argument(
        "--demo-users",
        type=inputs.int_range(0, 1_000_000),
        default=3,
        help="users to create in a new embedded database (default 3)",
    )
    serve.set_defaults(handler=cmd_serve)

    migrate = sub.add_parser("migrate", help="apply pending migrations and exit")
    shown = migrate.add_mutually_exclusive_group()
    shown.add_argument(
        "--dry-run", action="store_true", help="list what would be applied; change nothing"
    )
    shown.add_argument(
        "--sql", action="store_true", help="print the SQL that would be applied, for a DBA"
    )
    migrate.set_defaults(handler=cmd_migrate)

    run = sub.add_parser("run", help="run a job now, through the same lock/slot/ledger path")
    run.add_argument("job", type=job_name)
    run.add_argument("--force", action="store_true", help="run even if the slot is done")
    run.add_argument("--slot", type=inputs.timestamp, help="backfill this past tick")
    run.add_argument("--params", type=PARAMS, default=None, help="the job's params as JSON")
    run.add_argument("--json", action="store_true", help="print JSON")
    run.set_defaults(handler=cmd_run)

    add_ops_commands(sub)
    add_pause_commands(sub)
    return parser


# --- serve ------------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    import uvicorn

    from cronlock.cli.embedded import DataDirBusy, PostgresError, SetupError

    # Before anything starts: a SIGTERM while the embedded server starts (initdb, migrations)
    # must reach the `finally` below too, not kill us and leave the postmaster running in its
    # own session. uvicorn re-raises SIGTERM once it has shut down; as an exception rather
    # than the default action, that also lets the `finally` stop the embedded PostgreSQL.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    if not settings.secrets():
        path = generate_secret(Path("var"))
        os.environ["CRON_SECRET_FILE"] = str(path)
        header = path.with_name("cron_auth_header")
        print(f"cronlock: no CRON_SECRET set; generated one into {path} (mode 0600)")
        print(
            "cronlock: trigger the demo job with:\n"
            f"  curl -X POST -H @{header} http://{args.host}:{args.port}/cron/daily-digest"
        )
    # The dashboard's cookie is Secure by default (behind TLS termination the app sees only
    # http); a browser on plain http to a loopback address is the quick start, not that.
    loopback = args.host in ("127.0.0.1", "localhost", "::1")
    if loopback and "ui_cookie_secure" not in settings.model_fields_set:
        os.environ["UI_COOKIE_SECURE"] = "false"
    # Read again: CRON_SECRET_FILE, UI_COOKIE_SECURE may have just been set. Checked before
    # the embedded database is started and migrated: refusing them needs no database.
    settings = Settings()
    settings.check_secrets()
    settings.check_email()
    settings.check_retention()
    embedded = None
    try:
        if not settings.database_url:
            embedded = embedded_server(settings)
            try:
                os.environ["DATABASE_URL"] = start_embedded(embedded, settings, args.demo_users)
            except SetupError as exc:
                return _fail(f"embedded PostgreSQL: {_one_line(exc)}", EXIT_USAGE)
            except DataDirBusy as exc:  # another serve's server: its log is not ours to name
                return _fail(f"embedded PostgreSQL: {_one_line(exc)}", EXIT_UNAVAILABLE)
            except PostgresError as exc:
                log = embedded.log_path
                return _fail(
                    f"embedded PostgreSQL: {_one_line(exc)} (log: {log})", EXIT_UNAVAILABLE
                )
        if settings.ui_enabled:
            secure = "" if settings.ui_cookie_secure else " (cookie without Secure: loopback http)"
            print(
                f"cronlock: dashboard at http://{args.host}:{args.port}/ui/, log in with the token"
                f" in {settings.cron_secret_file or 'CRON_SECRET'}{secure}"
            )
        uvicorn.run(
            "cronlock.service:create_app",
            factory=True,
            host=args.host,
            port=args.port,
            access_log=False,
            # uvicorn waits for ever for requests in flight by default; a job still running
            # after this long is cancelled and rolled back. uvicorn takes whole seconds:
            # rounding up never cuts the setting short.
            timeout_graceful_shutdown=math.ceil(settings.graceful_shutdown_timeout),
        )
    finally:
        # Only a server this process started: one it found running belongs to someone else
        # (stop() itself signals only a postmaster that is this process's child, so a SIGTERM
        # landing between the spawn and `spawned` being known leaves nothing either).
        if embedded is not None:
            embedded.stop()
    return EXIT_OK


def _one_line(exc: Exception) -> str:
    """A server error's first line and, when it carries the server's log or output, the line
    that says why: the last FATAL, else the last line (the whole log is in its file)."""
    first, *rest = str(exc).splitlines() or [""]
    lines = [line.strip() for line in rest if line.strip()]
    fatal = [line[line.index("FATAL:") :] for line in lines if "FATAL:" in line]
    why = (fatal or lines or [""])[-1]
    return f"{first.rstrip(':')}: {why}" if why else first


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def generate_secret(folder: Path) -> Path:
    """A random secret in a file only this user can read, plus a curl header file (`curl -H
    @file`), so the secret never appears in a process's argv."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "cron_secret"
    if not path.exists():
        token = secrets.token_urlsafe(32)
        _write_private(path, token + "\n")
    token = path.read_text().strip()
    _write_private(folder / "cron_auth_header", f"Authorization: Bearer {token}\n")
    return path


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    path.chmod(0o600)


def embedded_server(settings: Settings) -> LocalPostgres:
    """The server of EMBEDDED_PG_DIR, whose superuser's password is in the file beside it,
    `<EMBEDDED_PG_DIR>.pgpass` (`var/pg.pgpass`, mode 0600), made with the server."""
    from cronlock.cli.embedded import LocalPostgres

    data = settings.embedded_pg_dir.resolve()
    return LocalPostgres(data, password_file=data.parent / f"{data.name}.pgpass")


def start_embedded(server: LocalPostgres, settings: Settings, demo_users: int) -> str:
    """Lock and start (or reuse) the local PostgreSQL in EMBEDDED_PG_DIR; returns the app's URL.

    The lock is held until this process ends: a second `serve` on the same folder is refused
    rather than sharing, or stopping, this one's server.
    """
    from cronlock.cli.embedded import SetupError

    try:
        server.lock()
        admin = server.start()
    except OSError as exc:  # a folder we may not create or write, say
        raise SetupError(f"{settings.embedded_pg_dir}: {exc}") from exc
    if server.upgraded:
        print(
            f"cronlock: upgraded the embedded PostgreSQL in {settings.embedded_pg_dir} in "
            "place (data kept): it let every local user in as superuser; now every connection "
            f"needs the password in {server.password_file}"
        )
    # The URL names the password file (`passfile`), never the password.
    print(
        f"cronlock: DATABASE_URL is not set; using the embedded PostgreSQL in "
        f"{settings.embedded_pg_dir} ({server.dsn('cronlock')})"
    )
    with _translated():  # a server going away meanwhile is the database's trouble (exit 3)
        url: str = asyncio.run(_prepare_embedded(server, admin, demo_users, settings))
    return url


async def _prepare_embedded(server: Any, admin: str, demo_users: int, settings: Settings) -> str:
    import asyncpg

    from cronlock.db.schema import migrate, migration_sets

    conn = await asyncpg.connect(admin)
    try:
        if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = 'cronlock'"):
            await conn.execute("CREATE DATABASE cronlock")
    finally:
        await conn.close()
    url: str = server.dsn("cronlock")
    conn = await asyncpg.connect(url)
    try:
        await migrate(
            conn,
            settings.db_schema,
            migration_sets(settings.job_modules),
            lock_timeout=settings.migrate_lock_timeout,
        )
        demo = await conn.fetchval("SELECT to_regclass('cronlock_demo.users') IS NOT NULL")
        if (
            demo
            and demo_users
            and not await conn.fetchval("SELECT count(*) FROM cronlock_demo.users")
        ):
            await conn.execute(
                "INSERT INTO cronlock_demo.users (email) SELECT 'user' || g || '@example.com' "
                "FROM generate_series(1, $1) g",
                demo_users,
            )
    finally:
        await conn.close()
    return url


# --- migrate, run -------------------------------------------------------------------------------


async def cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    from cronlock.db import schema
    from cronlock.db.pool import connect

    sets = schema.migration_sets(settings.job_modules)
    conn = await connect(settings)
    try:
        with _translated():
            if args.dry_run or args.sql:
                found = await schema.status(conn, settings.db_schema, sets)
                steps = await schema.plan(conn, settings.db_schema, sets)
                if args.sql:
                    out = schema.script(settings.db_schema, steps, settings.migrate_lock_timeout)
                elif steps:
                    out = "".join(f"would apply: {step.label}\n" for step in steps)
                else:
                    out = "migrations are current\n"
            else:
                applied = await schema.migrate(
                    conn, settings.db_schema, sets, lock_timeout=settings.migrate_lock_timeout
                )
                found = await schema.status(conn, settings.db_schema, sets)
                out = "applied: " + ", ".join(applied) if applied else "migrations are current"
                out += "\n"
    finally:
        await conn.close()
    print(out, end="")
    if found.note:
        print(f"note: {found.note}", file=sys.stderr)
    return EXIT_OK


async def cmd_run(args: argparse.Namespace, settings: Settings) -> int:
    from cronlock.core.jobs import parse_params
    from cronlock.core.outcome import answer
    from cronlock.errors import InvalidTrigger, JobDefinitionError

    registry = _load_registry(settings)
    if args.job not in registry:
        print(f"cronlock: unknown job {args.job!r}; known: {', '.join(registry)}", file=sys.stderr)
        return EXIT_USAGE
    try:
        registry.check_leases(settings.db_query_timeout, settings.lease_margin)
    except JobDefinitionError as exc:
        raise SettingsError(str(exc)) from exc
    job = registry[args.job]
    try:
        params = parse_params(job, (args.params or "").encode())
        async with _runner(settings, registry) as runner:
            outcome = await runner.trigger(
                job, force=args.force, slot=args.slot, params=params, source="cli"
            )
            if outcome.kind == "accepted":
                # A lease job runs in the background of this process: wait for its end. If
                # this process dies first, its lease runs out and a running service takes it
                # over.
                outcome = await runner.leases.settle(outcome.run_id or 0) or outcome
    except InvalidTrigger as exc:
        return _fail(f"invalid trigger: {_trigger_problem(exc)}", EXIT_USAGE)
    _, body = answer(outcome)
    if args.json:
        print(json.dumps(body))
    else:
        print(" ".join(f"{k}={v}" for k, v in body.items()))
    return EXIT_OK if outcome.kind in ("succeeded", "skipped") else EXIT_FAILED


def _trigger_problem(exc: Exception) -> str:
    """An InvalidTrigger's reason as one line: a text, or pydantic's errors (loc and msg)."""
    reason = exc.args[0] if exc.args else ""
    if isinstance(reason, list):
        return "; ".join(
            f"{'.'.join(map(str, e.get('loc', ()))) or 'params'}: {e.get('msg', '')}"
            if isinstance(e, dict)
            else str(e)
            for e in reason
        )
    return str(reason)


@contextlib.asynccontextmanager
async def _runner(settings: Settings, registry: Any) -> AsyncIterator[Any]:
    """A Runner on a pool of its own, for `run` and `catch-up`, on a database ready for jobs
    only: migrations are `migrate`'s (MIGRATE_ON_START is the service's), as for `jobs`."""
    from cronlock.core.runner import Runner
    from cronlock.db.pool import Database

    settings = settings.model_copy(update={"migrate_on_start": False})
    db = Database(settings)
    try:
        with _translated():
            await db.open()
            # A first connection, so that DATABASE_URL refused by the driver is configuration
            # (exit 2): check() reports every failure alike, as a problem.
            async with db.connection():
                pass
            problem = await db.check(apply_migrations=False)
        if problem is not None:
            hint = " (python -m cronlock migrate)" if "migrat" in problem else ""
            raise DatabaseUnavailable(problem + hint)
        runner = Runner(settings, registry, db)
        try:
            with _translated():
                yield runner
        finally:
            # A lease run still held here (interrupted) gives its lease up before the pool
            # goes, so that a running service takes it over at once.
            await runner.leases.shutdown()
    finally:
        await db.close()


# --- operations: jobs, runs, locks, trigger, cancel, outbox, schedule export, catch-up --------

DEFAULT_SERVICE_URL = "http://127.0.0.1:8000"


def add_ops_commands(sub: Any) -> None:
    jobs = sub.add_parser("jobs", help="every job: schedule, last run, running now, overdue")
    jobs.add_argument("--json", action="store_true", help="print JSON (as GET /cron/jobs)")
    jobs.set_defaults(handler=cmd_jobs)

    runs = sub.add_parser("runs", help="run history, newest first")
    runs.add_argument("--job", type=job_name)
    runs.add_argument("--key", type=KEY, help="one key's runs (keyed jobs), e.g. 42")
    runs.add_argument(
        "--status",
        choices=["running", "succeeded", "failed", "timed_out", "cancelled", "abandoned"],
    )
    runs.add_argument("--limit", type=inputs.int_range(1, 500), default=20)
    runs.add_argument("--before", type=ID, help="the `next` cursor of the previous page")
    runs.add_argument("--json", action="store_true", help="print JSON (as GET /cron/runs)")
    runs.set_defaults(handler=cmd_runs)

    locks = sub.add_parser("locks", help="advisory locks held now, mapped to jobs")
    locks.add_argument("--json", action="store_true", help="print JSON (as GET /cron/locks)")
    locks.set_defaults(handler=cmd_locks)

    trigger = sub.add_parser(
        "trigger",
        help="POST a job to a running service (secret from CRON_SECRET or CRON_SECRET_FILE)",
    )
    trigger.add_argument("job", type=job_name)
    trigger.add_argument(
        "--url",
        type=service_url,
        default=os.environ.get("CRONLOCK_URL", DEFAULT_SERVICE_URL),
        help=f"the service (default: $CRONLOCK_URL or {DEFAULT_SERVICE_URL})",
    )
    trigger.add_argument("--force", action="store_true", help="run even if the slot is done")
    # Checked by the service (a 422 is exit 2, with its answer), as for any other client.
    trigger.add_argument(
        "--slot", type=OPTION, help="backfill this past tick (ISO time with offset)"
    )
    trigger.add_argument("--params", type=PARAMS, help="the job's params as JSON")
    trigger.add_argument(
        "--no-wait", action="store_true", help="answer once the lock is taken (202 + run id)"
    )
    trigger.add_argument(
        "--follow", action="store_true", help="with --no-wait: poll the run until it ends"
    )
    trigger.add_argument(
        "--timeout",
        type=trigger_timeout,
        default=3600.0,
        help="HTTP timeout, seconds (--follow: also how long it retries a lost service)",
    )
    trigger.add_argument("--json", action="store_true", help="print the answer as JSON")
    trigger.set_defaults(handler=cmd_trigger)

    cancel = sub.add_parser(
        "cancel",
        help="stop a running job: its holder cancels it and rolls back (after CANCEL_GRACE, "
        "the database cancels or terminates the holder's backend)",
    )
    cancel.add_argument("job", type=job_name)
    cancel.add_argument("--key", type=KEY, help="a keyed job's run to cancel (its key)")
    cancel.add_argument(
        "--terminate",
        action="store_true",
        help="end the holder's session at once (pg_terminate_backend, only while it still "
        "holds the lock) instead of asking the holder",
    )
    cancel.add_argument(
        "--wait", type=inputs.seconds, default=10.0, help="seconds to wait for the lock to go"
    )
    cancel.add_argument("--json", action="store_true")
    cancel.set_defaults(handler=cmd_cancel)

    outbox = sub.add_parser("outbox", help="the email outbox: drain, dead rows, requeue")
    outbox_sub = outbox.add_subparsers(metavar="action")
    dead = outbox_sub.add_parser("dead", help="dead-lettered emails with their last error")
    dead.add_argument("--limit", type=ID, default=100)
    dead.add_argument("--json", action="store_true")
    dead.set_defaults(handler=cmd_outbox_dead)
    requeue = outbox_sub.add_parser("requeue", help="put dead emails back in the queue")
    requeue.add_argument("ids", nargs="*", type=ID, help="outbox row ids")
    requeue.add_argument("--all", action="store_true", help="every dead row")
    requeue.add_argument("--json", action="store_true")
    requeue.set_defaults(handler=cmd_outbox_requeue)
    drain = outbox_sub.add_parser(
        "drain", help="run a dedicated sender until SIGTERM (or, with --once, until empty)"
    )
    drain.add_argument("--once", action="store_true", help="exit when nothing is due")
    drain.set_defaults(handler=cmd_outbox_drain)
    outbox.set_defaults(handler=lambda args, settings: _usage(outbox))

    schedule = sub.add_parser("schedule", help="the external scheduler's configuration")
    schedule_sub = schedule.add_subparsers(metavar="action")
    export = schedule_sub.add_parser(
        "export", help="write crontab, Kubernetes, vercel.json or compose scheduler config"
    )
    export.add_argument(
        "--format", required=True, choices=["crontab", "kubernetes", "vercel", "compose"]
    )
    export.add_argument(
        "--url", type=service_url, help="the service's base URL as the scheduler reaches it"
    )
    export.add_argument(
        "--header-file",
        type=OPTION,
        default="/etc/cronlock/auth_header",
        help="crontab: the curl header file holding the secret",
    )
    export.add_argument(
        "--secret-name", type=OPTION, default="cronlock", help="kubernetes: the Secret"
    )
    export.add_argument(
        "--image",
        type=OPTION,
        default="curlimages/curl:8.10.1",
        help="kubernetes/compose: a curl image",
    )
    export.add_argument("--output", "-o", type=Path, help="write here instead of stdout")
    export.set_defaults(handler=cmd_schedule_export)
    schedule.set_defaults(handler=lambda args, settings: _usage(schedule))

    catch_up = sub.add_parser(
        "catch-up", help="run, once, the missed slot of each job with catch_up=True"
    )
    catch_up.add_argument("--json", action="store_true")
    catch_up.set_defaults(handler=cmd_catch_up)


def add_pause_commands(sub: Any) -> None:
    pause = sub.add_parser("pause", help="pause a job on every instance (force=true still runs it)")
    pause.add_argument("job", type=job_name)
    pause.add_argument(
        "--until", type=inputs.timestamp, help="resume on its own then (ISO time with offset)"
    )
    pause.add_argument("--note", type=inputs.text(500), help="why (shown in `jobs`)")
    pause.add_argument("--by", type=OPERATOR, help="who (default: user@host)")
    pause.add_argument("--json", action="store_true", help="print JSON (as the HTTP route)")
    pause.set_defaults(handler=cmd_pause)

    resume = sub.add_parser("resume", help="resume a paused job")
    resume.add_argument("job", type=job_name)
    resume.add_argument("--json", action="store_true", help="print JSON (as the HTTP route)")
    resume.set_defaults(handler=cmd_resume)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return EXIT_USAGE


def _load_registry(settings: Settings) -> Any:
    from cronlock.core.jobs import load
    from cronlock.errors import JobDefinitionError

    try:
        return load(settings.job_modules, settings.lock_namespace, settings.db_schema)
    except JobDefinitionError as exc:
        raise SettingsError(str(exc)) from exc


def _fail(message: str, code: int) -> int:
    print(f"cronlock: {message}", file=sys.stderr)
    return code


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2))


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[("-" if v is None else str(v)) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)).rstrip()

    return "\n".join([line(headers), *(line(r) for r in cells)])


def _when(value: datetime | None) -> str | None:
    """A UTC time as people read it in a table."""
    if value is None:
        return None
    return value.strftime("%Y-%m-%d %H:%M:%SZ")


def _ms(value: float | None) -> str | None:
    if value is None:
        return None
    return f"{value:.0f} ms" if value < 10_000 else f"{value / 1000:.1f} s"


def _seconds(value: float | None) -> str | None:
    return None if value is None else f"{value:.1f} s"


@contextlib.asynccontextmanager
async def _connection(
    settings: Settings, *, bounded: bool = True
) -> AsyncIterator[asyncpg.Connection]:
    """A direct connection for one command; DatabaseUnavailable becomes exit code 3 in main.
    `bounded`: the command's statements together get DB_QUERY_TIMEOUT, as the service's read
    routes do, so a database or pooler that stops answering ends the command instead of
    hanging it; a command that waits on purpose bounds its own steps (`cancel`)."""
    from cronlock.db.pool import connect, deadline

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


async def cmd_jobs(args: argparse.Namespace, settings: Settings) -> int:
    from cronlock.ops import views as ops

    registry = _load_registry(settings)
    async with _connection(settings) as conn:
        await ops.sweep(conn, settings)
        async with ops.reading(conn):
            view = await ops.jobs(conn, registry)
    if args.json:
        _print_json(view.model_dump(mode="json"))
        return EXIT_OK
    rows = []
    for j in view.jobs:
        last = j.last_run
        running = None
        if j.key_field is not None and j.running_keys:
            # Which keys run where: "42@i1 7@i2", the oldest first.
            running = " ".join(f"{h.key}@{h.instance}" for h in j.running_keys)
        elif j.running_on is not None:
            on = j.running_on
            # A lease run has no backend between its steps: its lease is what holds the job.
            how = "lease" if on.kind == "lease" else f"pid {on.pid}"
            running = f"{on.instance} {how} {_seconds(on.held_for)}"
        rows.append(
            [
                j.name,
                f"{j.schedule} {j.tz}" if j.schedule else None,
                last.status if last else None,
                _when(last.slot or last.started_at) if last else None,
                last.instance if last else None,
                _ms(last.duration_ms) if last else None,
                running,
                _when(j.next_slot),
                _late(j),
            ]
        )
    headers = [
        "JOB",
        "SCHEDULE",
        "LAST",
        "LAST SLOT/START",
        "ON",
        "TOOK",
        "RUNNING",
        "NEXT",
        "LATE",
    ]
    print(_table(headers, rows))
    print(f"(database time {_when(view.now)})")
    return EXIT_OK


def _late(j: Any) -> str | None:
    """The jobs table's LATE column: paused, waiting for a retry, overdue, or not."""
    if j.paused:
        return "PAUSED"
    if j.retry:
        return f"retry {j.retry.retry}/{j.retry.of} at {_when(j.retry.at)}"
    if j.overdue:
        return "OVERDUE"
    return "no" if j.schedule else None


async def cmd_runs(args: argparse.Namespace, settings: Settings) -> int:
    from cronlock.ops import views as ops

    registry = _load_registry(settings)
    async with _connection(settings) as conn:
        await ops.sweep(conn, settings, args.job)
        async with ops.reading(conn):
            page = await ops.runs(
                conn,
                registry,
                job=args.job,
                status=args.status,
                before=args.before,
                limit=args.limit,
                key=args.key,
            )
    if args.json:
        _print_json(page.model_dump(mode="json"))
        return EXIT_OK
    rows = [
        [
            r.id,
            r.job if r.key is None else f"{r.job} [{r.key}]",
            _when(r.slot),
            "running" if r.running else r.status,
            r.trigger,
            r.source,
            r.instance,
            _when(r.started_at),
            _ms(r.duration_ms),
            (r.error or "")[:60] or None,
        ]
        for r in page.runs
    ]
    headers = ["ID", "JOB", "SLOT", "STATUS", "TRIGGER", "SOURCE", "INSTANCE", "STARTED"]
    print(_table([*headers, "TOOK", "ERROR"], rows))
    if page.next is not None:
        print(f"(more: --before {page.next})")
    return EXIT_OK


async def cmd_locks(args: argparse.Namespace, settings: Settings) -> int:
    from cronlock.ops import views as ops

    registry = _load_registry(settings)
    async with _connection(settings) as conn, ops.reading(conn):
        found = await ops.locks(conn, registry)
    if args.json:
        _print_json(ops.LocksView(locks=found).model_dump(mode="json"))
        return EXIT_OK
    if not found:
        print("no advisory locks held")
        return EXIT_OK
    rows = [
        [
            (lk.job or "(not a job)") if lk.job_key is None else f"{lk.job} [{lk.job_key}]",
            lk.key,
            lk.pid if lk.kind == "advisory" else "lease",
            lk.instance,
            lk.state,
            _seconds(lk.held_for),
            lk.run_id,
            "" if lk.granted else "waiting",
        ]
        for lk in found
    ]
    print(_table(["JOB", "KEY", "PID", "HOLDER", "STATE", "HELD FOR", "RUN", ""], rows))
    return EXIT_OK


# HTTP answers of `POST /cron/<job>` -> exit code; any other 5xx is 3 (the service or what is
# in front of it cannot serve), any other answer 2 (a 4xx: the request, the secret).
TRIGGER_EXIT = {
    200: EXIT_OK,
    202: EXIT_OK,
    500: EXIT_FAILED,
    503: EXIT_UNAVAILABLE,
    504: EXIT_FAILED,
}
# A trigger waits for its job: an hour by default, some days at most (httpx cannot take more
# than a few hundred years, and nobody means that).
TRIGGER_TIMEOUT_MAX = 1_000_000
# What `--follow` retries: the service restarting or a proxy without a backend for a moment.
TRANSIENT_STATUS = (502, 503, 504)


def trigger_timeout(text: str) -> float:
    value = inputs.positive_seconds(text)
    if value > TRIGGER_TIMEOUT_MAX:
        raise argparse.ArgumentTypeError(f"must be at most {TRIGGER_TIMEOUT_MAX} seconds")
    return value


def trigger_exit(status: int) -> int:
    if status in TRIGGER_EXIT:
        return TRIGGER_EXIT[status]
    return EXIT_UNAVAILABLE if status >= 500 else EXIT_USAGE


class UnexpectedAnswer(Exception):
    """An answer that is not the service's (a proxy's HTML page, a body of the wrong shape)."""


def cmd_trigger(args: argparse.Namespace, settings: Settings) -> int:
    import httpx

    tokens = settings.secrets()
    if not tokens:
        return _fail("set CRON_SECRET or CRON_SECRET_FILE (never on the command line)", EXIT_USAGE)
    headers = {"Authorization": f"Bearer {tokens[0].decode()}"}
    params: dict[str, str] = {}
    if args.force:
        params["force"] = "true"
    if args.slot:
        params["slot"] = args.slot
    if args.no_wait:
        params["wait"] = "false"
    content = args.params.encode() if args.params else None
    if content is not None:
        headers["Content-Type"] = "application/json"
    base = args.url.rstrip("/")
    try:
        with httpx.Client(timeout=args.timeout) as client:
            answer = client.post(
                f"{base}/cron/{args.job}", params=params, content=content, headers=headers
            )
            body = _json_or_text(answer)
            status = answer.status_code
            code = trigger_exit(status)
            if status == 202 and args.follow:
                run_id = body.get("run_id") if isinstance(body, dict) else None
                if not isinstance(run_id, int) or isinstance(run_id, bool):
                    raise UnexpectedAnswer("a 202 without a run id")
                polled, run = _follow(client, base, headers, run_id, args.timeout)
                body = {"accepted": body, "run": run}
                if polled != 200:
                    code = EXIT_UNAVAILABLE if polled >= 500 else EXIT_USAGE
                else:
                    code = EXIT_OK if run.get("status") == "succeeded" else EXIT_FAILED
    except httpx.HTTPError as exc:
        return _fail(f"service unreachable at {base}: {exc}", EXIT_UNAVAILABLE)
    except UnexpectedAnswer as exc:
        return _fail(f"not the service's answer from {base}: {exc}", EXIT_UNAVAILABLE)
    if args.json:
        print(json.dumps(body))
    elif isinstance(body, dict):
        prefix = f"HTTP {status}"
        print(prefix + " " + " ".join(f"{k}={v}" for k, v in body.items()))
    else:
        print(f"HTTP {status} {body}")
    return code


def _json_or_text(answer: Any) -> Any:
    try:
        return answer.json()
    except ValueError:
        return answer.text


def _follow(
    client: Any, base: str, headers: dict[str, str], run_id: int, bound: float
) -> tuple[int, dict[str, Any]]:
    """Poll `GET /cron/runs/{id}` until the run has ended: its last answer's status and body.
    A lost connection or a 502/503/504 is retried until `bound` seconds without a good answer
    (the service restarting must not end a run's follower while the run goes on)."""
    import time

    import httpx

    good = time.monotonic()
    while True:
        try:
            answer = client.get(f"{base}/cron/runs/{run_id}", headers=headers)
        except httpx.TransportError:
            if time.monotonic() - good >= bound:
                raise
            time.sleep(0.5)
            continue
        if answer.status_code in TRANSIENT_STATUS and time.monotonic() - good < bound:
            time.sleep(0.5)
            continue
        run = _json_or_text(answer)
        if not isinstance(run, dict):
            raise UnexpectedAnswer(f"HTTP {answer.status_code}, not a JSON object")
        if answer.status_code != 200 or run.get("status") != "running":
            return answer.status_code, run
        good = time.monotonic()
        time.sleep(0.5)


async def cmd_cancel(args: argparse.Namespace, settings: Settings) -> int:
    from cronlock.ops import views as ops

    registry = _load_registry(settings)
    if args.job not in registry:
        return _fail(f"unknown job {args.job!r}; known: {', '.join(registry)}", EXIT_USAGE)
    # Waits up to --wait on purpose: ops.cancel bounds each step instead of the whole command.
    async with _connection(settings, bounded=False) as conn:
        done = await ops.cancel(
            conn,
            registry,
            settings,
            args.job,
            terminate=args.terminate,
            wait=args.wait,
            key=args.key,
            by=_operator(),
        )
    if done is None:
        which = args.job if args.key is None else f"{args.job} key {args.key}"
        return _fail(f"{which} is not running", EXIT_FAILED)
    first, run = done.holder, done.run
    result = {
        "job": args.job,
        "pid": first.pid,
        "instance": first.instance,
        "run_id": first.run_id,
        "key": first.job_key,
        # holder: the holder cancelled its job on request; cancel / terminate: the database-side
        # fallback (or --terminate); none: nothing reached it.
        "signal": done.how,
        "released": done.released,
        "run": run.model_dump(mode="json") if run is not None else None,
    }
    if args.json:
        print(json.dumps(result))
    elif first.kind == "fanout":
        status = run.status if run is not None else "unknown"
        print(
            f"{args.job}: cancel requested from the fan-out's workers; run {first.run_id} "
            f"{'recorded as ' + status if done.released else 'still running'}",
            file=sys.stdout if done.released else sys.stderr,
        )
    elif first.kind == "lease":
        status = run.status if run is not None else "unknown"
        print(
            f"{args.job}: cancel requested from the lease holder on {first.instance}; "
            f"run {first.run_id} {'recorded as ' + status if done.released else 'still running'}",
            file=sys.stdout if done.released else sys.stderr,
        )
    elif done.released:
        status = run.status if run is not None else "unknown"
        how = {
            "holder": f"cancelled by its holder on {first.instance}",
            "cancel": f"pg_cancel_backend sent to pid {first.pid} on {first.instance}",
            "terminate": f"pg_terminate_backend sent to pid {first.pid} on {first.instance}",
        }.get(done.how, "ended")
        print(f"{args.job}: {how}; lock released; run {first.run_id} recorded as {status}")
    else:
        print(
            f"{args.job}: asked ({done.how}), but pid {first.pid} on {first.instance} still "
            f"holds the lock after {args.wait:g} s",
            file=sys.stderr,
        )
    return EXIT_OK if done.released else EXIT_FAILED


def _operator() -> str:
    """Who runs this command, for `pause` and `cancel` to record: CRONLOCK_OPERATOR (from the
    process environment), else user@host."""
    import getpass
    import socket

    named = os.environ.get("CRONLOCK_OPERATOR", "").strip()
    if named:
        # Checked as --by is: a byte that is not UTF-8 would otherwise be the database's
        # refusal, naming nothing.
        try:
            return OPERATOR(named)
        except argparse.ArgumentTypeError as exc:
            raise SettingsError(f"CRONLOCK_OPERATOR: {exc}") from None
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container's)
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


async def cmd_pause(args: argparse.Namespace, settings: Settings) -> int:
    from cronlock.core import pause
    from cronlock.errors import InvalidTrigger

    registry = _load_registry(settings)
    if args.job not in registry:
        return _fail(f"unknown job {args.job!r}; known: {', '.join(registry)}", EXIT_USAGE)
    async with _connection(settings) as conn:
        try:
            state = await pause.pause(
                conn,
                settings.db_schema,
                args.job,
                by=args.by or _operator(),
                note=args.note,
                until=args.until,
            )
        except InvalidTrigger as exc:
            return _fail(str(exc.args[0]), EXIT_USAGE)
    if args.json:
        _print_json({"job": args.job, "paused": state.model_dump(mode="json")})
        return EXIT_OK
    until = f"until {_when(state.until)}" if state.until else "until resumed"
    note = f" ({state.note})" if state.note else ""
    print(f"{args.job}: paused by {state.by} since {_when(state.at)}, {until}{note}")
    return EXIT_OK


async def cmd_resume(args: argparse.Namespace, settings: Settings) -> int:
    from cronlock.core import pause

    registry = _load_registry(settings)
    if args.job not in registry:
        return _fail(f"unknown job {args.job!r}; known: {', '.join(registry)}", EXIT_USAGE)
    async with _connection(settings) as conn:
        was = await pause.resume(conn, settings.db_schema, args.job)
    if args.json:
        _print_json({"job": args.job, "paused": None, "was_paused": was})
    else:
        print(f"{args.job}: resumed" if was else f"{args.job}: was not paused")
    return EXIT_OK


async def cmd_outbox_dead(args: argparse.Namespace, settings: Settings) -> int:
    from cronlock.delivery import outbox

    async with _connection(settings) as conn:
        rows = await outbox.dead_rows(conn, schema=settings.db_schema, limit=args.limit)
    if args.json:
        _print_json({"dead": [r.as_json() for r in rows]})
        return EXIT_OK
    if not rows:
        print("no dead emails")
        return EXIT_OK
    # BATCH: the batch the email was last sent in (EMAIL_BATCH_SIZE > 1), "-" if none.
    table = [
        [
            r.id,
            r.job,
            _when(r.slot),
            r.recipient,
            r.attempts,
            "-" if r.batch_id is None else r.batch_id,
            (r.last_error or "")[:60],
        ]
        for r in rows
    ]
    headers = ["ID", "JOB", "SLOT", "RECIPIENT", "ATTEMPTS", "BATCH", "LAST ERROR"]
    print(_table(headers, table))
    return EXIT_OK


async def cmd_outbox_drain(args: argparse.Namespace, settings: Settings) -> int:
    from cronlock.delivery import sender

    settings.check_email()
    with _translated():
        await sender.run_sender(settings, once=args.once)
    return EXIT_OK


async def cmd_outbox_requeue(args: argparse.Namespace, settings: Settings) -> int:
    from cronlock.delivery import outbox

    if bool(args.ids) == bool(args.all):
        return _fail("give outbox ids, or --all", EXIT_USAGE)
    async with _connection(settings) as conn:
        done = await outbox.requeue(
            conn,
            "all" if args.all else args.ids,
            schema=settings.db_schema,
            retry_window=settings.outbox_retry_window,
        )
    if args.json:
        _print_json({"requeued": [r.as_json() for r in done]})
    else:
        for r in done:
            if r.batch_id is not None:
                print(f"requeued {r.id} in its batch {r.batch_id} (the batch's key, unchanged)")
                continue
            key = "a new idempotency key" if r.new_key else "its idempotency key"
            print(f"requeued {r.id} with {key} {r.idempotency_key}")
        missing = sorted(set(args.ids) - {r.id for r in done})
        if missing:
            print(f"not dead (left alone): {', '.join(map(str, missing))}", file=sys.stderr)
    return EXIT_OK


def cmd_schedule_export(args: argparse.Namespace, settings: Settings) -> int:
    from cronlock.ops.export import ExportError, export

    registry = _load_registry(settings)
    try:
        text, notes = export(
            registry,
            args.format,
            url=args.url,
            header_file=args.header_file,
            secret_name=args.secret_name,
            image=args.image,
        )
    except ExportError as exc:
        return _fail(str(exc), EXIT_USAGE)
    if args.output is not None:
        try:
            args.output.write_text(text)
        except OSError as exc:
            return _fail(f"cannot write {args.output}: {exc.strerror or exc}", EXIT_USAGE)
    else:
        sys.stdout.write(text)
    for note in notes:
        print(f"cronlock: {note}", file=sys.stderr)
    return EXIT_OK


async def cmd_catch_up(args: argparse.Namespace, settings: Settings) -> int:
    from cronlock.core import catchup
    from cronlock.core.outcome import answer

    registry = _load_registry(settings)
    async with _runner(settings, registry) as runner:
        outcomes = await catchup.catch_up(runner)
    bodies = [answer(o)[1] for o in outcomes]
    if args.json:
        print(json.dumps({"caught_up": bodies}))
    elif not bodies:
        print("nothing to catch up")
    else:
        for body in bodies:
            print(" ".join(f"{k}={v}" for k, v in body.items()))
    failed = [o for o in outcomes if o.kind not in ("succeeded", "skipped")]
    return EXIT_FAILED if failed else EXIT_OK
