"""The embedded server (cronlock/cli/embedded.py, as the tests extend it) and start_standby, against
real servers of their own (not the session's)."""

from __future__ import annotations

import asyncio
import contextlib
import grp
import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import asyncpg
import pytest

from cronlock.cli import embedded
from cronlock.cli.embedded import LocalPostgres, PostgresError, SetupError, free_port, wait_gone
from tests.support import TEST_SECRET
from tests.support.cluster import INHERIT_BLOCKLIST, REPO_ROOT
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


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_stop_right_after_the_spawn_does_not_wait(server: ScratchPostgres, mode: str) -> None:
    """stop() signals the process it spawned by its pid, even before the postmaster wrote
    postmaster.pid (before, it waited 30 s for it, then SIGKILLed), and until the postmaster
    can take the signal: spawned by a parent that ignores it (a shell's background job and
    all it starts), the postmaster ignores it too until its handlers are in place."""
    server.start()
    server.stop()
    signum = embedded.STOP_SIGNALS[mode]
    previous = signal.signal(signum, signal.SIG_IGN)
    try:
        server._spawn()  # as start() does; the stopped server removed its postmaster.pid
    finally:
        signal.signal(signum, previous)
    started = time.monotonic()
    server.stop(mode)
    assert time.monotonic() - started < 10
    assert not server.is_running()


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


@pytest.mark.parametrize("given", ["an empty folder", "no folder"])
def test_a_failed_initdb_removes_only_what_it_created(scratch: Path, given: str) -> None:
    """An empty folder given as EMBEDDED_PG_DIR (a volume's mount point, say) is initialised
    in place, and a failure empties it again, leaving the folder; with none, initdb runs into
    a fresh sibling folder renamed into place, and a failure deletes only that."""
    folder = scratch / f"initdb-fails-{given.replace(' ', '-')}"
    data = folder / "pg"
    (data if given == "an empty folder" else folder).mkdir(parents=True)
    broken = LocalPostgres(data, initdb_options=["--no-such-option"])
    with pytest.raises(PostgresError, match="no-such-option"):
        broken.start()
    if given == "an empty folder":
        assert data.is_dir()
        assert not any(data.iterdir())
        assert sorted(p.name for p in folder.iterdir()) == ["pg", "pg.run"]
    else:
        assert sorted(p.name for p in folder.iterdir()) == ["pg.run"]


def test_an_empty_data_dir_is_initialised_in_place(scratch: Path) -> None:
    """The folder itself, not a replacement renamed over it: a mount point cannot be renamed
    over (EBUSY), so a volume mounted at EMBEDDED_PG_DIR must be initialised where it is."""
    data = scratch / "in-place" / "pg"
    data.mkdir(parents=True)
    inode = data.stat().st_ino
    server = LocalPostgres(data)
    try:
        server.start()
        assert data.stat().st_ino == inode
        assert (data / "PG_VERSION").exists()
    finally:
        server.stop()


async def test_a_lost_password_file_is_made_again_at_the_next_start(scratch: Path) -> None:
    """With a password file, nothing gets in without the password; a deleted file gets a new
    password at the next start (the old one no longer works), and lines added to our
    pg_hba.conf are kept; while the server runs, a deleted file is a SetupError."""
    folder = Path(tempfile.mkdtemp(dir=scratch))
    passfile = folder / "pg.pgpass"
    server = LocalPostgres(folder / "pg", password_file=passfile)
    try:
        dsn = server.start()
        assert dsn.endswith(f"/postgres?passfile={passfile}")
        assert await fetchval(dsn, "SELECT current_user") == "postgres"
        with pytest.raises(asyncpg.InvalidPasswordError):
            await fetchval(dsn.split("?")[0], "SELECT 1")
        old = passfile.read_text()
        with (server.data_dir / "pg_hba.conf").open("a") as hba:
            hba.write("# added by hand\n")
        passfile.unlink()
        with pytest.raises(SetupError, match="which is gone"):
            LocalPostgres(server.data_dir, password_file=passfile).start()
        server.stop()
        assert server.start() == dsn
        assert not server.upgraded
        assert passfile.read_text() != old
        assert await fetchval(dsn, "SELECT current_user") == "postgres"
        assert (server.data_dir / "pg_hba.conf").read_text().endswith("# added by hand\n")
    finally:
        server.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root runs the server as another user")
