"""`migrate`: apply the pending migrations, or show them (`--dry-run`, `--sql` for a DBA)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from cronlock.cli.common import EXIT_OK, translated
from cronlock.db import schema
from cronlock.db.pool import connect
from cronlock.settings import Settings


def add_commands(sub: Any) -> None:
    migrate = sub.add_parser("migrate", help="apply pending migrations and exit")
    shown = migrate.add_mutually_exclusive_group()
    shown.add_argument(
        "--dry-run", action="store_true", help="list what would be applied; change nothing"
    )
    shown.add_argument(
        "--sql", action="store_true", help="print the SQL that would be applied, for a DBA"
    )
    migrate.set_defaults(handler=cmd_migrate)


async def cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    sets = schema.migration_sets(settings.job_modules)
    conn = await connect(settings)
    try:
        with translated():
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
