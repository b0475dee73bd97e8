"""`serve`: the HTTP service, on the embedded PostgreSQL when DATABASE_URL is not set, with a
generated secret when none is."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import secrets
import signal
from pathlib import Path
from typing import Any

import asyncpg

from cronlock import inputs
from cronlock.cli.common import EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE, fail, translated
from cronlock.cli.embedded import DataDirBusy, LocalPostgres, PostgresError, SetupError
from cronlock.db.schema import migrate, migration_sets
from cronlock.settings import Settings


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
                return fail(f"embedded PostgreSQL: {_one_line(exc)}", EXIT_USAGE)
            except DataDirBusy as exc:  # another serve's server: its log is not ours to name
                return fail(f"embedded PostgreSQL: {_one_line(exc)}", EXIT_UNAVAILABLE)
            except PostgresError as exc:
                log = embedded.log_path
                return fail(f"embedded PostgreSQL: {_one_line(exc)} (log: {log})", EXIT_UNAVAILABLE)
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
    data = settings.embedded_pg_dir.resolve()
    return LocalPostgres(data, password_file=data.parent / f"{data.name}.pgpass")


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
    print(
        f"cronlock: DATABASE_URL is not set; using the embedded PostgreSQL in "
        f"{settings.embedded_pg_dir} ({server.dsn('cronlock')})"
    )
    with translated():  # a server going away meanwhile is the database's trouble (exit 3)
        url: str = asyncio.run(_prepare_embedded(server, admin, demo_users, settings))
    return url


async def _prepare_embedded(server: Any, admin: str, demo_users: int, settings: Settings) -> str:
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
