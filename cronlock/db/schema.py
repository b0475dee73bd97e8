"""cronlock's schema in somebody else's database: the numbered migrations that build it
(cronlock's own, and those job modules bring).

Every object cronlock creates lives in one schema, `DB_SCHEMA` (default `cronlock`), and every
statement names it (cronlock/sql.py, which also says what a schema's name may be).

Migrations are plain `.sql` files named `NNNN_name.sql`, each applied in its own transaction
that first takes the migration lock (a transaction-level advisory lock, taken again in every
transaction: a session lock is not safe behind PgBouncer) and then checks, under that lock,
that nobody applied it meanwhile. They are recorded per module in `{schema}.migrations`.
cronlock's own come first, then each job module's in CRON_JOBS order.
"""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Literal

import asyncpg

from cronlock.db.lock import internal_lock, ms_setting
from cronlock.errors import CONNECTION_ERRORS, CronlockError
from cronlock.sql import Conn, qualify, quote

log = logging.getLogger("cronlock.schema")

DEFAULT_SCHEMA = "cronlock"
# cronlock's own migrations are recorded under this module name.
CRONLOCK = "cronlock"
# A job module that brings migrations names their folder (relative to the module's package)
# in this attribute, e.g. `CRONLOCK_MIGRATIONS = "migrations"`.
MODULE_ATTRIBUTE = "CRONLOCK_MIGRATIONS"

FILE_PATTERN = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


class MigrationError(CronlockError):
    """A migration cannot be applied (or the schema cannot be read): one line that names the
    migration, the object and the cause. `migrate` exits 3; `/readyz` answers 503 with it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def notify_channel(schema: str) -> str:
    """The outbox's NOTIFY channel: channels belong to the whole database, so two deployments
    with different schemas must not share one."""
    return f"{schema}.outbox"


# --- migration files ------------------------------------------------------------------------


@dataclass(frozen=True)
class Migration:
    module: str
    version: int
    name: str
    sql: str  # with the `{schema}` placeholder

    @property
    def label(self) -> str:
        return f"{self.module} {self.version:04d}_{self.name}"


@dataclass(frozen=True)
class MigrationSet:
    """The migrations of one module, in order."""

    module: str
    migrations: tuple[Migration, ...]

    @property
    def latest(self) -> int:
        return self.migrations[-1].version if self.migrations else 0


def read_folder(module: str, folder: Traversable) -> MigrationSet:
    """The `NNNN_name.sql` files of a folder; anything else there is a mistake worth a word."""
    found: list[Migration] = []
    for entry in folder.iterdir():
        if not entry.name.endswith(".sql"):
            continue
        match = FILE_PATTERN.match(entry.name)
        if match is None:
            raise MigrationError(
                f"migrations of {module}: {entry.name!r} is not named NNNN_name.sql"
            )
        found.append(Migration(module, int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise MigrationError(f"migrations of {module}: two files share a number")
    return MigrationSet(module, tuple(found))


def cronlock_migrations() -> MigrationSet:
    return read_folder(CRONLOCK, resources.files("cronlock.db") / "migrations")


def module_migrations(module: str) -> MigrationSet | None:
    """The migrations a job module declares (its CRONLOCK_MIGRATIONS folder), if any."""
    imported = importlib.import_module(module)
    folder = getattr(imported, MODULE_ATTRIBUTE, None)
    if folder is None:
        return None
    package = imported.__package__ or module
    if not imported.__spec__ or imported.__spec__.submodule_search_locations is None:
        # A plain module: its folder is beside it, in its package.
        package = module.rpartition(".")[0] or module
    return read_folder(module, resources.files(package) / str(folder))


def migration_sets(modules: Sequence[str]) -> list[MigrationSet]:
    """cronlock's migrations, then those of each job module (CRON_JOBS order) that has some."""
    sets = [cronlock_migrations()]
    for module in modules:
        found = module_migrations(module)
        if found is not None and found.migrations:
            sets.append(found)
    return sets


# --- applying them --------------------------------------------------------------------------


# Every deployment's migrations serialise on one lock of its own, derived from the schema
# (advisory locks belong to the whole database; see cronlock/db/lock.py).
def migrate_lock(schema: str) -> str:
    return internal_lock(schema, "migrate")