def test_root_without_the_service_user_is_a_setup_error(
    scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As root with no `postgres` user: a SetupError that says so (`serve`: exit 2, one
    line), before anything is created; not a KeyError from deep in chown or subprocess."""
    monkeypatch.setattr(embedded, "SERVICE_USER", "cronlock-no-such-user")
    folder = Path(tempfile.mkdtemp(dir=scratch))
    with pytest.raises(SetupError, match="no `cronlock-no-such-user` system user"):
        LocalPostgres(folder / "pg").start()
    assert list(folder.iterdir()) == []


# --- `python -m cronlock serve` with the embedded server, as processes ----------------------------


def serve_command(port: int) -> list[str]:
    return [sys.executable, "-m", "cronlock", "serve", "--host", "127.0.0.1", "--port", str(port)]


def serve_env(data: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(INHERIT_BLOCKLIST)}
    env.update(PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1", OUTBOX_ENABLED="false")
    env.update(CRON_SECRET=TEST_SECRET, EMBEDDED_PG_DIR=str(data))
    env.update(extra)
    return env


def serve_once(cwd: Path, data: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    """`serve` run to its end (one that refuses to start), its output captured."""
    return subprocess.run(
        serve_command(free_port()),
        cwd=cwd,
        env=serve_env(data, **extra),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def start_serve(data: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            serve_command(port),
            cwd=log.parent,
            env=serve_env(data),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def processes_in(folder: Path) -> list[int]:
    """Processes working in `folder`: a postmaster and its children work in the data dir
    (also once it is deleted, which the kernel marks in the link)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                cwd = os.readlink(entry / "cwd").removesuffix(" (deleted)")
                if cwd == str(folder.resolve()):
                    found.append(int(entry.name))
    return found


def postmaster_of(data: Path) -> int | None:
    with contextlib.suppress(OSError, IndexError, ValueError):
        pid = int((data / "postmaster.pid").read_text().splitlines()[0])
        return pid if pid in processes_in(data) else None
    return None


def kill_leftovers(data: Path, *processes: subprocess.Popen[bytes]) -> None:
    """Cleanup when a test failed: the serve processes, then a postmaster they left behind."""
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    pid = postmaster_of(data)
    if pid is not None:
        os.kill(pid, signal.SIGQUIT)
        wait_gone([pid], 10)
    for straggler in processes_in(data):
        with contextlib.suppress(ProcessLookupError):
            os.kill(straggler, signal.SIGKILL)


def wait_healthy(port: int, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()
        url = f"http://127.0.0.1:{port}/healthz"
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as answer:
            if answer.status == 200:
                return
        time.sleep(0.1)
    raise AssertionError(f"serve not healthy after 90 s:\n{log.read_text()}")


def notes_folder(root: Path) -> Path:
    folder = root / "notes"
    folder.mkdir()
    (folder / "notes.txt").write_text("hi\n")
    return folder


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("a folder of other files", "no PG_VERSION"),
        ("CRONLOCK_PG_BINDIR=/nonexistent", "CRONLOCK_PG_BINDIR=/nonexistent has no postgres"),
        ("a short secret", "CRON_SECRET is shorter than 32 characters"),
    ],
)
def test_serve_refuses_what_cannot_work_and_touches_nothing(
    scratch: Path, case: str, message: str
) -> None:
    """Exit 2 with one line, before anything is created or changed: a folder of files that
    is no data dir (initdb would fail there, and the old code then deleted the folder), bad
    binaries, a bad secret (checked before the database is started and migrated)."""
    root = Path(tempfile.mkdtemp(dir=scratch))
    data = notes_folder(root) if case == "a folder of other files" else root / "pg"
    extra = {"CRONLOCK_PG_BINDIR": "/nonexistent"} if "BINDIR" in case else {}
    if case == "a short secret":
        extra["CRON_SECRET"] = "short"
    before = sorted(p.name for p in root.iterdir())
    done = serve_once(root, data, **extra)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert message in done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert sorted(p.name for p in root.iterdir()) == before
    if case == "a folder of other files":
        assert (data / "notes.txt").read_text() == "hi\n"
        assert sorted(p.name for p in data.iterdir()) == ["notes.txt"]
        assert data.stat().st_uid == os.geteuid()


