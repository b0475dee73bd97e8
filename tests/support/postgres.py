"""The PostgreSQL server the tests use: a local one we own, or `DATABASE_URL` (not ours).

`ScratchPostgres` is the product's embedded server (cronlock/cli/embedded.py) with what only tests
need: no fsync, a crash on demand (`kill`), a restart, and a streaming standby.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import NoReturn, Protocol
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from cronlock.cli.embedded import (
    STOP_TIMEOUT,
    SUPERUSER,
    LocalPostgres,
    PostgresError,
    pid_alive,
    prepare_dir,
    run_tool,
    wait_gone,
)

# Durability against an OS crash traded for speed: only for throwaway test servers. Not
# synchronous_commit=off: that loses acknowledged commits when the *process* is killed (WAL
# still in shared memory), and fault tests kill() the server and count committed rows.
FAST_SETTINGS = {"fsync": "off", "full_page_writes": "off"}
# So `pg_basebackup -R` can clone the server into a standby that answers read-only queries
# (PostgreSQL's defaults too; written down because start_standby relies on them).
STANDBY_READY = {"wal_level": "replica", "max_wal_senders": "5", "hot_standby": "on"}


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


class ScratchPostgres(LocalPostgres):
    """A throwaway server: `fast` (the default) skips fsync, which tests never need."""

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        *,
        settings: dict[str, str] | None = None,
        fast: bool = True,
        bindir: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.fast = fast
        super().__init__(
            data_dir,
            port,
            settings={**STANDBY_READY, **(FAST_SETTINGS if fast else {}), **(settings or {})},
            initdb_options=["--no-sync"] if fast else [],
            bindir=bindir,
            env=env,
        )

    def kill(self) -> None:
        """SIGKILL the postmaster, as a crash would; returns once its children are gone too.

        The children notice the postmaster's death and exit on their own; waiting for them
        matters because a restart refuses while they still hold the shared memory.
        """
        self.forget()
        pid = self.postmaster_pid()
        if pid is None or not pid_alive(pid):
            self._reap(STOP_TIMEOUT)
            return
        children = children_of(pid)
        os.kill(pid, signal.SIGKILL)
        self._reap(STOP_TIMEOUT)
        survivors = wait_gone([pid, *children], timeout=15.0)
        for straggler in survivors:
            with contextlib.suppress(ProcessLookupError):
                os.kill(straggler, signal.SIGKILL)
        if wait_gone(survivors, timeout=5.0):
            raise PostgresError(f"processes of the killed server survive: {survivors}")

    def restart(self) -> str:
        """Stop (fast) if running, start again on the same port."""
        self.stop()
        return self.start()


@contextlib.contextmanager
def own_postgres(root: Path) -> Iterator[ScratchPostgres]:
    """A PostgreSQL of a test module's own in `root/pg`, for tests that stop, kill or freeze
    it (or its clients) and must not disturb the session's shared one."""
    server = ScratchPostgres(root / "pg")
    server.start()
    try:
        yield server
    finally:
        server.stop("immediate")


def start_standby(
    primary: ScratchPostgres, data_dir: Path, port: int | None = None
) -> ScratchPostgres:
    """A hot standby streaming from `primary`, started and accepting (read-only) connections."""
    data_dir = Path(data_dir).resolve()
    prepare_dir(data_dir.parent, mode=0o755, own=False)
    prepare_dir(data_dir)
    args = [primary.tool("pg_basebackup"), "-h", "127.0.0.1", "-p", str(primary.port)]
    args += ["-U", SUPERUSER, "-D", data_dir.name, "-R", "-X", "stream", "-c", "fast"]
    if primary.fast:
        args.append("--no-sync")
    run_tool(args, timeout=120.0, cwd=data_dir.parent)
    extra = {k: v for k, v in primary.settings.items() if k not in FAST_SETTINGS}
    standby = ScratchPostgres(
        data_dir,
        port,
        settings={**extra, "hot_standby": "on"},
        fast=primary.fast,
        bindir=primary.bindir,
    )
    standby.start()
    return standby


