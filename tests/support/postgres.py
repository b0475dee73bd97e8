"""The PostgreSQL server the tests use: a local one we own, or `DATABASE_URL` (not ours)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import NoReturn, Protocol
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest


class PostgresServer(Protocol):
    """What tests may rely on from `pg_server`: LocalPostgres has all of it."""

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