def test_a_second_serve_on_the_same_folder_is_refused(scratch: Path) -> None:
    """Two `serve` on one EMBEDDED_PG_DIR: the second exits 3 at once with one line, and
    neither reuses nor stops the first one's server; the first stops it at SIGTERM."""
    root = Path(tempfile.mkdtemp(dir=scratch))
    data = root / "pg"
    first_log, second_log = root / "first.log", root / "second.log"
    port = free_port()
    first = start_serve(data, port, first_log)
    second: subprocess.Popen[bytes] | None = None
    try:
        wait_healthy(port, first, first_log)
        postmaster = postmaster_of(data)
        assert postmaster is not None
        second = start_serve(data, free_port(), second_log)
        assert second.wait(30) == 3, second_log.read_text()
        said = second_log.read_text()
        assert said.count("\n") == 1, said
        assert "in use by another process" in said
        assert postmaster_of(data) == postmaster
        wait_healthy(port, first, first_log)
        first.send_signal(signal.SIGTERM)
        assert first.wait(30) == 128 + signal.SIGTERM
        assert wait_gone([postmaster], 10) == []
        assert processes_in(data) == []
    finally:
        kill_leftovers(data, first, *([second] if second else []))


def test_sigterm_while_serve_starts_the_embedded_server_stops_it(scratch: Path) -> None:
    """A SIGTERM while `serve` waits for its fresh embedded server (or migrates it): the
    server it spawned is stopped, not left running in its own session."""
    root = Path(tempfile.mkdtemp(dir=scratch))
    data = root / "pg"
    log = root / "serve.log"
    process = start_serve(data, free_port(), log)
    try:
        deadline = time.monotonic() + 60
        while postmaster_of(data) is None:
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.005)
        assert "Application startup" not in log.read_text()
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 128 + signal.SIGTERM, log.read_text()
        assert wait_gone(processes_in(data), 10) == []
        assert "Traceback" not in log.read_text()
    finally:
        kill_leftovers(data, process)


def test_two_serve_started_at_once_on_a_fresh_folder(scratch: Path) -> None:
    """Started together on a new EMBEDDED_PG_DIR: one initialises and serves, the other
    exits 3 (before, both ran initdb into the folder and the loser deleted it)."""
    root = Path(tempfile.mkdtemp(dir=scratch))
    data = root / "pg"
    ports = [free_port(), free_port()]
    logs = [root / "a.log", root / "b.log"]
    both = [start_serve(data, port, log) for port, log in zip(ports, logs, strict=True)]
    try:
        deadline = time.monotonic() + 60
        while all(p.poll() is None for p in both):
            assert time.monotonic() < deadline, [log.read_text() for log in logs]
            time.sleep(0.05)
        [loser] = [i for i, p in enumerate(both) if p.poll() is not None]
        winner = 1 - loser
        assert both[loser].returncode == 3, logs[loser].read_text()
        assert "in use by another process" in logs[loser].read_text()
        assert "(log: " not in logs[loser].read_text()  # the other's log is not this one's
        wait_healthy(ports[winner], both[winner], logs[winner])
        both[winner].send_signal(signal.SIGTERM)
        assert both[winner].wait(30) == 128 + signal.SIGTERM
        assert wait_gone(processes_in(data), 10) == []
        assert (data / "PG_VERSION").is_file()
    finally:
        kill_leftovers(data, *both)


def test_serve_leaves_running_a_server_it_did_not_start(scratch: Path) -> None:
    """A server already running in EMBEDDED_PG_DIR (left by a `serve` killed with SIGKILL,
    say) is used, and still runs after `serve` exits."""
    root = Path(tempfile.mkdtemp(dir=scratch))
    data = root / "pg"
    found = LocalPostgres(data)
    found.start()
    log = root / "serve.log"
    port = free_port()
    process = start_serve(data, port, log)
    try:
        wait_healthy(port, process, log)
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 128 + signal.SIGTERM
        assert found.is_running()
    finally:
        found.stop()
        kill_leftovers(data, process)