class PostgresServer(Protocol):
    """What tests may rely on from `pg_server`: ScratchPostgres has all of it."""

    @property
    def port(self) -> int: ...

    @property
    def host(self) -> str: ...

    def dsn(self, dbname: str = "postgres") -> str: ...

    def stop(self, mode: str = "fast") -> None: ...

    def kill(self) -> None: ...

    def restart(self) -> str: ...

    def start(self) -> str: ...

    def is_running(self) -> bool: ...

    def read_log(self) -> str: ...


def with_database(url: str, dbname: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{dbname}"))


class ExternalPostgres:
    """`DATABASE_URL`'s server: usable, but never stopped, killed or restarted by tests.

    The fault-injection methods skip the calling test (with the reason) instead.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        parts = urlsplit(url)
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or 5432
        self.username = parts.username
        self.password = parts.password

    @property
    def port(self) -> int:
        return self._port

    @property
    def host(self) -> str:
        return self._host

    def dsn(self, dbname: str = "postgres") -> str:
        return with_database(self.url, dbname)

    def _not_ours(self, action: str) -> NoReturn:
        pytest.skip(f"DATABASE_URL is set: cannot {action} a server the tests do not own")

    def stop(self, mode: str = "fast") -> None:
        self._not_ours("stop")

    def kill(self) -> None:
        self._not_ours("kill")

    def restart(self) -> str:
        self._not_ours("restart")

    def start(self) -> str:
        return self.url

    def is_running(self) -> bool:
        return True

    def read_log(self) -> str:
        return "(the log of an external server is not available)"


def unique_name(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:16]}"


async def create_database(admin_dsn: str, name: str, template: str | None = None) -> None:
    conn = await asyncpg.connect(admin_dsn, statement_cache_size=0)
    try:
        clause = f" TEMPLATE {quote_ident(template)}" if template else ""
        await conn.execute(f"CREATE DATABASE {quote_ident(name)}{clause}")
    finally:
        await conn.close()


async def drop_database(admin_dsn: str, name: str) -> None:
    conn = await asyncpg.connect(admin_dsn, statement_cache_size=0)
    try:
        # FORCE: an instance killed mid-test may leave sessions behind.
        await conn.execute(f"DROP DATABASE IF EXISTS {quote_ident(name)} WITH (FORCE)")
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def cloned_database(
    server: PostgresServer, template: str, prefix: str = "t"
) -> AsyncIterator[str]:
    """A fresh copy of `template` on `server` (its URL), dropped afterwards."""
    name = unique_name(prefix)
    admin = server.dsn("postgres")
    await create_database(admin, name, template=template)
    try:
        yield server.dsn(name)
    finally:
        await drop_database(admin, name)


def quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


class Clones:
    """Fresh copies of a template for one test each, the next one made while a test runs.

    `CREATE DATABASE ... TEMPLATE` costs a few tenths of a second (more on a loaded machine),
    most of a short test's time; made in the background (the server works while the test
    awaits) and dropped in the background, the test waits for neither. Each test still gets a
    database no other test has used.
    """

    def __init__(self, server: PostgresServer, template: str, prefix: str = "t") -> None:
        self.server = server
        self.template = template
        self.prefix = prefix
        self._next: asyncio.Task[str] | None = None
        self._pending: set[asyncio.Task[None]] = set()

    async def _create(self) -> str:
        name = unique_name(self.prefix)
        await create_database(self.server.dsn("postgres"), name, template=self.template)
        return name

    async def take(self) -> str:
        """A fresh database's name; the one after it is started in the background."""
        name = None
        if self._next is not None:
            ahead, self._next = self._next, None
            # A spare that failed (the server restarted under it) is made again, here.
            with contextlib.suppress(Exception):
                name = await ahead
        if name is None:
            name = await self._create()
        self._next = asyncio.create_task(self._create(), name="spare-database")
        return name

    def give_back(self, name: str) -> None:
        """Drop `name` in the background (awaited by `close`)."""
        task = asyncio.create_task(
            drop_database(self.server.dsn("postgres"), name), name="drop-database"
        )
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def close(self) -> None:
        if self._next is not None:
            with contextlib.suppress(Exception):
                self.give_back(await self._next)
        await asyncio.gather(*self._pending, return_exceptions=True)

    @contextlib.asynccontextmanager
    async def database(self) -> AsyncIterator[str]:
        """A fresh copy of the template (its URL), dropped afterwards."""
        name = await self.take()
        try:
            yield self.server.dsn(name)
        finally:
            self.give_back(name)
