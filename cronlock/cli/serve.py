"""`serve`: the HTTP service, on the embedded PostgreSQL when DATABASE_URL is not set, with a
generated secret when none is."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import secrets
import signal
import socket
from pathlib import Path
from typing import Any

import asyncpg
from pydantic import ValidationError

from cronlock import inputs
from cronlock.cli.common import (
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    fail,
    load_registry,
    translated,
)
from cronlock.cli.embedded import DataDirBusy, LocalPostgres, PostgresError, SetupError
from cronlock.core.jobs import Registry
from cronlock.db.schema import migrate, migration_sets
from cronlock.settings import Settings

# The database `serve` makes in the embedded server for cronlock's objects (and the demo's).
EMBEDDED_DATABASE = "cronlock"
# The curl line's job: the demo's digest when served, never a housekeeping job.
DEMO_JOB = "daily-digest"
HOUSEKEEPING = "cronlock.housekeeping"


def add_commands(sub: Any) -> None:
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


def cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    import uvicorn

    # Before anything starts: a SIGTERM while the embedded server starts (initdb, migrations)
    # must reach the `finally` below too, not kill us and leave the postmaster running in its
    # own session. uvicorn re-raises SIGTERM once it has shut down; as an exception rather
    # than the default action, that also lets the `finally` stop the embedded PostgreSQL.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    secret: tuple[Path, bool] | None = None
    if not settings.secrets():
        secret = generate_secret(Path("var"))
        os.environ["CRON_SECRET_FILE"] = str(secret[0])
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
    registry = load_registry(settings)
    # The port before the database, and every hint after both: a second `serve` (same port or
    # same EMBEDDED_PG_DIR) refuses before it prints a curl line that would reach the first.
    try:
        listener = listen(args.host, args.port)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        return fail(f"cannot listen on {args.host}:{args.port}: {reason}", EXIT_UNAVAILABLE)
    embedded = None
    try:
        if not settings.database_url:
            embedded = embedded_server(settings)
            try:
                os.environ["DATABASE_URL"] = start_embedded(embedded, settings, args.demo_users)
            except SetupError as exc:
                return fail(f"embedded PostgreSQL: {_one_line(exc)}", EXIT_USAGE)
            except DataDirBusy as exc:  # another serve's server: its log is not ours to name
                return fail(f"embedded PostgreSQL: {_one_line(exc)}", EXIT_UNAVAILABLE)
            except PostgresError as exc:
                log = embedded.log_path
                return fail(f"embedded PostgreSQL: {_one_line(exc)} (log: {log})", EXIT_UNAVAILABLE)
        base = f"http://{_url_host(args.host)}:{listener.getsockname()[1]}"
        for line in hints(settings, registry, secret, base):
            print(f"cronlock: {line}")
        config = uvicorn.Config(
            "cronlock.service:create_app",
            factory=True,
            host=args.host,
            port=listener.getsockname()[1],
            access_log=False,
            # uvicorn waits for ever for requests in flight by default; a job still running
            # after this long is cancelled and rolled back. uvicorn takes whole seconds:
            # rounding up never cuts the setting short.
            timeout_graceful_shutdown=math.ceil(settings.graceful_shutdown_timeout),
        )
        server = uvicorn.Server(config)
        with contextlib.suppress(KeyboardInterrupt):  # as uvicorn.run: Ctrl-C is a normal stop
            server.run(sockets=[listener])
        if not server.started:  # the app refused to start; uvicorn logged why
            return EXIT_UNAVAILABLE
    finally:
        listener.close()
        # Only a server this process started: one it found running belongs to someone else
        # (stop() itself signals only a postmaster that is this process's child, so a SIGTERM
        # landing between the spawn and `spawned` being known leaves nothing either).
        if embedded is not None:
            embedded.stop()
    return EXIT_OK


def listen(host: str, port: int) -> socket.socket:
    """The service's listening socket, bound as uvicorn binds its own (SO_REUSEADDR) and
    listening at once: connections made while the database starts wait in the backlog."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)  # uvicorn's default backlog
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def hints(
    settings: Settings, registry: Registry, secret: tuple[Path, bool] | None, base: str
) -> list[str]:
    """What `serve` tells a newcomer once it is sure to serve: where the secret is (made now or
    reused), a curl line for a job this service has, the dashboard. Each only when true."""
    lines = []
    if secret is not None:
        path, created = secret
        if created:
            lines.append(f"no CRON_SECRET set; generated one into {path} (mode 0600)")
        else:
            lines.append(f"no CRON_SECRET set; using {path}")
        job = curl_job(registry)
        if job is not None:
            header = path.with_name("cron_auth_header")
            lines.append(f"trigger {job} with:\n  curl -X POST -H @{header} {base}/cron/{job}")
    if settings.ui_enabled:
        secure = "" if settings.ui_cookie_secure else " (cookie without Secure: loopback http)"
        token = settings.cron_secret_file or "CRON_SECRET"
        lines.append(f"dashboard at {base}/ui/, log in with the token in {token}{secure}")
    return lines