LOCK_SQL = "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))"
# A DDL statement waiting for a lock the application holds would queue every later query on
# that table behind it: give up after the setting instead (the migration is retried later).
LOCK_TIMEOUT_SQL = "SELECT set_config('lock_timeout', $1, true)"
SCHEMA_EXISTS_SQL = "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1)"
# From the catalog, not to_regclass: that fails on a schema the role may not use (public,
# for a least-privileged role), where the catalog can always be read.
TABLE_EXISTS_SQL = """
SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_class c
               JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
               WHERE n.nspname = $1 AND c.relname = $2)
"""
CREATE_SCHEMA_SQL = "CREATE SCHEMA {schema}"
CREATE_TABLE_SQL = """CREATE TABLE IF NOT EXISTS {schema}.migrations (
    module     text        NOT NULL,
    version    integer     NOT NULL,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (module, version)
)"""
APPLIED_SQL = "SELECT module, version, name FROM {schema}.migrations"
# Job modules that moved when the library became the `cronlock` package (0.1 was `app`): a
# database migrated by 0.1 recorded their migrations under the old name, which still counts.
MOVED_MODULES = {
    "app.demo.digest": "cronlock.demo.digest",
    "app.demo.chunked": "cronlock.demo.chunked",
    "app.housekeeping": "cronlock.housekeeping",
}
RECORD_SQL = "INSERT INTO {schema}.migrations (module, version, name) VALUES ($1, $2, $3)"

# The layout of cronlock 0.1: everything in `public`, history in `public.cronlock_migrations`.
LEGACY_TABLE = ("public", "cronlock_migrations")
LEGACY_VERSIONS_SQL = "SELECT version FROM public.cronlock_migrations"
# 0.1's migrations 1-3 made the tables that cronlock's 0001 and 0002 make now.
LEGACY_REQUIRED = frozenset({1, 2, 3})
LEGACY_ADOPTS = ((1, "ledger"), (2, "outbox"))


def adopt_sql() -> str:
    return (
        resources.files("cronlock.db") / "migrations" / "upgrade" / "from_public.sql"
    ).read_text(encoding="utf-8")


@dataclass(frozen=True)
class Status:
    """What the database has, against what this code ships."""

    pending: list[Migration]
    # Applied versions this code does not know (a newer instance migrated first): served on.
    newer: list[str]
    # cronlock 0.1's tables in `public`, to be moved into the schema first.
    legacy: bool = False

    @property
    def note(self) -> str | None:
        if not self.newer:
            return None
        return (
            "the database carries migrations newer than this code ("
            + ", ".join(self.newer)
            + "): serving on, as a rolling deploy expects"
        )


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncpg.PostgresError):
        # The server's message names the object ('relation "users" already exists',
        # 'permission denied for schema public'); the SQLSTATE says the kind.
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"{message} (SQLSTATE {exc.sqlstate})"
    return f"{type(exc).__name__}: {exc}"


async def status(conn: Conn, schema: str, sets: Sequence[MigrationSet]) -> Status:
    """Which migrations are pending, and which applied ones are newer than this code."""
    applied: set[tuple[str, int]] = set()
    if await conn.fetchval(TABLE_EXISTS_SQL, schema, "migrations"):
        rows = await conn.fetch(qualify(APPLIED_SQL, schema))
        names = {
            (MOVED_MODULES.get(r["module"], r["module"]), r["version"]): r["name"] for r in rows
        }
        applied = set(names)
    else:
        names = {}
    legacy = not applied and bool(await conn.fetchval(TABLE_EXISTS_SQL, *LEGACY_TABLE))
    pending = [m for s in sets for m in s.migrations if (m.module, m.version) not in applied]
    if legacy:
        adopted = {v for v, _ in LEGACY_ADOPTS}
        pending = [m for m in pending if m.module != CRONLOCK or m.version not in adopted]
    newer = sorted(
        f"{module} {version:04d}_{names[(module, version)]}"
        for module, version in applied
        for s in sets
        if s.module == module and version > s.latest
    )
    return Status(pending, newer, legacy)


StepKind = Literal["schema", "table", "adopt", "migration"]


@dataclass(frozen=True)
class Step:
    """One transaction of a migration run, as `migrate --sql` prints it."""

    kind: StepKind
    label: str
    sql: str
    record: Migration | None = None  # recorded in `{schema}.migrations` when it commits

    def records(self) -> list[tuple[str, int, str]]:
        """The (module, version, name) rows this step writes into `{schema}.migrations`."""
        if self.record is not None:
            return [(self.record.module, self.record.version, self.record.name)]
        if self.kind == "adopt":
            return [(CRONLOCK, version, name) for version, name in LEGACY_ADOPTS]
        return []