def test_a_server_that_will_not_start_is_one_line_and_exit_3(scratch: Path) -> None:
    """PostgreSQL refusing to start (here: a garbled postmaster.pid) is exit 3 with one line
    naming its FATAL and its log, never a traceback."""
    root = Path(tempfile.mkdtemp(dir=scratch))
    data = root / "pg"
    made = LocalPostgres(data)
    made.start()
    made.stop()
    (data / "postmaster.pid").write_text("garbled\n")
    done = serve_once(root, data)
    assert done.returncode == 3, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert "FATAL:  bogus data in lock file" in done.stderr
    assert f"(log: {data.parent / 'pg.run' / 'postgres.log'})" in done.stderr
    assert processes_in(data) == []


def test_sigterm_during_initdb_leaves_nothing(scratch: Path) -> None:
    """A SIGTERM while initdb runs: its temporary folder is removed, no data dir is left to
    be mistaken for a usable one, and no process of it survives."""
    root = Path(tempfile.mkdtemp(dir=scratch))
    data = root / "pg"
    log = root / "serve.log"
    process = start_serve(data, free_port(), log)
    try:
        deadline = time.monotonic() + 60
        while not [p for p in root.glob(".pg.initdb-*") if (p / "base").exists()]:
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.005)
        [fresh] = root.glob(".pg.initdb-*")
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 128 + signal.SIGTERM, log.read_text()
        assert wait_gone(processes_in(fresh), 10) == []
        assert sorted(p.name for p in root.iterdir()) == ["pg.run", "serve.log"]
        assert "Traceback" not in log.read_text()
    finally:
        kill_leftovers(data, process)


def test_a_tool_interrupted_is_ended_with_all_it_started(tmp_path: Path) -> None:
    """A server tool that times out (or whose caller is interrupted) is ended with every
    process it started, before run_tool returns: else initdb's bootstrap `postgres --single`
    went on writing into the folder that the caller then failed to remove whole."""
    pidfile = tmp_path / "child"
    script = f"sleep 60 & echo $! > {pidfile}; wait"
    started = time.monotonic()
    with pytest.raises(embedded.PostgresError, match="timed out"):
        embedded.run_tool(["sh", "-c", script], timeout=1.0, as_service=False)
    assert time.monotonic() - started < 10
    assert not embedded.pid_alive(int(pidfile.read_text()))


def test_a_second_interruption_while_a_tool_ends_still_kills_its_group(tmp_path: Path) -> None:
    """Interrupted (as a SIGTERM to `serve` arrives: an exception in the main thread) and
    interrupted again while its group gets its grace: the group, which ignores SIGTERM here,
    is SIGKILLed before the second exception goes on."""
    pidfile = tmp_path / "child"
    script = f"trap '' TERM; sleep 60 & echo $! > {pidfile}; wait"

    class Interrupted(Exception):
        pass

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    # At 1 s (the tool runs), then at 2 s (its group's SIGTERM ignored, its grace running).
    signal.setitimer(signal.ITIMER_REAL, 1.0, 1.0)
    started = time.monotonic()
    try:
        with pytest.raises(Interrupted):
            embedded.run_tool(["sh", "-c", script], timeout=30.0, as_service=False)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - started < embedded.GROUP_GRACE + 1
    child = int(pidfile.read_text())
    assert embedded.wait_gone([child], 5) == []


# --- who may connect: the serve's own OS user only (issue 27) --------------------------------


def intrude(port: int, socket_dir: Path, passfile: Path, marker: Path) -> dict[str, str]:
    """What another OS user gets: the password file read, then every way in over TCP and the
    socket, as the superuser and other roles, each followed by COPY ... TO PROGRAM if in."""
    said = {}
    try:
        passfile.read_text()
        said["read passfile"] = "read it"
    except OSError as exc:
        said["read passfile"] = type(exc).__name__
    said.update(asyncio.run(try_every_way_in(port, str(socket_dir), str(marker))))
    return said


