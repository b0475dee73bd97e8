"""The transaction-level advisory lock and the derivation of its key: nothing else.

Keys are `hashtextextended('<DB_SCHEMA>:<job>', LOCK_NAMESPACE)`, computed by the database
in the lock statement; a keyed job's run locks `'<DB_SCHEMA>:<job>:<key>'` (the key's canonical
text). Neither a schema nor a job name has a ':', so the first two colons always tell schema,
job and key apart, and no keyed text is ever a key-less job's. Advisory locks belong to the
whole database, not to a schema, so the schema is part of every key: two deployments with
different schemas in one database never share a lock. cronlock's own locks (migrations,
catch-up) are `'<DB_SCHEMA>::<what>'`: a job name has no ':', so no job can take one of them.

The hash is mirrored here (PostgreSQL's `hash_bytes_extended`, the little-endian variant every
mainstream server runs) so that colliding job names are refused at start-up even while the
database is down, and so that `pg_locks` rows can be mapped back to job names; `verify_keys`
checks the mirror against the server once it is reachable.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import asyncpg

from cronlock.db import literal
from cronlock.sql import Conn, qualify

_MASK = 0xFFFFFFFF


def _rot(x: int, k: int) -> int:
    return ((x << k) | (x >> (32 - k))) & _MASK


def _mix(a: int, b: int, c: int) -> tuple[int, int, int]:
    a = (a - c) & _MASK
    a ^= _rot(c, 4)
    c = (c + b) & _MASK
    b = (b - a) & _MASK
    b ^= _rot(a, 6)
    a = (a + c) & _MASK
    c = (c - b) & _MASK
    c ^= _rot(b, 8)
    b = (b + a) & _MASK
    a = (a - c) & _MASK
    a ^= _rot(c, 16)
    c = (c + b) & _MASK
    b = (b - a) & _MASK
    b ^= _rot(a, 19)
    a = (a + c) & _MASK
    c = (c - b) & _MASK
    c ^= _rot(b, 4)
    b = (b + a) & _MASK
    return a, b, c


def _final(a: int, b: int, c: int) -> tuple[int, int, int]:
    c ^= b
    c = (c - _rot(b, 14)) & _MASK
    a ^= c
    a = (a - _rot(c, 11)) & _MASK
    b ^= a
    b = (b - _rot(a, 25)) & _MASK
    c ^= b
    c = (c - _rot(b, 16)) & _MASK
    a ^= c
    a = (a - _rot(c, 4)) & _MASK
    b ^= a
    b = (b - _rot(a, 14)) & _MASK
    c ^= b
    c = (c - _rot(b, 24)) & _MASK
    return a, b, c


def hashtextextended(text: str, seed: int) -> int:
    """PostgreSQL's `hashtextextended(text, seed)` for a deterministic collation, as a bigint."""
    data = text.encode()
    length = len(data)
    a = b = c = (0x9E3779B9 + length + 3923095) & _MASK
    useed = seed & 0xFFFFFFFFFFFFFFFF
    if useed:
        # The seed is hashed as a 12-byte chunk padded with zeroes.
        a = (a + (useed >> 32)) & _MASK
        b = (b + (useed & _MASK)) & _MASK
        a, b, c = _mix(a, b, c)
    pos = 0
    while length - pos >= 12:
        a = (a + int.from_bytes(data[pos : pos + 4], "little")) & _MASK
        b = (b + int.from_bytes(data[pos + 4 : pos + 8], "little")) & _MASK
        c = (c + int.from_bytes(data[pos + 8 : pos + 12], "little")) & _MASK
        a, b, c = _mix(a, b, c)
        pos += 12
    tail = data[pos:]
    # The lowest byte of c is reserved for the length, so c's tail bytes start one byte up.
    a = (a + int.from_bytes(tail[0:4], "little")) & _MASK
    b = (b + int.from_bytes(tail[4:8], "little")) & _MASK
    c = (c + (int.from_bytes(tail[8:11], "little") << 8)) & _MASK
    a, b, c = _final(a, b, c)
    value = (b << 32) | c
    return value - (1 << 64) if value >= 1 << 63 else value