def curl_job(registry: Registry) -> str | None:
    """The job a curl line shows: the demo's digest when it is served, else the first job
    (not housekeeping) that a bare POST runs: no key, no required params. None if no job is."""
    if DEMO_JOB in registry:
        return DEMO_JOB
    for name, job in registry.items():
        if job.module == HOUSEKEEPING or job.key is not None:
            continue
        if job.params is not None:
            try:
                job.params.model_validate({})
            except ValidationError:
                continue
        return name
    return None


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


def generate_secret(folder: Path) -> tuple[Path, bool]:
    """A random secret in a file only this user can read, plus a curl header file (`curl -H
    @file`), so the secret never appears in a process's argv. Returns the file and whether it
    was made now (False: an earlier `serve` made it, and it is used again)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "cron_secret"
    created = not path.exists()
    if created:
        token = secrets.token_urlsafe(32)
        _write_private(path, token + "\n")
    token = path.read_text().strip()
    _write_private(folder / "cron_auth_header", f"Authorization: Bearer {token}\n")
    return path, created


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    path.chmod(0o600)


def embedded_server(settings: Settings, port: int | None = None) -> LocalPostgres:
    """The server of EMBEDDED_PG_DIR, whose superuser's password is in the file beside it,
    `<EMBEDDED_PG_DIR>.pgpass` (`var/pg.pgpass`, mode 0600), made with the server."""
    data = settings.embedded_pg_dir.resolve()
    return LocalPostgres(data, port, password_file=data.parent / f"{data.name}.pgpass")


def running_embedded_url(settings: Settings) -> str | None:
    """The URL of the database `serve` uses in the embedded server of EMBEDDED_PG_DIR, if that
    server runs (the CLI's DATABASE_URL when none is set); it never starts one."""
    port = embedded_server(settings).running_port()
    return None if port is None else embedded_server(settings, port).dsn(EMBEDDED_DATABASE)


def no_database_url(settings: Settings) -> str:
    """What to set, in one line, when the CLI has no DATABASE_URL and no embedded server runs."""
    folder = settings.embedded_pg_dir
    if embedded_server(settings).is_initialised():
        return (
            f"DATABASE_URL is not set and the embedded PostgreSQL in {folder} is not running: "
            "start it with `cronlock serve` in this folder, or set DATABASE_URL"
        )
    return (
        f"DATABASE_URL is not set and there is no embedded PostgreSQL in {folder} "
        "(EMBEDDED_PG_DIR): set DATABASE_URL=postgresql://USER@HOST:PORT/DATABASE, or run "
        "this command in the folder where `cronlock serve` runs"
    )


def start_embedded(server: LocalPostgres, settings: Settings, demo_users: int) -> str:
    """Lock and start (or reuse) the local PostgreSQL in EMBEDDED_PG_DIR; returns the app's URL.

    The lock is held until this process ends: a second `serve` on the same folder is refused
    rather than sharing, or stopping, this one's server.
    """
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
    # The URL of the database cronlock's objects are in (not `postgres`): what the CLI needs.
    print(
        f"cronlock: DATABASE_URL is not set; using the embedded PostgreSQL in "
        f"{settings.embedded_pg_dir}; the CLI in this folder finds it, elsewhere set "
        f"DATABASE_URL={server.dsn(EMBEDDED_DATABASE)}"
    )
    with translated():  # a server going away meanwhile is the database's trouble (exit 3)
        url: str = asyncio.run(_prepare_embedded(server, admin, demo_users, settings))
    return url


async def _prepare_embedded(server: Any, admin: str, demo_users: int, settings: Settings) -> str:
    conn = await asyncpg.connect(admin)
    try:
        found = "SELECT 1 FROM pg_catalog.pg_database WHERE datname = $1"
        if not await conn.fetchval(found, EMBEDDED_DATABASE):
            await conn.execute(f"CREATE DATABASE {EMBEDDED_DATABASE}")
    finally:
        await conn.close()
    url: str = server.dsn(EMBEDDED_DATABASE)
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