async def try_every_way_in(port: int, socket_dir: str, marker: str) -> dict[str, str]:
    said = {}
    for host in ("127.0.0.1", socket_dir):
        for user in ("postgres", "reader", "nobody"):
            for password in (None, "guess"):
                try:
                    conn = await asyncpg.connect(
                        host=host,
                        port=port,
                        user=user,
                        database="postgres",
                        password=password,
                        timeout=10,
                    )
                except Exception as exc:
                    said[f"{host} {user} {password}"] = f"{type(exc).__name__}: {exc}"
                    continue
                try:
                    await conn.execute(f"COPY (SELECT 1) TO PROGRAM 'touch {marker}'")
                    said[f"{host} {user} {password}"] = "in: COPY TO PROGRAM ran"
                except Exception as exc:
                    said[f"{host} {user} {password}"] = f"in: {type(exc).__name__}"
                finally:
                    await conn.close()
    return said


def in_child_as(user: str, work: Callable[[], dict[str, str]]) -> dict[str, str]:
    """`work()` in a forked child that became `user`: the interpreter may live where `user`
    cannot exec it (a pyenv under /root), and asyncpg is imported already."""
    entry = pwd.getpwnam(user)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child, which ends with os._exit
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(entry.pw_gid)
            os.setuid(entry.pw_uid)
            os.chdir("/")
            # As that user's own process would be: its home, none of our PG* settings.
            for name in [name for name in os.environ if name.startswith("PG")]:
                del os.environ[name]
            os.environ["HOME"] = entry.pw_dir
            said = json.dumps(work())
            code = 0
        except BaseException as exc:
            said = json.dumps({"child failed": repr(exc)})
        with os.fdopen(write, "w") as out:
            out.write(said)
        os._exit(code)
    os.close(write)
    with os.fdopen(read) as got:
        text = got.read()
    _, status = os.waitpid(pid, 0)
    answer: dict[str, str] = json.loads(text)
    assert os.waitstatus_to_exitcode(status) == 0, answer
    return answer


def other_user() -> str:
    """`nobody`, created if the system has none."""
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "nobody"], check=True)
    return "nobody"


def psql_tool() -> str:
    bundled = embedded.find_bindir() / "psql"
    found = str(bundled) if bundled.is_file() else shutil.which("psql")
    if found is None:
        pytest.skip("no psql next to the server binaries nor on PATH")
    return found