@dataclass(frozen=True, slots=True)
class LockKey:
    """A 64-bit advisory key as `pg_locks` shows it: classid = high half, objid = low half."""

    key: int

    @property
    def classid(self) -> int:
        return (self.key >> 32) & _MASK

    @property
    def objid(self) -> int:
        return self.key & _MASK

    @classmethod
    def from_pg_locks(cls, classid: int, objid: int) -> LockKey:
        value = (classid << 32) | objid
        return cls(value - (1 << 64) if value >= 1 << 63 else value)


# How `pg_locks` shows cronlock's locks: advisory, the 64-bit form (objsubid = 1; 2 is the
# two-int4 form, which cronlock never takes), in this database only (advisory locks of every
# database share one table). The statements that read it use these fragments, with `l` as
# pg_locks; the probe function (migration 0003) spells the same out in PL/pgSQL.
PG_LOCKS_OURS = (
    "l.locktype = 'advisory' AND l.objsubid = 1"
    " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)
# A row's key as `hashtextextended` returns it: classid is the high half, objid the low one.
PG_LOCKS_KEY = "((l.classid::bigint << 32) | l.objid::bigint)"
# A job's key in SQL (see `lock_text`), from the schema, the job name, the run's key (NULL for
# a key-less job: `':' || NULL` is NULL, so coalesce leaves the text as before keys) and the
# namespace.
JOB_KEY_SQL = (
    "hashtextextended({schema} || ':' || {job} || coalesce(':' || {key}, ''), {namespace})"
)

# The article's diagnostic: advisory locks joined to the sessions that hold (or wait for) them.
HELD_SQL = f"""
SELECT l.pid, l.classid, l.objid, l.granted, a.application_name, a.state,
       extract(epoch FROM clock_timestamp() - a.xact_start)::float8 AS held_for
FROM pg_locks l
JOIN pg_stat_activity a ON a.pid = l.pid
WHERE {PG_LOCKS_OURS}
ORDER BY a.xact_start NULLS LAST, l.pid
"""


async def held_locks(conn: Conn) -> list[asyncpg.Record]:
    """Every advisory lock of this database (held or waited for), oldest holder first."""
    return await conn.fetch(HELD_SQL)


def lock_key(name: str, namespace: int) -> LockKey:
    """The key of a lock name (see `lock_text` and `internal_lock`)."""
    return LockKey(hashtextextended(name, namespace))


def lock_text(schema: str, job: str, key: str | None = None) -> str:
    """The text a job's lock key is hashed from; a keyed job's run adds its key's text.

    A key-less job's text is what it always was, so an upgrade changes no lock. Different
    texts can still hash alike: among n distinct texts the odds that any two share a 64-bit key
    are about n**2 / 2**65 (the birthday bound: 1 in 34 million for a million keys). A
    collision only makes two keys take turns ("already running"), never one run twice.
    """
    return f"{schema}:{job}" if key is None else f"{schema}:{job}:{key}"


def internal_lock(schema: str, what: str) -> str:
    """The text of one of cronlock's own locks (`migrate`, `catch-up`)."""
    return f"{schema}::{what}"


async def verify_keys(conn: Conn, names: list[str], namespace: int) -> dict[str, int]:
    """The server's keys for lock `names` (`lock_text` texts); differs from `lock_key` only on
    a big-endian server."""
    rows = await conn.fetch(
        "SELECT n, hashtextextended(n, $2) AS k FROM unnest($1::text[]) AS n", names, namespace
    )
    return {r["n"]: r["k"] for r in rows}


def timeouts_sql(timeout: str, check: str, transaction_timeout: str | None) -> str:
    """The lock transaction's timeouts as select-list items (SET takes no bind parameters;
    set_config(..., true) is its transaction-local form). Each argument is SQL, a parameter of
    the lock statement; `transaction_timeout` exists from PostgreSQL 17 (None before). The
    session reset and the fan-out claim set the same through migration 0021's
    `set_timeouts`."""
    items = [
        f"set_config('statement_timeout', {timeout}, true)",
        f"set_config('idle_in_transaction_session_timeout', {timeout}, true)",
        f"set_config('client_connection_check_interval', {check}, true)",
    ]
    if transaction_timeout is not None:
        # Off first: setting it while its timer runs (a role's or database's own default,
        # started at BEGIN) keeps that timer; off stops it, and the new value starts afresh.
        items.append("set_config('transaction_timeout', '0', true)")
        items.append(f"set_config('transaction_timeout', {transaction_timeout}, true)")
    return ",\n       ".join(items)


# One statement, one round trip: the transaction's timeouts, then the try-lock, plus what the
# runner needs to decide: the database's clock, whether this is a standby, and the backend
# pid that holds the lock (PgBouncer hides the real one from the client).
TRY_LOCK_SQL = """
SELECT {timeouts},
       pg_try_advisory_xact_lock(hashtextextended($1, $2)) AS locked,
       now() AS db_now,
       pg_is_in_recovery() AS standby,
       pg_backend_pid() AS backend_pid
"""


def try_lock_sql(server_version: int) -> str:
    """The lock statement for this server."""
    transaction_timeout = "$3" if server_version >= 170000 else None
    return TRY_LOCK_SQL.format(timeouts=timeouts_sql("$3", "$4", transaction_timeout))


def ms(seconds: float) -> int:
    """Seconds as whole milliseconds, at least 1 (0 turns a PostgreSQL timeout off)."""
    return max(1, int(seconds * 1000))


def ms_setting(seconds: float) -> str:
    """Seconds as a timeout setting's value: '1500ms'."""
    return f"{ms(seconds)}ms"


def interval_setting(seconds: float) -> str:
    """Seconds as `client_connection_check_interval`'s value, where 0 is kept: it turns the
    check off (the only value a server without the check accepts)."""
    return f"{int(seconds * 1000)}ms"


def timeout_args(
    db_timeout: float, client_check_interval: float, server_version: int
) -> tuple[str, str, int | None]:
    """The arguments of migration 0021's `set_timeouts` and `session_reset` (and of the fan-out
    claim and mark, which call them): statement and idle timeout, client check interval, and
    the `transaction_timeout` budget in ms on PostgreSQL 17+ (None before)."""
    return (
        ms_setting(db_timeout),
        interval_setting(client_check_interval),
        ms(db_timeout) if server_version >= 170000 else None,
    )


async def try_lock(
    conn: Conn,
    name: str,
    namespace: int,
    *,
    db_timeout: float,
    client_check_interval: float,
    server_version: int,
) -> asyncpg.Record:
    """Take the job's transaction-level lock without waiting; the caller's transaction is open.

    Returns a record with `locked`, `db_now`, `standby` and `backend_pid`.
    """
    row = await conn.fetchrow(
        try_lock_sql(server_version),
        name,
        namespace,
        ms_setting(db_timeout),
        interval_setting(client_check_interval),
    )
    assert row is not None
    return row


# Run inside the lock transaction, after the job and before its ledger row: undo the session
# state a job may have left on the connection (a plain SET, a SET ROLE or SET SESSION
# AUTHORIZATION, a session advisory lock, a LISTEN, a WITH HOLD cursor) and set the timeouts
# again, `transaction_timeout` to what is left of its budget. Committed with the run, it cannot
# outlive it: through PgBouncer the server connection goes to other clients next, and the
# pool's own reset (cronlock/db/pool.py) is not run per release. The list is the
# `session_reset` function's (migration 0021), which a fan-out item's mark calls too; the role
# comes back first, here, as a role the job switched to may not use cronlock's schema.
# Literals, not parameters: a multi-statement string goes as one simple query, one round
# trip. Not undone: temporary tables (a job creates them ON COMMIT DROP) and SQL-level PREPARE.
RESET_SESSION_SQL = """
RESET SESSION AUTHORIZATION;
RESET ROLE;
SELECT {schema}.session_reset({args})
"""


async def reset_session(
    conn: Conn,
    schema: str,
    *,
    db_timeout: float,
    client_check_interval: float,
    server_version: int,
) -> None:
    """Clear what the job may have set for the session; the caller's transaction is open."""
    timeout, check, transaction_ms = timeout_args(db_timeout, client_check_interval, server_version)
    args = literal.join(literal.text(timeout), literal.text(check), literal.integer(transaction_ms))
    await conn.execute(qualify(RESET_SESSION_SQL, schema).format(args=args))


# A read-only look, outside any transaction, before the real attempt: what time is it on the
# database, is the job's lock held right now (by anyone), and which is the newest slot that
# already succeeded? It answers the common skips in one statement and never takes the lock
# itself: a probe that briefly held it could make the one real attempt fail, and then nobody
# would run the job. The statements live in the `<DB_SCHEMA>.probe` function (migration
# 0003), whose plans the server keeps per connection: planning them at every trigger cost
# more than running them (bench/trigger.py). A job without a schedule has no slot to be done:
# the ledger is not read.
# Migration 0005 gave the function the run's key (the ledger's done slot is per key); its
# five-argument form stays for instances of the previous release during a rolling deploy.
# Migration 0008 added `with_lease` (a lease job's run is running while its lease is live) and
# whether the job is paused (cronlock/core/pause.py), in an eight-argument form.
PROBE_SQL = (
    "SELECT db_now, standby, done_slot, running, paused"
    " FROM {schema}.probe($1, $2, $3, $4, $5, $6, $7, true)"
)


async def probe(
    conn: Conn,
    schema: str,
    name: str,
    key: LockKey,
    *,
    scheduled: bool = True,
    done_hint: datetime | None = None,
    run_key: str | None = None,
    lease: bool = False,
) -> asyncpg.Record:
    """Returns `db_now`, `standby`, `done_slot` (None without a ledger look), `running`
    (the lock held, or for a lease job (`lease`) its live lease) and `paused` (when true,
    `done_slot` and `running` are None: nothing else was read).

    `running` is None when `done_hint` equals `done_slot`: the slot the caller expects is done
    (if the database's clock agrees), so the lock table was not read.
    """
    row = await conn.fetchrow(
        qualify(PROBE_SQL, schema),
        name,
        run_key,
        key.classid,
        key.objid,
        scheduled,
        done_hint,
        lease,
    )
    assert row is not None
    return row


# The probe's common answer in one round trip: "already done" for the slot the caller expects
# (`slot`, done by the ledger when this instance last looked), the database's clock inside that
# slot's window (`window`, cronlock/core/schedule.py `slot_window`), not paused, not a standby.
# Sent with the simple protocol, its values written in (cronlock/db/literal.py): the probe with
# bind parameters takes two round trips, and a skip is little else. Its answer is the command
# tag: one row for done; no row says nothing, the full probe tells. For a job without a key:
# a run's key is a caller's, and stays a bind parameter. When the ledger's slot is not the
# hinted one the function looks at the lock table here and the full probe again, once (the
# caller forgets the slot then).
DONE_SQL = """
SELECT 1 FROM {schema}.probe({args}) AS p
WHERE NOT p.standby AND NOT p.paused
  AND p.done_slot OPERATOR(pg_catalog.=) {slot}
  AND p.db_now OPERATOR(pg_catalog.>=) {start} AND p.db_now OPERATOR(pg_catalog.<) {end}
"""


def done_question(
    schema: str,
    name: str,
    key: LockKey,
    *,
    slot: datetime,
    window: tuple[datetime, datetime],
    lease: bool = False,
) -> str:
    """DONE_SQL for `slot` of job `name`: the same text for every trigger of that slot, so
    the caller writes it once, when it sees the slot done."""
    args = literal.join(
        literal.text(name),
        "NULL",  # the run's key: none
        literal.oid(key.classid),
        literal.oid(key.objid),
        literal.boolean(True),
        literal.timestamptz(slot),
        literal.boolean(lease),
        literal.boolean(True),
    )
    return qualify(DONE_SQL, schema).format(
        args=args,
        slot=literal.timestamptz(slot),
        start=literal.timestamptz(window[0]),
        end=literal.timestamptz(window[1]),
    )


async def done_already(conn: Conn, question: str) -> bool:
    """Whether the slot `question` (`done_question`) names is done and is the slot of the
    database's clock now; False says nothing more."""
    return await literal.selects_one(conn, question)
