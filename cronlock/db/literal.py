"""Values written into SQL text, for the few statements cronlock sends with the simple query
protocol: one round trip, where a statement with bind parameters takes two without a client
statement cache (asyncpg prepares it, Parse and Describe, then binds and executes it), and
the client keeps no cache behind PgBouncer. Only statements whose answer is their command tag
("SELECT 1") can go this way: the simple protocol's rows do not reach the caller.

Only cronlock's own values go this way (ids, counts, settings, a job's name from its code, the
instance's name): never what a job returned or a caller sent, which stay bind parameters, out
of statement text that the server may log or show in pg_stat_activity. Text is written as
hexadecimal digits the server decodes (`decode(..., 'hex')`), so nothing in it can be read as
SQL, whatever `standard_conforming_strings` says; numbers are written by Python's `int`.
"""

from __future__ import annotations

from datetime import datetime

from cronlock.sql import Conn


def integer(value: int | None) -> str:
    """An integer (or NULL) as SQL; bool is refused (it is an int in Python, not in SQL)."""
    if value is None:
        return "NULL"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"not an integer: {value!r}")
    return str(int(value))


def boolean(value: bool) -> str:
    return "true" if value else "false"


def oid(value: int) -> str:
    """An oid (an unsigned 32-bit number, as a lock key's halves are)."""
    return f"{integer(value)}::pg_catalog.oid"


def timestamptz(value: datetime | None) -> str:
    """An aware datetime (or NULL) as timestamptz: ISO 8601, which the server reads whatever
    its DateStyle."""
    if value is None:
        return "NULL"
    if value.tzinfo is None:
        raise ValueError(f"a naive datetime has no instant: {value!r}")
    return f"{text(value.isoformat())}::pg_catalog.timestamptz"


def text(value: str | None) -> str:
    """A string (or NULL) as a text expression: its UTF-8 bytes in hexadecimal."""
    if value is None:
        return "NULL"
    digits = value.encode().hex()
    return f"pg_catalog.convert_from(pg_catalog.decode('{digits}', 'hex'), 'UTF8')"


def join(*values: str) -> str:
    """Literals as a function call's argument list."""
    return ", ".join(values)


async def selects_one(conn: Conn, sql: str) -> bool:
    """Run `sql`, a SELECT written with these literals, in one round trip (the simple
    protocol): whether it gave exactly one row, the only answer its command tag carries."""
    return await conn.execute(sql) == "SELECT 1"