async def plan(conn: Conn, schema: str, sets: Sequence[MigrationSet]) -> list[Step]:
    """The transactions `migrate` would run now, in order."""
    found = await status(conn, schema, sets)
    steps: list[Step] = []
    if not await conn.fetchval(SCHEMA_EXISTS_SQL, schema):
        steps.append(Step("schema", f"create schema {schema}", qualify(CREATE_SCHEMA_SQL, schema)))
    if not await conn.fetchval(TABLE_EXISTS_SQL, schema, "migrations"):
        steps.append(Step("table", "create table migrations", qualify(CREATE_TABLE_SQL, schema)))
    if found.legacy:
        versions = {r["version"] for r in await conn.fetch(LEGACY_VERSIONS_SQL)}
        if not versions >= LEGACY_REQUIRED:
            raise MigrationError(
                "upgrade from the public schema: public.cronlock_migrations records versions "
                f"{sorted(versions)}; apply cronlock 0.1's migrations 1-3 first"
            )
        steps.append(
            Step("adopt", "move cronlock 0.1's tables from public", qualify(adopt_sql(), schema))
        )
    steps.extend(Step("migration", m.label, qualify(m.sql, schema), m) for m in found.pending)
    return steps


def script(schema: str, steps: Sequence[Step], lock_timeout: float) -> str:
    """The steps as one psql script a DBA can review and apply by hand (`migrate --sql`)."""
    out = [
        f"-- cronlock migrations for schema {schema}, as `python -m cronlock migrate` applies",
        "-- them: each in its own transaction, after the migration lock. Apply with psql -1 -f",
        "-- or as it is; running it twice fails on the first object that exists.",
    ]
    for step in steps:
        out += ["", f"-- {step.label}", "BEGIN;"]
        out.append(f"SELECT pg_advisory_xact_lock(hashtextextended('{migrate_lock(schema)}', 0));")
        out.append(f"SET LOCAL lock_timeout = '{ms_setting(lock_timeout)}';")
        out.append(step.sql.strip().rstrip(";") + ";")
        out += [
            f"INSERT INTO {quote(schema)}.migrations (module, version, name) "
            f"VALUES ('{module}', {version}, '{name}');"
            for module, version, name in step.records()
        ]
        out.append("COMMIT;")
    return "\n".join(out) + "\n"


async def migrate(
    conn: Conn,
    schema: str,
    sets: Sequence[MigrationSet],
    *,
    lock_timeout: float = 10.0,
) -> list[str]:
    """Apply what is pending, each migration in its own transaction under the migration lock;
    returns the labels applied. N instances booting together migrate once: the others wait
    for the lock, then find each migration recorded. Failures raise MigrationError."""
    try:
        steps = await plan(conn, schema, sets)
    except CONNECTION_ERRORS:
        raise
    except asyncpg.PostgresError as exc:
        raise MigrationError(f"reading schema {schema} failed: {_describe(exc)}") from exc
    applied: list[str] = []
    for step in steps:
        try:
            async with conn.transaction():
                await conn.execute(LOCK_SQL, migrate_lock(schema))
                await conn.execute(LOCK_TIMEOUT_SQL, ms_setting(lock_timeout))
                if not await _still_needed(conn, schema, step):
                    continue
                await conn.execute(step.sql)
                for record in step.records():
                    await conn.execute(qualify(RECORD_SQL, schema), *record)
        except CONNECTION_ERRORS:
            raise  # the database went away, not the migration's fault: retried as an outage
        except asyncpg.PostgresError as exc:
            raise MigrationError(f"migration {step.label} failed: {_describe(exc)}") from exc
        applied.append(step.label)
        log.info("applied migration %s", step.label)
    return applied


DONE_SQL = """
SELECT EXISTS (SELECT 1 FROM {schema}.migrations WHERE module = $1 AND version = $2)
"""


async def _still_needed(conn: Conn, schema: str, step: Step) -> bool:
    """Under the lock: has another instance done this step since it was planned?"""
    if step.kind == "schema":
        return not await conn.fetchval(SCHEMA_EXISTS_SQL, schema)
    if step.kind == "table":
        return not await conn.fetchval(TABLE_EXISTS_SQL, schema, "migrations")
    if step.kind == "adopt":
        return bool(await conn.fetchval(TABLE_EXISTS_SQL, "public", "cron_runs"))
    assert step.record is not None
    m = step.record
    return not await conn.fetchval(qualify(DONE_SQL, schema), m.module, m.version)
