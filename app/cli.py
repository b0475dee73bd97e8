"""The command line: `python -m app <command>`.

Exit codes scripts can rely on: 0 ran or skipped, 1 the job failed or timed out, 2 bad usage
or configuration, 3 the database is unavailable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
from collections.abc import Callable, Coroutine, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from app.settings import Settings, SettingsError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3

Command = Callable[[argparse.Namespace], Coroutine[Any, Any, int] | int]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Command | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        result = handler(args)
        if asyncio.iscoroutine(result):
            return asyncio.run(result)
        assert isinstance(result, int)
        return result
    except SettingsError as exc:
        print(f"cronlock: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m app", description=__doc__)
    sub = parser.add_subparsers(metavar="command")

    serve = sub.add_parser("serve", help="run the HTTP service (embedded PostgreSQL if needed)")
    serve.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
    serve.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
    serve.add_argument(
        "--demo-users",
        type=int,
        default=3,
        help="users to create in a new embedded database (default 3)",
    )
    serve.set_defaults(handler=cmd_serve)

    migrate = sub.add_parser("migrate", help="apply pending migrations and exit")
    migrate.set_defaults(handler=cmd_migrate)

    run = sub.add_parser("run", help="run a job now, through the same lock/slot/ledger path")
    run.add_argument("job")
    run.add_argument("--force", action="store_true", help="run even if the slot is done")
    run.add_argument("--slot", type=datetime.fromisoformat, help="backfill this past tick")
    run.add_argument("--params", default=None, help="the job's params as JSON")
    run.add_argument("--json", action="store_true", help="print JSON")
    run.set_defaults(handler=cmd_run)

    return parser


# --- serve ------------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    settings = Settings()
    embedded = None
    if not settings.database_url:
        embedded, url = start_embedded(settings, args.demo_users)
        os.environ["DATABASE_URL"] = url
    if not settings.secrets():
        path = generate_secret(Path("var"))
        os.environ["CRON_SECRET_FILE"] = str(path)
        header = path.with_name("cron_auth_header")
        print(f"cronlock: no CRON_SECRET set; generated one into {path} (mode 0600)")
        print(
            "cronlock: trigger the demo job with:\n"
            f"  curl -X POST -H @{header} http://{args.host}:{args.port}/cron/daily-digest"
        )
    settings = Settings()
    settings.check_secrets()
    try:
        uvicorn.run(
            "app.main:create_app",
            factory=True,
            host=args.host,
            port=args.port,
            access_log=False,
            # uvicorn waits for ever for requests in flight by default; a job still running
            # after this long is cancelled and rolled back.
            timeout_graceful_shutdown=max(1, round(settings.graceful_shutdown_timeout)),
        )
    finally:
        if embedded is not None:
            embedded.stop()
    return EXIT_OK


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


def start_embedded(settings: Settings, demo_users: int) -> tuple[Any, str]:
    """Start (or reuse) the local PostgreSQL in EMBEDDED_PG_DIR; returns it and the app's URL."""
    from app.embedded import LocalPostgres

    server = LocalPostgres(settings.embedded_pg_dir.resolve())
    admin = server.start()
    print(
        f"cronlock: DATABASE_URL is not set; using the embedded PostgreSQL in "
        f"{settings.embedded_pg_dir} ({admin})"
    )
    url = asyncio.run(_prepare_embedded(server, admin, demo_users))
    return server, url


async def _prepare_embedded(server: Any, admin: str, demo_users: int) -> str:
    import asyncpg

    from app.db import migrate

    conn = await asyncpg.connect(admin)
    try:
        if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = 'cronlock'"):
            await conn.execute("CREATE DATABASE cronlock")
    finally:
        await conn.close()
    url: str = server.dsn("cronlock")
    conn = await asyncpg.connect(url)
    try:
        await migrate(conn)
        if demo_users and not await conn.fetchval("SELECT count(*) FROM users"):
            await conn.execute(
                "INSERT INTO users (email) SELECT 'user' || g || '@example.com' "
                "FROM generate_series(1, $1) g",
                demo_users,
            )
    finally:
        await conn.close()
    return url


# --- migrate, run -------------------------------------------------------------------------------


async def cmd_migrate(args: argparse.Namespace) -> int:
    from app.db import connect, migrate
    from app.errors import DatabaseUnavailable

    settings = Settings()
    try:
        conn = await connect(settings)
    except DatabaseUnavailable as exc:
        print(f"cronlock: database unavailable: {exc.reason}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    try:
        applied = await migrate(conn)
    finally:
        await conn.close()
    print("applied: " + ", ".join(applied) if applied else "migrations are current")
    return EXIT_OK


async def cmd_run(args: argparse.Namespace) -> int:
    from app.api import parse_params
    from app.db import Database
    from app.errors import DatabaseUnavailable, InvalidTrigger
    from app.jobs import load
    from app.runner import Runner

    settings = Settings()
    registry = load(settings.job_modules, settings.lock_namespace)
    if args.job not in registry:
        print(f"cronlock: unknown job {args.job!r}; known: {', '.join(registry)}", file=sys.stderr)
        return EXIT_USAGE
    job = registry[args.job]
    db = Database(settings)
    await db.open()
    try:
        params = parse_params(job, (args.params or "").encode())
        await db.check(apply_migrations=False)
        outcome = await Runner(settings, registry, db).trigger(
            job, force=args.force, slot=args.slot, params=params, source="cli"
        )
    except InvalidTrigger as exc:
        print(f"cronlock: invalid trigger: {exc.args[0]}", file=sys.stderr)
        return EXIT_USAGE
    except DatabaseUnavailable as exc:
        print(f"cronlock: database unavailable: {exc.reason}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    finally:
        await db.close()
    from app.api import outcome_response

    body = json.loads(bytes(outcome_response(outcome).body))
    if args.json:
        print(json.dumps(body))
    else:
        print(" ".join(f"{k}={v}" for k, v in body.items()))
    return EXIT_OK if outcome.kind in ("succeeded", "skipped") else EXIT_FAILED
