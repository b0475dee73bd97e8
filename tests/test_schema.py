"""cronlock as a guest in somebody else's database: one schema of its own, nothing else touched,
two deployments side by side, an upgrade in place from 0.1's `public` tables, a role without
CREATE, migrations a DBA can review, and errors in one line."""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import httpx
import pytest

from cronlock.cli import main as cli
from cronlock.db.lock import internal_lock, lock_key, lock_text
from cronlock.db.pool import Database
from cronlock.db.schema import (
    Migration,
    MigrationError,
    MigrationSet,
    cronlock_migrations,
    migrate,
    migration_sets,
    notify_channel,
)
from cronlock.delivery import outbox
from cronlock.settings import Settings
from cronlock.sql import check_name, qualify
from tests.support import TEST_SECRET
from tests.support.postgres import unique_name
from tests.support.provider import Provider
from tests.util import post, wait_for

Starter = Callable[..., Any]
REPO = Path(__file__).resolve().parent.parent
LEGACY = Path(__file__).resolve().parent / "data" / "migrations_0_1"
OURS = ("cronlock", "cronlock_demo")


@pytest.fixture
async def fresh(fresh_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(fresh_url, statement_cache_size=0)
    try:
        yield conn
    finally:
        await conn.close()


class Cli:
    """`python -m cronlock` in-process, against one database, with no .env."""

    def __init__(self, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
        self.capsys, self.monkeypatch = capsys, monkeypatch

    def env(self, **values: str) -> None:
        for name, value in values.items():
            self.monkeypatch.setenv(name, value)

    async def __call__(self, *args: str) -> tuple[int, str, str]:
        self.capsys.readouterr()
        if args == ("migrate",):
            # Other databases of the test cluster (the template, other tests') hold ledgers:
            # the question before a second one is tested on its own (test_cli.py).
            args = ("migrate", "--yes")
        code = await asyncio.to_thread(cli.main, list(args))
        out = self.capsys.readouterr()
        return code, out.out, out.err


@pytest.fixture
def run_cli(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Cli:
    monkeypatch.chdir(tmp_path)
    for name in list(os.environ):
        if name.startswith(("CRON_", "DATABASE_", "DB_", "MIGRATE_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("CRON_JOBS", "cronlock.demo.digest,cronlock.housekeeping")
    return Cli(capsys, monkeypatch)


# --- names ------------------------------------------------------------------------------------


def test_the_schema_is_a_plain_identifier_of_our_own() -> None:
    for good in ("cronlock", "jobs_b", "_x", "Tenant_A", "a" * 56):
        assert check_name(good) == good
    for bad in ("", "1abc", "a-b", 'x"; DROP', "a b", "public", "PG_x", "information_schema"):
        with pytest.raises(ValueError, match=r"must start with|not a schema of cronlock's own"):
            check_name(bad)
    with pytest.raises(ValueError, match="at most 56"):
        check_name("a" * 57)  # <schema>.outbox must fit a 63-byte channel name
    with pytest.raises(ValueError, match="db_schema"):
        Settings(_env_file=None, db_schema="public")
    assert qualify("SELECT 1 FROM {schema}.runs", "Tenant_A") == 'SELECT 1 FROM "Tenant_A".runs'


def test_locks_and_channels_belong_to_one_deployment() -> None:
    """Advisory locks and NOTIFY channels are database-wide: each derives from the schema."""
    a, b = lock_text("cronlock", "daily-digest"), lock_text("other", "daily-digest")
    assert lock_key(a, 0) != lock_key(b, 0)
    assert internal_lock("cronlock", "migrate") != internal_lock("other", "migrate")
    # "::" cannot be a job's (job names have no ':'), so no job takes the migration lock.
    assert internal_lock("cronlock", "migrate") != lock_text("cronlock", "migrate")
    assert notify_channel("cronlock") != notify_channel("other")


# --- a real application's database ---------------------------------------------------------

APP_SQL = """
CREATE EXTENSION IF NOT EXISTS pgcrypto;
CREATE TYPE public.plan AS ENUM ('free', 'pro');
CREATE TABLE public.users (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(), email text NOT NULL UNIQUE,
    plan public.plan NOT NULL DEFAULT 'free', created_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE public.runs (id serial PRIMARY KEY, pipeline text, ok boolean);
CREATE TABLE public.jobs (id bigserial PRIMARY KEY, name text, queue text DEFAULT 'default');
CREATE TABLE public.locks (name text PRIMARY KEY, owner uuid REFERENCES public.users (id));
CREATE TABLE public.cron_runs (id int PRIMARY KEY, what text);
CREATE TABLE public.email_outbox (id int PRIMARY KEY, to_address text, sent boolean);
CREATE TABLE public.migrations (id int PRIMARY KEY, name text);
CREATE TABLE public.alembic_version (version_num varchar(32) PRIMARY KEY);
CREATE INDEX jobs_queue ON public.jobs (queue);
CREATE VIEW public.pro_users AS SELECT id, email FROM public.users WHERE plan = 'pro';
CREATE FUNCTION public.probe(x int) RETURNS int LANGUAGE sql AS 'SELECT x';
INSERT INTO public.users (email, plan) SELECT 'app' || g || '@example.com',
    CASE WHEN g % 2 = 0 THEN 'pro' ELSE 'free' END::public.plan FROM generate_series(1, 20) g;
INSERT INTO public.runs (pipeline, ok) VALUES ('etl', true), ('etl', false);
INSERT INTO public.jobs (name) VALUES ('resize'), ('mail');
INSERT INTO public.locks (name, owner) SELECT 'l1', id FROM public.users LIMIT 1;
INSERT INTO public.cron_runs VALUES (1, 'theirs');
INSERT INTO public.email_outbox VALUES (1, 'x@example.com', false);
INSERT INTO public.migrations VALUES (1, 'init');
INSERT INTO public.alembic_version VALUES ('ae1027a6acf');
"""

# The catalog outside cronlock's schemas: what "nothing of the app changed" means.
SNAPSHOT_SQL = {
    "schemas": """SELECT nspname, pg_get_userbyid(nspowner), nspacl::text FROM pg_namespace
                  WHERE nspname <> ALL($1) AND nspname NOT LIKE 'pg_toast%'
                    AND nspname NOT LIKE 'pg_temp%'""",
    "relations": """SELECT n.nspname, c.relname, c.relkind, pg_get_userbyid(c.relowner),
                           c.relacl::text
                    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                    WHERE n.nspname <> ALL($1) AND n.nspname NOT IN ('pg_catalog',
                          'information_schema') AND n.nspname NOT LIKE 'pg_toast%'""",
    "columns": """SELECT n.nspname, c.relname, a.attname, format_type(a.atttypid, a.atttypmod),
                         a.attnotnull, pg_get_expr(d.adbin, d.adrelid)
                  FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
                  JOIN pg_namespace n ON n.oid = c.relnamespace
                  LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
                  WHERE a.attnum > 0 AND NOT a.attisdropped AND n.nspname <> ALL($1)
                    AND n.nspname NOT IN ('pg_catalog', 'information_schema')
                    AND n.nspname NOT LIKE 'pg_toast%'""",
    "types": """SELECT n.nspname, t.typname, t.typtype, pg_get_userbyid(t.typowner),
                       coalesce((SELECT string_agg(e.enumlabel, ',' ORDER BY e.enumsortorder)
                                 FROM pg_enum e WHERE e.enumtypid = t.oid), '')
                FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
                WHERE n.nspname <> ALL($1) AND n.nspname NOT IN ('pg_catalog',
                      'information_schema') AND n.nspname NOT LIKE 'pg_toast%'""",
    "functions": """SELECT n.nspname, p.proname, pg_get_function_identity_arguments(p.oid),
                           md5(p.prosrc), pg_get_userbyid(p.proowner), p.proacl::text
                    FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
                    WHERE n.nspname <> ALL($1)
                      AND n.nspname NOT IN ('pg_catalog', 'information_schema')""",
    "indexes": """SELECT schemaname, indexname, indexdef FROM pg_indexes
                  WHERE schemaname <> ALL($1)
                    AND schemaname NOT IN ('pg_catalog', 'information_schema')""",
    "constraints": """SELECT n.nspname, c.conname, pg_get_constraintdef(c.oid)
                      FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace
                      WHERE n.nspname <> ALL($1)
                        AND n.nspname NOT IN ('pg_catalog', 'information_schema')""",
    "extensions": "SELECT extname, extversion FROM pg_extension WHERE $1::text[] IS NOT NULL",
    "database": """SELECT datname, datacl::text FROM pg_database
                   WHERE datname = current_database() AND $1::text[] IS NOT NULL""",
}
APP_TABLES = ("users", "runs", "jobs", "locks", "cron_runs", "email_outbox", "migrations")


async def snapshot(conn: asyncpg.Connection, ours: tuple[str, ...] = OURS) -> dict[str, Any]:
    """Catalog rows outside `ours`, plus a checksum of every application table's rows."""
    found: dict[str, Any] = {}
    for name, sql in SNAPSHOT_SQL.items():
        found[name] = sorted(tuple(r) for r in await conn.fetch(sql, list(ours)))
    for table in (*APP_TABLES, "alembic_version"):
        found[f"rows:{table}"] = await conn.fetchval(
            f"SELECT md5(coalesce(string_agg(t::text, '|' ORDER BY t::text), '')) "
            f"FROM public.{table} t"
        )
    return found


async def test_an_application_database_is_left_exactly_as_it_was(
    fresh_url: str, fresh: asyncpg.Connection, run_cli: Cli, start_instances: Starter
) -> None:
    """Its own users, runs, email_outbox, migrations... in public: migrate, two instances,
    triggers, the digest, delivery and a ledger prune change nothing of it, and work with no
    search_path at all."""
    await fresh.execute(APP_SQL)
    # Every session of this database starts with an empty search_path: a statement of ours that
    # named a table without its schema would fail (or, with the default path, find the app's).
    dbname = await fresh.fetchval("SELECT current_database()")
    await fresh.execute(f"ALTER DATABASE {dbname} SET search_path TO ''")
    before = await snapshot(fresh)
    run_cli.env(DATABASE_URL=fresh_url)
    code, out, err = await run_cli("migrate")
    assert code == 0, err
    assert "cronlock 0001_ledger" in out
    assert "cronlock.demo.digest 0001_users" in out
    await fresh.execute(
        "INSERT INTO cronlock_demo.users (email) SELECT 'd' || g || '@example.com'"
        " FROM generate_series(1, 25) g"
    )
    env = {
        "DATABASE_URL": fresh_url,
        "CRON_JOBS": "cronlock.demo.digest,cronlock.housekeeping",
        "OUTBOX_ENABLED": "true",
        "EMAIL_BACKEND": "log",
        "OUTBOX_RATE_LIMIT": "0",
        "OUTBOX_POLL_INTERVAL": "0.2",
        "LEDGER_RETENTION_DAYS": "0.00001",
        "BACKFILL_WINDOW": "0.5",  # the ledger must outlive it
    }
    instances = start_instances(["app0", "app1"], env, ready_path="/readyz")
    async with httpx.AsyncClient(timeout=30) as client:
        answers = await asyncio.gather(
            *(post(client, i.url + "/cron/daily-digest") for i in instances)
        )
        assert sorted(a.status_code for a in answers) == [200, 200], [a.text for a in answers]
        assert sum(a.json().get("processed", 0) for a in answers) == 25

        async def delivered() -> bool:
            pending = await fresh.fetchval(
                "SELECT count(*) FROM cronlock.email_outbox WHERE status <> 'sent'"
            )
            return bool(pending == 0)

        await wait_for(delivered, 20, "the digest's emails to be delivered")
        await asyncio.sleep(1.0)  # older than LEDGER_RETENTION_DAYS (0.86 s)
        r = await post(client, instances[1].url + "/cron/ledger-prune?force=true")
        assert r.status_code == 200, r.text
        # The digest's run is gone: pruned by this run or by the catch-up loop's run of the
        # same job (ledger-prune catches up at start-up, whichever comes first).
        digest_runs = "SELECT count(*) FROM cronlock.runs WHERE job = 'daily-digest'"
        assert await fresh.fetchval(digest_runs) == 0
        r = await client.get(
            instances[0].url + "/cron/runs", headers={"Authorization": f"Bearer {TEST_SECRET}"}
        )
        assert r.status_code == 200
    assert await fresh.fetchval("SELECT count(*) FROM cronlock.email_outbox") == 25
    assert await snapshot(fresh) == before


async def test_two_deployments_in_one_database_are_fully_separate(
    database_url: str, db: asyncpg.Connection, start_instance: Starter
) -> None:
    """The same job name at the same moment in two schemas: both run (their lock keys, ledgers,
    migrations and NOTIFY channels are their own)."""
    jobs = "tests.jobs,tests.tenant_jobs"
    a = start_instance("dep-a", {"CRON_JOBS": jobs})
    b = start_instance("dep-b", {"CRON_JOBS": jobs, "DB_SCHEMA": "tenant_b"})
    async with httpx.AsyncClient(timeout=30) as client:
        answers = await asyncio.gather(
            post(client, a.url + "/cron/tenant-visit", json={"seconds": 1.5}),
            post(client, b.url + "/cron/tenant-visit", json={"seconds": 1.5}),
        )
        assert [r.json().get("processed") for r in answers] == [1, 1], [r.text for r in answers]
        fast = await asyncio.gather(
            post(client, a.url + "/cron/fast"), post(client, b.url + "/cron/fast")
        )
        assert [r.json().get("processed") for r in fast] == [1, 1], [r.text for r in fast]
    spans = []
    for schema in ("cronlock", "tenant_b"):
        rows = await db.fetch(
            f"SELECT job, status, started_at, finished_at FROM {schema}.runs ORDER BY id"
        )
        assert [(r["job"], r["status"]) for r in rows] == [
            ("tenant-visit", "succeeded"),
            ("fast", "succeeded"),
        ]
        spans.append((rows[0]["started_at"], rows[0]["finished_at"]))
    # They ran at the same time: neither waited for the other's lock.
    assert max(s for s, _ in spans) < min(f for _, f in spans)
    modules = await db.fetch(
        "SELECT module, version FROM tenant_b.migrations WHERE module <> 'cronlock' ORDER BY 1, 2"
    )
    assert [tuple(r) for r in modules] == [("tests.tenant_jobs", 1), ("tests.tenant_jobs", 2)]
    visitors = await db.fetch("SELECT deployment FROM tenant_jobs.visits ORDER BY deployment")
    assert [r["deployment"] for r in visitors] == ["cronlock", "tenant_b"]
    # The demo's schema is created only by a deployment that loads the demo: tenant_b's did not
    # make one of its own, and nothing of cronlock lives in public.
    assert await db.fetchval("SELECT to_regclass('tenant_b.users')") is None
    public = await db.fetch(
        "SELECT relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = 'public' AND relname NOT LIKE 'job_effects%'"
    )
    assert public == []


# --- upgrade in place from 0.1 ---------------------------------------------------------------

LEGACY_ROWS_SQL = """
INSERT INTO cron_runs (job, slot, status, trigger, source, instance, backend_pid, started_at,
                       finished_at, duration_ms, params, result, error)
VALUES ('daily-digest', '2026-12-01 07:00+00', 'succeeded', 'scheduled', 'http', 'old-1', 11,
        '2026-12-01 07:00:01+00', '2026-12-01 07:00:02+00', 812.5, NULL, '3', NULL),
       ('daily-digest', '2026-12-02 07:00+00', 'failed', 'scheduled', 'http', 'old-2', 12,
        '2026-12-02 07:00:01+00', '2026-12-02 07:00:03+00', 20.0, NULL, NULL, 'boom'),
       ('ledger-prune', NULL, 'abandoned', 'manual', 'cli', 'old-1', NULL,
        '2026-12-02 03:17+00', NULL, NULL, '{"a": 1}', NULL, 'went away');
INSERT INTO users (email, digest_enabled, last_digest_at)
VALUES ('ada@example.com', true, '2026-12-01 07:00:02+00'),
       ('bob@example.com', false, NULL),
       ('cy@example.com', true, NULL);
INSERT INTO email_outbox (idempotency_key, job, slot, user_id, sender, recipient, subject, body,
                          status, attempts, sent_at, provider_message_id, last_error)
VALUES ('daily-digest:1764572400:1', 'daily-digest', '2026-12-01 07:00+00', 1, 's@x',
        'ada@example.com', 'Digest', 'Hello ada', 'sent', 1, now(), 'msg_1', NULL),
       ('daily-digest:1764658800:1', 'daily-digest', '2026-12-02 07:00+00', 1, 's@x',
        'ada@example.com', 'Digest', 'Hello again', 'pending', 0, NULL, NULL, NULL),
       ('daily-digest:1764658800:3', 'daily-digest', '2026-12-02 07:00+00', 3, 's@x',
        'cy@example.com', 'Digest', 'Hello cy', 'dead', 12, NULL, NULL, 'HTTP 422: bad address');
UPDATE email_outbox_rate SET tokens = 1.5, granted = 2;
"""

TABLES_0_1 = {
    "cron_runs": "cronlock.runs",
    "users": "cronlock_demo.users",
    "email_outbox": "cronlock.email_outbox",
    "email_outbox_rate": "cronlock.email_outbox_rate",
}


async def build_0_1(conn: asyncpg.Connection) -> None:
    """A database as cronlock 0.1 left it: its five migrations in public, recorded there."""
    await conn.execute(
        "CREATE TABLE cronlock_migrations (version integer PRIMARY KEY, name text NOT NULL,"
        " applied_at timestamptz NOT NULL DEFAULT now())"
    )
    for path in sorted(LEGACY.glob("*.sql")):
        number, _, name = path.stem.partition("_")
        await conn.execute(path.read_text())
        await conn.execute(
            "INSERT INTO cronlock_migrations (version, name) VALUES ($1, $2)", int(number), name
        )
    await conn.execute(LEGACY_ROWS_SQL)


async def columns_of(conn: asyncpg.Connection, table: str) -> list[str]:
    rows = await conn.fetch(
        "SELECT attname FROM pg_attribute WHERE attrelid = $1::regclass AND attnum > 0"
        " AND NOT attisdropped ORDER BY attnum",
        table,
    )
    return [r["attname"] for r in rows]


async def dump(conn: asyncpg.Connection, table: str, columns: list[str]) -> list[str]:
    """Every row's values in `columns` (0.1's; later migrations may add columns), as text."""
    listed = ", ".join(columns)
    rows = await conn.fetch(f"SELECT ROW({listed})::text AS row FROM {table} ORDER BY 1")
    return [r["row"] for r in rows]


async def shape(conn: asyncpg.Connection, table: str) -> dict[str, Any]:
    """A table's columns, indexes and constraints, by name (what migrations define)."""
    oid = await conn.fetchval("SELECT $1::regclass::oid", table)
    columns = await conn.fetch(
        """SELECT a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
                  a.attidentity, pg_get_expr(d.adbin, d.adrelid)
           FROM pg_attribute a LEFT JOIN pg_attrdef d
             ON d.adrelid = a.attrelid AND d.adnum = a.attnum
           WHERE a.attrelid = $1 AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum""",
        oid,
    )
    indexes = await conn.fetch(
        """SELECT i.relname, regexp_replace(pg_get_indexdef(i.oid), ' ON \\S+', ' ON t')
           FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid
           WHERE x.indrelid = $1 ORDER BY 1""",
        oid,
    )
    constraints = await conn.fetch(
        "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint WHERE conrelid = $1"
        " ORDER BY 1",
        oid,
    )
    return {
        "columns": [tuple(r) for r in columns],
        "indexes": [tuple(r) for r in indexes],
        "constraints": [tuple(r) for r in constraints],
    }


async def test_migrate_asks_before_a_second_ledger_on_the_same_server(
    fresh_url: str, fresh: asyncpg.Connection, db: asyncpg.Connection, run_cli: Cli
) -> None:
    """A database with no cronlock objects while another database of the server has them (a
    URL naming `postgres` beside serve's `cronlock`): `migrate` in a script changes nothing and
    says, in one line, which database has the ledger and what to do; `--dry-run` notes it;
    `--yes` creates the second ledger."""
    ledger = await db.fetchval("SELECT current_database()")
    here = await fresh.fetchval("SELECT current_database()")
    run_cli.env(DATABASE_URL=fresh_url)
    run_cli.capsys.readouterr()
    code = await asyncio.to_thread(cli.main, ["migrate"])  # stdin is no terminal here
    err = run_cli.capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1, err
    assert f"database {here} has no cronlock schema (cronlock) but database" in err
    assert ledger in err
    assert f"pass --yes to create a second ledger in {here}" in err
    assert await fresh.fetchval("SELECT to_regnamespace('cronlock')") is None
    code, out, err = await run_cli("migrate", "--dry-run")
    assert code == 0, err
    assert "would apply: cronlock 0001_ledger" in out
    assert "note: database" in err
    assert ledger in err
    code, out, err = await run_cli("migrate", "--yes")
    assert code == 0, err
    assert out.startswith("applied: create schema cronlock")
    # Now this database has a ledger of its own: nothing to ask any more.
    run_cli.capsys.readouterr()
    assert await asyncio.to_thread(cli.main, ["migrate"]) == 0
    assert run_cli.capsys.readouterr().out.strip() == "migrations are current"


async def test_migrate_yes_looks_at_no_other_database(fresh_url: str, run_cli: Cli) -> None:
    """`--yes` has answered the question before a second ledger: `migrate` then connects to
    no other database of the server to find one (each look is a connection, which a pooler
    may keep open), where a dry run still looks (it shows the note). Observed where the looks
    go, DATABASE_DIRECT_URL: a loopback listener that counts who knocks and hangs up."""
    knocks = 0

    async def knocked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal knocks
        knocks += 1
        writer.close()

    listener = await asyncio.start_server(knocked, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        run_cli.env(
            DATABASE_URL=fresh_url, DATABASE_DIRECT_URL=f"postgresql://nobody@127.0.0.1:{port}/x"
        )
        code, out, err = await run_cli("migrate", "--dry-run")
        assert code == 0, err
        assert "would apply: cronlock 0001_ledger" in out
        # Every other database was passed over (none answered), so no note; but each was tried.
        assert knocks >= 1
        knocks = 0
        code, out, err = await run_cli("migrate", "--yes")
        assert code == 0, err
        assert out.startswith("applied: create schema cronlock")
        assert knocks == 0
    finally:
        listener.close()
        await listener.wait_closed()


async def test_a_0_1_database_upgrades_in_place_with_nothing_lost(
    fresh_url: str,
    fresh: asyncpg.Connection,
    db: asyncpg.Connection,
    run_cli: Cli,
    start_instance: Starter,
) -> None:
    """Every row moves into the schemas (run history, pending, sent and dead emails with their
    keys, the rate bucket, the demo's users), the tables take the shape a new install has, and
    the pending email is then delivered once with its original key."""
    await build_0_1(fresh)
    columns = {old: await columns_of(fresh, old) for old in TABLES_0_1}
    before = {old: await dump(fresh, old, columns[old]) for old in TABLES_0_1}
    run_cli.env(DATABASE_URL=fresh_url)
    code, out, err = await run_cli("migrate", "--dry-run")
    assert code == 0, err
    assert "would apply: move cronlock 0.1's tables from public" in out
    assert "cronlock 0001_ledger" not in out  # adopted, not made again
    code, out, err = await run_cli("migrate")
    assert code == 0, err
    for old, new in TABLES_0_1.items():
        assert await dump(fresh, new, columns[old]) == before[old], new
        assert await fresh.fetchval("SELECT to_regclass($1)", f"public.{old}") is None
    # Identities go on from where they were.
    next_id = await fresh.fetchval(
        "INSERT INTO cronlock.runs (job, trigger, instance) VALUES ('x', 'manual', 'i')"
        " RETURNING id"
    )
    assert next_id == 4
    await fresh.execute("DELETE FROM cronlock.runs WHERE id = $1", next_id)
    # The same shape as a database migrated new (`db` is one).
    for table in TABLES_0_1.values():
        assert await shape(fresh, table) == await shape(db, table), table
    assert not await fresh.fetch("SELECT proname FROM pg_proc WHERE proname = 'cronlock_probe'"), (
        "0.1's probe functions are gone"
    )
    # 0.1 instances still running find their migrations applied, so they never make a second
    # ledger in public: the record stays until the DBA drops it.
    assert await fresh.fetchval("SELECT count(*) FROM public.cronlock_migrations") == 5
    code, out, _ = await run_cli("migrate")
    assert (code, out.strip()) == (0, "migrations are current")

    with Provider() as provider:
        env = {
            "DATABASE_URL": fresh_url,
            "CRON_JOBS": "cronlock.demo.digest,cronlock.housekeeping",
            "OUTBOX_ENABLED": "true",
            "EMAIL_BACKEND": "http",
            "EMAIL_API_URL": provider.url,
            "EMAIL_API_KEY": "re_test_key",
            "OUTBOX_RATE_LIMIT": "0",
            "OUTBOX_POLL_INTERVAL": "0.2",
        }
        start_instance("upgraded", env, ready_path="/readyz")

        async def sent() -> bool:
            status = await fresh.fetchval(
                "SELECT status FROM cronlock.email_outbox"
                " WHERE idempotency_key = 'daily-digest:1764658800:1'"
            )
            return bool(status == "sent")

        await wait_for(sent, 20, "the pending email of 0.1 to be delivered")
        await asyncio.sleep(0.5)
        assert provider.delivered() == {"daily-digest:1764658800:1": 1}
    statuses = await fresh.fetch("SELECT status FROM cronlock.email_outbox ORDER BY id")
    assert [r["status"] for r in statuses] == ["sent", "sent", "dead"]


# --- least privilege -------------------------------------------------------------------------


async def test_a_role_without_create_on_the_database_runs_in_schemas_a_dba_made(
    fresh_url: str, fresh: asyncpg.Connection, run_cli: Cli, start_instance: Starter
) -> None:
    """The DBA's SQL of docs/existing-database.md: a login role, the schemas it owns, nothing
    in public, no CREATE on the database."""
    role = unique_name("cl_role")
    dbname = await fresh.fetchval("SELECT current_database()")
    await fresh.execute(APP_SQL)
    await fresh.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'not-a-real-secret-1234'")
    await fresh.execute(f"REVOKE ALL ON DATABASE {dbname} FROM PUBLIC")
    await fresh.execute(f"GRANT CONNECT, TEMPORARY ON DATABASE {dbname} TO {role}")
    await fresh.execute("REVOKE ALL ON SCHEMA public FROM PUBLIC")
    parts = urlsplit(fresh_url)
    url = urlunsplit(
        parts._replace(netloc=f"{role}:not-a-real-secret-1234@{parts.hostname}:{parts.port}")
    )
    try:
        run_cli.env(DATABASE_URL=url)
        code, _, err = await run_cli("migrate")
        assert code == 3
        assert err.count("\n") == 1, err
        assert "create schema cronlock failed: permission denied for database" in err
        before = await snapshot(fresh)
        # The DBA makes the schemas, owned by the role.
        await fresh.execute(f"CREATE SCHEMA cronlock AUTHORIZATION {role}")
        await fresh.execute(f"CREATE SCHEMA cronlock_demo AUTHORIZATION {role}")
        code, _out, err = await run_cli("migrate")
        assert code == 0, err
        await fresh.execute(
            "INSERT INTO cronlock_demo.users (email) VALUES ('a@example.com'), ('b@example.com')"
        )
        env = {"DATABASE_URL": url, "CRON_JOBS": "cronlock.demo.digest,cronlock.housekeeping"}
        instance = start_instance("least", env, ready_path="/readyz")
        async with httpx.AsyncClient(timeout=30) as client:
            r = await post(client, instance.url + "/cron/daily-digest")
            assert r.json().get("processed") == 2, r.text
            r = await post(client, instance.url + "/cron/ledger-prune?force=true")
            assert r.status_code == 200, r.text
        instance.stop(5)
        owned = await fresh.fetch(
            """SELECT n.nspname, c.relname FROM pg_class c
               JOIN pg_namespace n ON n.oid = c.relnamespace
               WHERE pg_get_userbyid(c.relowner) = $1 AND n.nspname <> ALL($2)
                 AND n.nspname NOT LIKE 'pg_toast%'""",
            role,
            list(OURS),
        )
        assert owned == []
        assert await snapshot(fresh) == before
    finally:
        await fresh.execute("DROP SCHEMA IF EXISTS cronlock, cronlock_demo CASCADE")
        await fresh.execute(f"DROP OWNED BY {role}")
        await fresh.execute(f"DROP ROLE {role}")


# --- migrations a DBA can review -----------------------------------------------------------


async def test_migrate_sql_is_what_migrate_would_do(
    fresh_url: str, fresh: asyncpg.Connection, run_cli: Cli, db: asyncpg.Connection
) -> None:
    """`--dry-run` lists the steps, `--sql` prints them; applied by hand, the database is
    migrated: `migrate` finds nothing left and the tables have the shape `migrate` makes."""
    run_cli.env(DATABASE_URL=fresh_url)
    code, out, err = await run_cli("migrate", "--dry-run")
    assert code == 0, err
    # Every migration this release ships, in order (the list grows with each release).
    shipped = [
        f"would apply: cronlock {m.version:04d}_{m.name}" for m in cronlock_migrations().migrations
    ]
    assert shipped[:3] == [
        "would apply: cronlock 0001_ledger",
        "would apply: cronlock 0002_outbox",
        "would apply: cronlock 0003_probe",
    ]
    assert out.splitlines() == [
        "would apply: create schema cronlock",
        "would apply: create table migrations",
        *shipped,
        "would apply: cronlock.demo.digest 0001_users",
    ]
    assert await fresh.fetchval("SELECT to_regnamespace('cronlock')") is None  # changed nothing
    code, script, err = await run_cli("migrate", "--sql")
    assert code == 0, err
    steps = len(out.splitlines())  # one transaction per step the dry run names
    assert script.count("BEGIN;") == steps
    assert script.count("COMMIT;") == steps
    assert "{schema}" not in script
    await fresh.execute(script)
    code, out, err = await run_cli("migrate", "--dry-run")
    assert (code, out.strip()) == (0, "migrations are current")
    for table in ("cronlock.runs", "cronlock.email_outbox", "cronlock_demo.users"):
        assert await shape(fresh, table) == await shape(db, table)


async def test_newer_migrations_than_the_code_knows_serve_on(
    db: asyncpg.Connection, run_cli: Cli, database_url: str, start_instance: Starter
) -> None:
    """A rolling deploy: a newer instance migrated first. The old code serves and says so."""
    await db.execute(
        "INSERT INTO cronlock.migrations (module, version, name) VALUES ('cronlock', 99, 'later')"
    )
    instance = start_instance("old", {"CRON_JOBS": "tests.jobs"})
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.get(instance.url + "/readyz")
        assert r.status_code == 200
        assert "cronlock 0099_later" in r.json()["note"]
        assert (await post(client, instance.url + "/cron/fast")).json()["processed"] == 1
    run_cli.env(DATABASE_URL=database_url)
    code, out, err = await run_cli("migrate")
    assert code == 0
    assert out.strip() == "migrations are current"
    assert "newer than this code (cronlock 0099_later)" in err


# --- errors in one line --------------------------------------------------------------------


def run_migrate_process(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("CRON_", "DATABASE_"))}
    full.update(env, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "cronlock", "migrate", "--yes"],
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO,
    )


async def test_a_migration_that_fails_is_one_line_and_backs_off(
    fresh_url: str, fresh: asyncpg.Connection, start_instance: Starter
) -> None:
    """A name taken: `migrate` exits 3 with one line (migration, object, cause), `/readyz`
    answers 503 with it, and the instance retries with a growing delay, logging it once."""
    await fresh.execute(APP_SQL)
    env = {"DATABASE_URL": fresh_url, "CRON_JOBS": "tests.broken_jobs"}
    done = await asyncio.to_thread(run_migrate_process, env)
    assert done.returncode == 3
    assert "Traceback" not in done.stderr + done.stdout
    expected = (
        'migration tests.broken_jobs 0001_users failed: relation "users" already exists'
        " (SQLSTATE 42P07)"
    )
    assert done.stderr == f"cronlock: {expected}\n"
    # cronlock's own migrations went in, each in its own transaction, before the failure.
    versions = await fresh.fetch("SELECT module, version FROM cronlock.migrations ORDER BY 2")
    ours = [("cronlock", m.version) for m in cronlock_migrations().migrations]
    assert [tuple(r) for r in versions] == ours

    instance = start_instance(
        "broken", {**env, "MIGRATE_RETRY_INTERVAL": "0.1", "MIGRATE_RETRY_MAX": "0.8"}
    )
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.get(instance.url + "/readyz")
        assert r.status_code == 503
        assert r.json()["reason"] == expected
        r = await post(client, instance.url + "/cron/broken-noop")
        assert r.status_code == 503
    await asyncio.sleep(2)
    log = instance.log_tail(400)
    assert log.count("database not ready: migration tests.broken_jobs") == 1, log
    assert "Traceback" not in log


class CountingDatabase(Database):
    """Records when each check starts and ends (time.monotonic())."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.spans: list[tuple[float, float]] = []

    async def check(self, *, apply_migrations: bool) -> str | None:
        started = time.monotonic()
        try:
            return await super().check(apply_migrations=apply_migrations)
        finally:
            self.spans.append((started, time.monotonic()))


@pytest.mark.slow  # seconds of timers or loops by design: not in --fast
async def test_the_watcher_backs_off_while_a_migration_keeps_failing(
    fresh_url: str, fresh: asyncpg.Connection
) -> None:
    """0.1 s doubling up to 0.4 s between checks, not a fixed interval (the waits between
    checks are measured, not counted in a window: a check's own time depends on the machine)."""
    await fresh.execute(APP_SQL)
    settings = Settings(
        _env_file=None,
        database_url=fresh_url,
        cron_jobs="tests.broken_jobs",
        migrate_retry_interval=0.1,
        migrate_retry_max=0.4,
    )
    database = CountingDatabase(settings)
    await database.open()
    stop = asyncio.Event()
    try:
        watching = asyncio.create_task(database.watch(stop))

        async def five_checks() -> bool:
            return len(database.spans) >= 5

        await wait_for(five_checks, 20, "five checks")
        stop.set()
        await watching
    finally:
        await database.close()
    assert database.problem is not None
    assert "0001_users failed" in database.problem
    spans = database.spans[:5]
    waits = [b[0] - a[1] for a, b in itertools.pairwise(spans)]
    for wait, wanted in zip(waits, (0.1, 0.2, 0.4, 0.4), strict=True):
        # Never sooner than the backoff says; later only by a busy event loop's lag.
        assert wanted * 0.95 <= wait <= wanted + 0.5, waits


async def test_a_migration_waiting_for_the_applications_lock_gives_up(
    fresh_url: str, fresh: asyncpg.Connection
) -> None:
    """MIGRATE_LOCK_TIMEOUT: a DDL statement behind an application transaction fails (and is
    retried later) instead of queueing the application's queries behind it."""
    await fresh.execute(APP_SQL)
    touch = Migration("tests.touch", 1, "jobs_note", "ALTER TABLE public.jobs ADD COLUMN n text")
    sets = [*migration_sets([]), MigrationSet("tests.touch", (touch,))]
    holder = await asyncpg.connect(fresh_url, statement_cache_size=0)
    conn = await asyncpg.connect(fresh_url, statement_cache_size=0)
    try:
        async with holder.transaction():
            await holder.execute("LOCK TABLE public.jobs IN ACCESS SHARE MODE")
            with pytest.raises(MigrationError) as failed:
                await migrate(conn, "cronlock", sets, lock_timeout=0.3)
        assert failed.value.reason == (
            "migration tests.touch 0001_jobs_note failed: canceling statement due to lock"
            " timeout (SQLSTATE 55P03)"
        )
        assert await migrate(conn, "cronlock", sets, lock_timeout=0.3) == [
            "tests.touch 0001_jobs_note"
        ]
    finally:
        await holder.close()
        await conn.close()


async def test_no_command_prints_a_traceback_on_a_database_without_cronlock(
    fresh_url: str, run_cli: Cli
) -> None:
    """Commands against a database nobody migrated: exit 3 and one line that says what to do."""
    run_cli.env(DATABASE_URL=fresh_url, MIGRATE_ON_START="false")
    for command in (
        ["jobs"],
        ["runs"],
        ["outbox", "dead"],
        ["outbox", "requeue", "--all"],
        ["run", "ledger-prune", "--force"],
    ):
        code, out, err = await run_cli(*command)
        assert code == 3, (command, out, err)
        assert err.count("\n") == 1, (command, err)
        assert "Traceback" not in out + err
        assert "migrat" in err, (command, err)


async def test_a_schema_the_role_may_not_read_is_a_reason_not_a_crash(
    fresh_url: str, fresh: asyncpg.Connection, run_cli: Cli
) -> None:
    """The check of a running instance meets a refusal that is no outage (no USAGE on the
    schema): its reason says which kind, without the server's own text; nothing raises."""
    run_cli.env(DATABASE_URL=fresh_url)
    assert (await run_cli("migrate"))[0] == 0
    role = unique_name("cl_reader")
    await fresh.execute(f"CREATE ROLE {role} LOGIN")
    parts = urlsplit(fresh_url)
    url = urlunsplit(parts._replace(netloc=f"{role}@{parts.hostname}:{parts.port}"))
    database = Database(Settings(_env_file=None, database_url=url, migrate_on_start=False))
    await database.open()
    try:
        problem = await database.check(apply_migrations=False)
    finally:
        await database.close()
        await fresh.execute(f"DROP ROLE {role}")
    # PostgreSQL's own words with the code, not the bare code.
    assert problem is not None
    assert problem.startswith("database error 42501: permission denied for "), problem
    assert not database.migrated


# --- the outbox's lean upgrade (0012) ----------------------------------------------------------

OUTBOX_TABLES = ("cronlock.email_outbox", "cronlock.email_batch")


def migrations_through(version: int, also: tuple[int, ...] = ()) -> list[MigrationSet]:
    """cronlock's migrations up to `version` (a release's) and those in `also`, and the demo's."""
    return [
        MigrationSet(
            s.module, tuple(m for m in s.migrations if m.version <= version or m.version in also)
        )
        if s.module == "cronlock"
        else s
        for s in migration_sets(["cronlock.demo.digest"])
    ]


async def every_row(conn: asyncpg.Connection, table: str) -> list[str]:
    rows = await conn.fetch(f"SELECT t::text AS row FROM {table} AS t ORDER BY id")
    return [r["row"] for r in rows]


async def build_0011_outbox(conn: asyncpg.Connection) -> dict[str, str]:
    """A database of the release before 0012 with emails in every state, made by the
    outbox's own functions; returns {state: idempotency key} for some of them. With 0017's
    nullable `traceparent` column, which today's functions write and read (no row of 0011
    has one), applied ahead of its turn."""
    await migrate(conn, "cronlock", migrations_through(11, also=(17,)))
    slot = await conn.fetchval("SELECT date_trunc('day', now())")
    epoch = int(slot.timestamp())
    await conn.execute(
        """INSERT INTO cronlock.email_outbox (idempotency_key, job, slot, user_id, sender,
                                              recipient, subject, body)
           SELECT 'daily-digest:' || $1::text || ':' || g, 'daily-digest', $2, g, 's',
                  'u' || g || '@example.com', 'subject', 'body ' || g
           FROM generate_series(1, 12) AS g""",
        str(epoch),
        slot,
    )
    # A named email of a keyed run (stable key, no user) and a manual run's (random key).
    named = await outbox.enqueue(
        conn, schema="cronlock", job="invoices", slot=slot, user_id=None, key="acme",
        identity="invoice:1", recipient="a@example.com", subject="s", body="b", sender="s",
    )  # fmt: skip
    manual = await outbox.enqueue(
        conn, schema="cronlock", job="manual", slot=None, user_id=None,
        recipient="m@example.com", subject="s", body="b", sender="s",
    )  # fmt: skip
    assert named is not None
    assert manual is not None
    common: dict[str, Any] = {"schema": "cronlock", "max_attempts": 5, "retry_window": 82800.0}
    # Batches: one answered (a member sent, one refused: dead), one dead whole, one in flight.
    done, dead, flying = await outbox.form_batches(
        conn, schema="cronlock", batches=3, size=2, lease=60
    )
    sent, refused = outbox.Mark("sent", message_id="m-1"), outbox.Mark("dead", error="bad")
    assert await outbox.mark_batch(
        conn, done, outbox.BatchMark("done", members=(sent, refused)), **common
    )
    assert await outbox.mark_batch(conn, dead, outbox.BatchMark("dead", error="gone"), **common)
    # Single sends: one sent, one to retry, one dead; the rest stay pending, never attempted.
    claim = await outbox.claim(conn, schema="cronlock", limit=3, lease=60)
    marks = [
        outbox.Mark("sent", message_id="m-2"),
        outbox.Mark("retry", delay=5, error="503"),
        outbox.Mark("dead", error="422"),
    ]
    written = await outbox.mark(
        conn, claim.token, [(r.id, m) for r, m in zip(claim.rows, marks, strict=True)], **common
    )
    assert sorted(written.values()) == ["dead", "pending", "sent"]
    statuses = await conn.fetch(
        "SELECT status, batch_id IS NOT NULL AS batched, count(*) FROM cronlock.email_outbox"
        " GROUP BY 1, 2 ORDER BY 1, 2"
    )
    assert [tuple(r) for r in statuses] == [
        ("dead", False, 1), ("dead", True, 3), ("pending", False, 6), ("pending", True, 2),
        ("sent", False, 1), ("sent", True, 1),
    ]  # fmt: skip
    assert flying.size == 2
    return {"named": named, "manual": manual, "dead_batch": dead.key}


async def test_the_lean_outbox_upgrade_keeps_every_row_and_key(
    fresh: asyncpg.Connection, db: asyncpg.Connection
) -> None:
    """0012 on a database of the previous release with emails in every state (pending, in a
    batch in flight, retried, sent alone and in a batch, dead alone and with its batch): every
    row and key is kept, the tables take a new install's shape, and the rows then go on as
    before: a dead batch re-opens under its key, duplicates are still refused, prune works."""
    keys = await build_0011_outbox(fresh)
    before = {t: await every_row(fresh, t) for t in OUTBOX_TABLES}
    applied = await migrate(fresh, "cronlock", migrations_through(12))
    assert applied == ["cronlock 0012_outbox_lean"]
    for table in OUTBOX_TABLES:
        assert await every_row(fresh, table) == before[table], table
    indexes = await fresh.fetch(
        "SELECT indexname FROM pg_indexes WHERE tablename = 'email_outbox' ORDER BY 1"
    )
    assert [r["indexname"] for r in indexes] == [
        "email_outbox_batch", "email_outbox_dead", "email_outbox_due_alone",
        "email_outbox_due_unbatched", "email_outbox_key", "email_outbox_once_per_key_slot",
        "email_outbox_pkey", "email_outbox_sent",
    ]  # fmt: skip
    # Then whatever came later: the shape of a new install.
    await migrate(fresh, "cronlock", migration_sets(["cronlock.demo.digest"]))
    for table in OUTBOX_TABLES:
        assert await shape(fresh, table) == await shape(db, table), table

    # A dead batch comes back whole, under the key it had before the upgrade.
    dead = await outbox.dead_rows(fresh, schema="cronlock")
    in_batch = [d for d in dead if d.batch_key == keys["dead_batch"]]
    assert len(in_batch) == 2
    requeued = await outbox.requeue(fresh, [in_batch[0].id], schema="cronlock")
    assert {(r.previous_key, r.idempotency_key, r.new_key) for r in requeued} == {
        (d.idempotency_key, d.idempotency_key, False) for d in in_batch
    }
    batch_status = await fresh.fetchval(
        "SELECT status FROM cronlock.email_batch WHERE idempotency_key = $1", keys["dead_batch"]
    )
    assert batch_status == "pending"
    # Duplicates are refused as before: a named email again is a no-op, a digest row again
    # an error, a random key again an error.
    slot = await fresh.fetchval("SELECT date_trunc('day', now())")
    again = await outbox.enqueue(
        fresh, schema="cronlock", job="invoices", slot=slot, user_id=None, key="acme",
        identity="invoice:1", recipient="a@example.com", subject="s", body="b", sender="s",
    )  # fmt: skip
    assert again is None
    with pytest.raises(asyncpg.UniqueViolationError):
        await fresh.execute(
            "INSERT INTO cronlock.email_outbox (job, slot, user_id, sender, recipient, subject,"
            " body) VALUES ('daily-digest', $1, 3, 's', 'r', 's', 'b')",
            slot,
        )
    with pytest.raises(asyncpg.UniqueViolationError):
        await fresh.execute(
            "INSERT INTO cronlock.email_outbox (idempotency_key, job, sender, recipient,"
            " subject, body) VALUES ($1, 'manual', 's', 'r', 's', 'b')",
            keys["manual"],
        )
    # Everything still pending is delivered under the keys it had.
    await fresh.execute(
        "UPDATE cronlock.email_outbox SET next_attempt_at = now()"
        " WHERE status = 'pending' AND batch_id IS NULL"
    )
    pending_keys = {
        r["idempotency_key"]
        for r in await fresh.fetch(
            "SELECT idempotency_key FROM cronlock.email_outbox"
            " WHERE status = 'pending' AND batch_id IS NULL"
        )
    }
    claim = await outbox.claim(fresh, schema="cronlock", limit=100, lease=60)
    assert {r.email.idempotency_key for r in claim.rows} == pending_keys
    assert {keys["named"], keys["manual"]} <= pending_keys
    await outbox.mark(
        fresh,
        claim.token,
        [(r.id, outbox.Mark("sent", message_id="m")) for r in claim.rows],
        schema="cronlock",
        max_attempts=5,
        retry_window=82800.0,
    )
    await fresh.execute("UPDATE cronlock.email_outbox SET sent_at = sent_at - interval '2 days'")
    await fresh.execute(
        "UPDATE cronlock.email_batch SET finished_at = finished_at - interval '2 days'"
    )
    pruned = await outbox.prune_sent(fresh, 1, schema="cronlock")
    assert pruned == len(pending_keys) + 2
    # The answered batch keeps its refused member, so it stays; nothing names a missing batch.
    assert not await fresh.fetchval(
        "SELECT count(*) FROM cronlock.email_outbox AS o WHERE o.batch_id IS NOT NULL"
        " AND NOT EXISTS (SELECT 1 FROM cronlock.email_batch AS b WHERE b.id = o.batch_id)"
    )
