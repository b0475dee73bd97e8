"""The embedded server (app/embedded.py, as the tests extend it) and start_standby, against
real servers of their own (not the session's)."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from app.embedded import LocalPostgres, PostgresError
from tests.support.postgres import ScratchPostgres, start_standby

# Starts PostgreSQL servers of its own (initdb, a kill -9, a standby): not in --fast.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="cronlock-emb-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def primary(scratch: Path) -> Iterator[ScratchPostgres]:
    server = ScratchPostgres(scratch / "primary", settings={"work_mem": "8MB"})
    server.start()
    yield server
    server.stop("immediate")


async def fetchval(dsn: str, query: str) -> object:
    conn = await asyncpg.connect(dsn, statement_cache_size=0)
    try:
        return await conn.fetchval(query)
    finally:
        await conn.close()


async def test_start_applies_the_settings(primary: ScratchPostgres) -> None:
    assert primary.dsn() == f"postgresql://postgres@127.0.0.1:{primary.port}/postgres"
    assert await fetchval(primary.dsn(), "SHOW max_connections") == "300"
    assert await fetchval(primary.dsn(), "SHOW fsync") == "off"
    assert await fetchval(primary.dsn(), "SHOW wal_level") == "replica"
    assert await fetchval(primary.dsn(), "SHOW listen_addresses") == "127.0.0.1"
    assert await fetchval(primary.dsn(), "SHOW work_mem") == "8MB"
    assert (primary.bindir / "postgres").is_file()


async def test_a_running_data_dir_is_reused(primary: ScratchPostgres) -> None:
    again = LocalPostgres(primary.data_dir)
    assert again.start() == primary.dsn()
    assert again.port == primary.port


@pytest.fixture(scope="module")
def server(scratch: Path) -> Iterator[ScratchPostgres]:
    """A second server for the destructive tests; each test starts it (start is idempotent)."""
    server = ScratchPostgres(scratch / "lifecycle")
    yield server
    server.stop("immediate")


async def test_stop_then_start_keeps_data_and_port(server: ScratchPostgres) -> None:
    dsn = server.start()
    await fetchval(dsn, "CREATE TABLE IF NOT EXISTS kept AS SELECT 42 AS answer")
    server.stop()
    assert not server.is_running()
    with pytest.raises(ConnectionRefusedError):
        await fetchval(dsn, "SELECT 1")
    # A fresh object on the stopped data dir starts it on the port it had.
    assert LocalPostgres(server.data_dir).start() == dsn
    assert server.is_running()
    assert server.restart() == dsn
    assert await fetchval(dsn, "SELECT answer FROM kept") == 42


async def test_kill_is_a_crash_the_server_recovers_from(server: ScratchPostgres) -> None:
    dsn = server.start()
    await fetchval(dsn, "CREATE TABLE IF NOT EXISTS survived AS SELECT 1 AS one")
    conn = await asyncpg.connect(dsn)
    server.kill()
    assert not server.is_running()
    with pytest.raises((asyncpg.PostgresError, asyncpg.InterfaceError, OSError)):
        await conn.fetchval("SELECT 1")
    conn.terminate()
    server.start()
    # Committed before the kill, so recovered from the WAL even with fsync off.
    assert await fetchval(dsn, "SELECT one FROM survived") == 1
    assert "not properly shut down; automatic recovery in progress" in server.read_log()


def test_a_broken_setting_fails_with_the_server_log(server: ScratchPostgres) -> None:
    server.start()
    server.stop()
    broken = ScratchPostgres(server.data_dir, settings={"shared_buffers": "nonsense"})
    with pytest.raises(PostgresError, match="shared_buffers"):
        broken.start()
    assert not broken.is_running()
    # The settings are rewritten at every start, so the next good start recovers.
    server.start()
    assert server.is_running()


async def test_standby_is_in_recovery_and_follows_the_primary(
    primary: ScratchPostgres, scratch: Path
) -> None:
    await fetchval(primary.dsn(), "CREATE TABLE replicated AS SELECT 7 AS seven")
    standby = start_standby(primary, scratch / "standby")
    try:
        assert standby.port != primary.port
        assert await fetchval(standby.dsn(), "SELECT pg_is_in_recovery()") is True
        assert await fetchval(primary.dsn(), "SELECT pg_is_in_recovery()") is False
        assert await fetchval(standby.dsn(), "SELECT seven FROM replicated") == 7
    finally:
        standby.stop("immediate")


async def test_a_stale_pid_file_naming_another_process_is_no_server(
    server: ScratchPostgres,
) -> None:
    """postmaster.pid left by a server that died, its pid now another live process (pid 1,
    whose cwd is not the data dir), full or cut short: start() starts the server at once
    rather than waiting for that process to answer, and PostgreSQL replaces its lock file."""
    dsn = server.start()
    server.kill()
    pid_file = server.data_dir / "postmaster.pid"
    for text in (f"1\n{server.data_dir}\n0\n{server.port}\n", "1\n"):
        pid_file.write_text(text)
        assert not server.is_running()
        started = time.monotonic()
        assert server.start() == dsn
        assert server.spawned
        assert time.monotonic() - started < 20
        assert await fetchval(dsn, "SELECT 1") == 1
        server.kill()


def test_the_fallback_socket_dir_is_removed_at_stop(scratch: Path) -> None:
    """A data dir too deep for a socket path next to it gets a socket dir in /tmp: stop()
    removes it."""
    deep = ScratchPostgres(scratch / ("d" * 100) / "pg")
    deep.start()
    try:
        conf = (deep.data_dir / "cronlock.conf").read_text()
        socket_dir = Path(conf.split("unix_socket_directories = '")[1].split("'")[0])
        assert socket_dir.is_absolute()
        assert socket_dir.is_dir()
    finally:
        deep.stop()
    assert not socket_dir.exists()


def test_a_failed_initdb_removes_only_what_it_created(scratch: Path) -> None:
    """initdb runs into a fresh sibling folder: its failure deletes that, not the data dir
    (an empty folder given as EMBEDDED_PG_DIR stays)."""
    folder = scratch / "initdb-fails"
    data = folder / "pg"
    data.mkdir(parents=True)
    broken = LocalPostgres(data, initdb_options=["--no-such-option"])
    with pytest.raises(PostgresError, match="no-such-option"):
        broken.start()
    assert data.is_dir()
    assert not any(data.iterdir())
    assert sorted(p.name for p in folder.iterdir()) == ["pg", "pg.run"]
