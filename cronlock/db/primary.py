"""Following the primary: a DATABASE_URL with several hosts, and the stale-primary guard.

**Host by host.** A libpq-style URL may list several hosts
(`postgresql://u:p@db1:5432,db2:5432/app?target_session_attrs=read-write`). asyncpg tries
them in order but puts ONE timeout around the whole list (`asyncpg.connect` wraps
`connect_utils._connect` in a single `timeout`), so a first host that accepts TCP and never
answers (a frozen old primary, a host whose packets are dropped) uses up the connect timeout
and nothing connects. `Hosts.connect` asks asyncpg for one host at a time, each with its own
DB_CONNECT_TIMEOUT (libpq's `connect_timeout` is per host too), and starts from the host that
last worked, so after one failed attempt an instance stops waiting on the frozen host first.

**Timelines.** A promotion starts a new timeline, and the timeline is the first 8 hex digits
of the current WAL file's name (`pg_walfile_name(pg_current_wal_lsn())`; pg_control_checkpoint()
would lag a promotion until the next checkpoint). An instance remembers the newest timeline it
has seen and refuses a primary on an older one: an old primary back, unfenced, next to the
promoted one. What it cannot catch is said in docs/guarantees.md (an instance started since,
two servers promoted onto the same timeline number).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

import asyncpg

from cronlock.errors import CONNECTION_ERRORS, DatabaseUnavailable
from cronlock.settings import split_hosts

log = logging.getLogger("cronlock.primary")

# NULL on a standby: pg_current_wal_lsn() refuses during recovery, and a standby's own timeline
# says nothing about which primary is newest.
TIMELINE_SQL = """
SELECT CASE WHEN NOT pg_is_in_recovery() THEN pg_walfile_name(pg_current_wal_lsn()) END
"""


class ServerConnection(asyncpg.Connection):
    """A connection that knows the timeline its server was on when it was opened (or last
    checked); None for a standby, or a server not asked yet."""

    __slots__ = ("timeline",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timeline: int | None = None


def timeline_of(conn: object) -> int | None:
    """The timeline recorded on a connection or a pool's proxy of one (it forwards attributes)."""
    found = getattr(conn, "timeline", None)
    return found if isinstance(found, int) else None


def record_timeline(conn: object, timeline: int | None) -> None:
    """Record a timeline on a connection or on the one behind a pool's proxy."""
    raw = getattr(conn, "_con", conn)
    # Not isinstance: asyncpg's connection metaclass answers True for any connection (an
    # engine's plain asyncpg.Connection, cronlock/db/engine.py), which has no `timeline`.
    if issubclass(type(raw), ServerConnection):
        cast(ServerConnection, raw).timeline = timeline


def parse_timeline(walfile: str | None) -> int | None:
    if not walfile:
        return None
    return int(walfile[:8], 16)


async def read_timeline(conn: asyncpg.Connection | asyncpg.pool.PoolConnectionProxy) -> int | None:
    """The server's current timeline; None on a standby, and only there (a primary always has
    a current WAL file)."""
    return parse_timeline(await conn.fetchval(TIMELINE_SQL))


class Hosts:
    """The hosts of one DATABASE_URL, which of them worked last, and the newest timeline seen."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.hosts = split_hosts(url)
        self._start = 0
        self.newest_timeline: int | None = None

    def observe(self, timeline: int | None) -> None:
        if timeline is not None and (
            self.newest_timeline is None or timeline > self.newest_timeline
        ):
            if self.newest_timeline is not None:
                log.warning(
                    "database timeline %d follows %d: a promotion happened",
                    timeline,
                    self.newest_timeline,
                )
            self.newest_timeline = timeline

    def stale(self, timeline: int | None) -> str | None:
        """Why a primary on `timeline` must not run jobs, or None."""
        newest = self.newest_timeline
        if timeline is None or newest is None or timeline >= newest:
            return None
        return (
            f"stale primary: the database server is on timeline {timeline}, older than "
            f"timeline {newest} this instance has seen (an old primary back after a "
            f"failover?): jobs are refused there"
        )

    async def connect(self, dsn: str | None = None, **kwargs: Any) -> asyncpg.Connection:
        """What asyncpg's `connect` does, host by host (see the module's docstring); the pool
        calls it with its own arguments (`timeout` among them, here per host)."""
        url = dsn or self.url
        kwargs.setdefault("connection_class", ServerConnection)
        # The timeout covers the timeline's query too: a server may freeze in between.
        timeout = kwargs.pop("timeout", None) or 60.0
        if len(self.hosts) == 1:
            async with asyncio.timeout(timeout):
                conn = await asyncpg.connect(url, **kwargs)
                return await self._admit(conn, None)
        last: BaseException | None = None
        refused: DatabaseUnavailable | None = None
        count = len(self.hosts)
        first = self._start
        for step in range(count):
            index = (first + step) % count
            host, port = self.hosts[index]
            try:
                async with asyncio.timeout(timeout):
                    conn = await asyncpg.connect(url, host=host, port=port, **kwargs)
                    admitted = await self._admit(conn, index)
            except DatabaseUnavailable as exc:
                self._failed(index)
                refused = exc
                continue
            except CONNECTION_ERRORS as exc:
                # Down, frozen (the timeout), or a standby where read-write was asked for
                # (TargetServerAttributeNotMatched, an InternalClientError).
                self._failed(index)
                last = exc
                continue
            except BaseException:
                # Cancelled (the pool's acquire timeout) while this host kept us waiting: the
                # next attempt starts with the next host.
                self._failed(index)
                raise
            self._start = index
            return admitted
        # A stale primary's refusal says more than the other hosts' silence.
        if refused is not None:
            raise refused
        assert last is not None
        raise last

    def _failed(self, index: int) -> None:
        if self._start == index:
            self._start = (index + 1) % len(self.hosts)

    async def _admit(self, conn: asyncpg.Connection, index: int | None) -> asyncpg.Connection:
        """Record the server's timeline on the connection; refuse a stale primary."""
        try:
            timeline = await read_timeline(conn)
        except BaseException:
            conn.terminate()
            raise
        record_timeline(conn, timeline)
        reason = self.stale(timeline)
        if reason is not None:
            conn.terminate()
            where = "" if index is None else f" ({self.hosts[index][0]}:{self.hosts[index][1]})"
            log.warning("%s%s", reason, where)
            raise DatabaseUnavailable(reason)
        self.observe(timeline)
        return conn
