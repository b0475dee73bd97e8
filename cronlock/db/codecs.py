"""The driver state cronlock's statements rely on: jsonb in and out as Python values, every
other type as asyncpg decodes it by default.

A connection cronlock uses is in this state whenever cronlock's code or a job's raw SQL runs on
it. SQLAlchemy's asyncpg dialect wants other codecs (json and jsonb as text it serialised
itself); cronlock/db/orm.py sets them only around the statements SQLAlchemy prepares and puts
these back at once, and a connection borrowed from a SQLAlchemy engine
(cronlock/db/engine.py) gets these on loan and the engine's back on return.
"""

from __future__ import annotations

import json

import asyncpg


async def set_ours(conn: asyncpg.Connection | asyncpg.pool.PoolConnectionProxy) -> None:
    """Put cronlock's codecs on a connection (no round trip: pg_catalog's types are known).
    Per connection, so a job's `select $1::jsonb` takes and gives Python values."""
    await conn.set_type_codec(
        "jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog", format="text"
    )


async def restore(
    conn: asyncpg.Connection | asyncpg.pool.PoolConnectionProxy, typename: str, schema: str
) -> None:
    """Give one type back the codec cronlock's statements expect."""
    if (typename, schema) == ("jsonb", "pg_catalog"):
        await set_ours(conn)
    else:
        await conn.reset_type_codec(typename, schema=schema)


async def set_ours_over(
    conn: asyncpg.Connection | asyncpg.pool.PoolConnectionProxy, types: list[tuple[str, str]]
) -> None:
    """Replace codecs another user of the connection set (`types`: (name, schema)) by ours."""
    for typename, schema in types:
        await restore(conn, typename, schema)