def as_other_user(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args,
        user=other_user(),
        group="nogroup" if _has_group("nogroup") else None,
        extra_groups=[],
        cwd="/",
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/nonexistent", **env},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _has_group(name: str) -> bool:
    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True


def make_trust_data_dir(data: Path) -> LocalPostgres:
    """A data dir as serve made it before issue 27 (initdb -A trust), holding a table."""
    made = LocalPostgres(data)
    made.start()
    asyncio.run(fetchval(made.dsn(), "CREATE TABLE kept AS SELECT 42 AS answer"))
    assert "trust" in (data / "pg_hba.conf").read_text()
    return made


async def as_the_same_user(url: str) -> object:
    """Connect with serve's URL (to its `postgres` database), add a role with no password;
    the kept table's value, if any."""
    conn = await asyncpg.connect(url.replace("/cronlock?", "/postgres?"))
    try:
        await conn.execute("CREATE ROLE reader LOGIN")
        return await conn.fetchval("SELECT answer FROM kept")
    except asyncpg.UndefinedTableError:
        return None
    finally:
        await conn.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can try as another OS user")
@pytest.mark.parametrize("given", ["a new folder", "a trust data dir", "a running trust server"])
def test_serve_lets_no_other_os_user_in(scratch: Path, given: str) -> None:
    """While serve runs, another OS user (`nobody`) gets in neither over TCP nor through the
    socket, with psql or asyncpg, as the superuser or any other role, so COPY ... TO PROGRAM
    never runs; the same after a data dir made with trust (the release before) is upgraded,
    stopped or running, with its data kept. The same user (here root, whose server runs as
    `postgres`) gets in with the URL serve printed, with asyncpg, psql and the CLI; nothing
    serve printed holds the password."""
    root = Path(tempfile.mkdtemp(dir=scratch))
    # Everything on the way is open to others, as a home directory may be: what keeps them
    # out must be the server's own folders and files, not a 0700 temp directory above them.
    embedded.make_traversable(root)
    root.chmod(0o755)
    data = root / "pg"
    found = make_trust_data_dir(data) if given != "a new folder" else None
    if found is not None and given == "a trust data dir":
        found.stop()
    log = root / "serve.log"
    port = free_port()
    process = start_serve(data, port, log)
    marker = Path(tempfile.gettempdir()) / f"cronlock-pwned-{os.getpid()}-{port}"
    try:
        wait_healthy(port, process, log)
        said = log.read_text()
        passfile = root / "pg.pgpass"
        password = passfile.read_text().strip().rsplit(":", 1)[1]
        assert len(password) >= 32
        assert stat.S_IMODE(passfile.stat().st_mode) == 0o600
        assert passfile.stat().st_uid == os.geteuid()
        run_dir = root / "pg.run"
        assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
        pg_port = int((data / "postmaster.pid").read_text().splitlines()[3])
        url = f"postgresql://postgres@127.0.0.1:{pg_port}/cronlock?passfile={passfile}"
        assert f"DATABASE_URL={url}\n" in said
        upgraded = [line for line in said.splitlines() if "upgraded" in line]
        if found is None:
            assert upgraded == []
        else:
            assert len(upgraded) == 1
            assert f"password in {passfile}" in upgraded[0]
        hba = [line.split() for line in (data / "pg_hba.conf").read_text().splitlines()]
        assert [fields[-1] for fields in hba if fields and not fields[0].startswith("#")] == [
            "scram-sha-256"
        ] * 6

        # The same user: the printed URL, with asyncpg, the CLI and psql.
        assert asyncio.run(as_the_same_user(url)) == (None if found is None else 42)
        cli = subprocess.run(
            [sys.executable, "-m", "cronlock", "jobs"],
            env=serve_env(data, DATABASE_URL=url),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert cli.returncode == 0, cli.stderr
        assert "daily-digest" in cli.stdout
        psql = psql_tool()
        mine = subprocess.run(
            [psql, "-w", "-At", url, "-c", "SELECT current_user"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert (mine.returncode, mine.stdout.strip()) == (0, "postgres"), mine.stderr

        # Another OS user: psql over TCP and the socket, every role, no or a guessed password.
        copy = f"COPY (SELECT 1) TO PROGRAM 'touch {marker}'"
        for host in ("127.0.0.1", str(run_dir)):
            for role in ("postgres", "reader", "nobody"):
                for guess in ({}, {"PGPASSWORD": "guess"}):
                    args = [psql, "-w", "-h", host, "-p", str(pg_port), "-U", role]
                    tried = as_other_user([*args, "-d", "postgres", "-c", copy], **guess)
                    assert tried.returncode != 0, (host, role, tried.stdout)
                    why = "Permission denied" if host != "127.0.0.1" else "password"
                    assert why in tried.stderr, (host, role, tried.stderr)
        # ... and asyncpg.
        results = in_child_as(
            other_user(),
            lambda: intrude(pg_port, run_dir, passfile, marker),
        )
        assert results.pop("read passfile") == "PermissionError"
        assert len(results) == 12
        for attempt, result in results.items():
            if "127.0.0.1" in attempt:
                assert result.startswith(("InvalidPasswordError", "ClientConfiguration")), (
                    attempt,
                    result,
                )
            else:
                assert result.startswith("PermissionError"), (attempt, result)
        assert not marker.exists()

        # Nothing serve printed, nor the server's log, holds the password.
        assert password not in log.read_text()
        assert password not in (run_dir / "postgres.log").read_text()
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 128 + signal.SIGTERM
    finally:
        marker.unlink(missing_ok=True)
        if found is not None:
            found.stop()
        kill_leftovers(data, process)
