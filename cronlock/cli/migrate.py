"""`migrate`: apply the pending migrations, or show them (`--dry-run`, `--sql` for a DBA)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from typing import Any

import asyncpg

from cronlock.cli.common import EXIT_OK, EXIT_USAGE, fail, translated
from cronlock.db import schema
from cronlock.db.pool import connect
from cronlock.errors import DRIVER_ERRORS, CronlockError
from cronlock.settings import Settings

# The other databases of the server that this role may connect to, where a ledger may be.
OTHER_DATABASES_SQL = """
SELECT datname FROM pg_catalog.pg_database
WHERE datallowconn AND NOT datistemplate AND datname <> pg_catalog.current_database()
  AND pg_catalog.has_database_privilege(datname, 'CONNECT')
ORDER BY datname
LIMIT $1
"""
SCHEMA_EXISTS_SQL = "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1)"
# A server holding more databases than this is not looked through whole: the check is a
# courtesy against a wrong URL, not an inventory.
MAX_DATABASES = 50
PASSED_OVER: tuple[type[BaseException], ...] = (CronlockError, *DRIVER_ERRORS)


def add_commands(sub: Any) -> None:
    migrate = sub.add_parser("migrate", help="apply pending migrations and exit")
    shown = migrate.add_mutually_exclusive_group()
    shown.add_argument(
        "--dry-run", action="store_true", help="list what would be applied; change nothing"
    )
    shown.add_argument(
        "--sql", action="store_true", help="print the SQL that would be applied, for a DBA"
    )
    migrate.add_argument(
        "--yes",
        action="store_true",
        help="create cronlock's schema in this database even though another database of the "
        "same server has one (a second, separate ledger); asked for on a terminal otherwise",
    )
    migrate.set_defaults(handler=cmd_migrate)


async def cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    sets = schema.migration_sets(settings.job_modules)
    conn = await connect(settings)
    try:
        with translated():
            here = await _empty_here(conn, settings, sets)
            # Only when the question will be asked (a dry run or --sql shows it, --yes has
            # answered it): each look is a connection to that database, which a pooler may
            # keep open.
            asks = not args.yes or args.dry_run or args.sql
            look = here is not None and asks
            elsewhere = await ledgers_elsewhere(conn, settings) if look else []
            warning = None
            if here is not None and elsewhere:
                others = ", ".join(elsewhere)
                if len(elsewhere) == 1:
                    others = f"database {others} of the same server has one"
                else:
                    others = f"databases {others} of the same server have one"
                warning = (
                    f"database {here} has no cronlock schema ({settings.db_schema}) but "
                    f"{others}: DATABASE_URL may name the wrong database"
                )
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
                asked = warning is not None and here is not None and not args.yes
                if asked and not await _confirmed(f"{warning}. Create a second ledger in {here}?"):
                    return fail(
                        f"{warning}; point DATABASE_URL at the right one, or pass --yes to "
                        f"create a second ledger in {here}",
                        EXIT_USAGE,
                    )
                applied = await schema.migrate(
                    conn, settings.db_schema, sets, lock_timeout=settings.migrate_lock_timeout
                )
                found = await schema.status(conn, settings.db_schema, sets)
                out = "applied: " + ", ".join(applied) if applied else "migrations are current"
                out += "\n"
    finally:
        await conn.close()
    print(out, end="")
    if warning is not None and (args.dry_run or args.sql):
        print(f"note: {warning}", file=sys.stderr)
    if found.note:
        print(f"note: {found.note}", file=sys.stderr)
    return EXIT_OK


async def _empty_here(
    conn: asyncpg.Connection, settings: Settings, sets: list[schema.MigrationSet]
) -> str | None:
    """This database's name if it holds no cronlock objects at all (no schema, no 0.1 tables
    to move), else None."""
    if await conn.fetchval(SCHEMA_EXISTS_SQL, settings.db_schema):
        return None
    if (await schema.status(conn, settings.db_schema, sets)).legacy:
        return None
    name: str = await conn.fetchval("SELECT pg_catalog.current_database()")
    return name


async def ledgers_elsewhere(conn: asyncpg.Connection, settings: Settings) -> list[str]:
    """The other databases of this server whose cronlock schema has its migrations table.
    One this role cannot enter (or a pooler does not route) is passed over, not an error.

    Through DATABASE_DIRECT_URL when it is set: a connection PgBouncer makes for a look at a
    database stays in its pool afterwards (server_idle_timeout), and while it does, that
    database cannot be dropped or copied as a template."""
    found = []
    for row in await conn.fetch(OTHER_DATABASES_SQL, MAX_DATABASES):
        try:
            other = await connect(settings, settings.database_direct_url, database=row["datname"])
        except PASSED_OVER:
            continue
        try:
            if await other.fetchval(schema.TABLE_EXISTS_SQL, settings.db_schema, "migrations"):
                found.append(row["datname"])
        except DRIVER_ERRORS:
            continue
        finally:
            with contextlib.suppress(Exception):
                await other.close()
    return found


async def _confirmed(question: str) -> bool:
    """On a terminal, ask; elsewhere (a script, CI) never assume a yes."""
    if not sys.stdin.isatty():
        return False
    answer = await asyncio.to_thread(input, f"cronlock: {question} [y/N] ")
    return answer.strip().lower() in ("y", "yes")
