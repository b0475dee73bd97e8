"""cronlock/db/literal.py: values written into SQL text come back from the server as they
went in, whatever they hold and whatever `standard_conforming_strings` says."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import asyncpg
import pytest

from cronlock.db import literal

TEXTS = [
    "",
    "plain",
    "it's",
    "'; DROP TABLE x; --",
    "back\\slash \\' E'\\x41'",
    "$$ dollar $tag$",
    "line\nbreak\ttab",
    "Grüße, 東京, 🙂",
]


@pytest.mark.parametrize("conforming", ["on", "off"])
async def test_text_round_trip(db: asyncpg.Connection, conforming: str) -> None:
    await db.execute(f"SET standard_conforming_strings = {conforming}")
    for value in TEXTS:
        assert await db.fetchval(f"SELECT {literal.text(value)}") == value
    assert await db.fetchval(f"SELECT {literal.text(None)} IS NULL")


async def test_numbers_oids_booleans_and_instants(db: asyncpg.Connection) -> None:
    for value in (0, -1, 2**62, None):
        assert await db.fetchval(f"SELECT {literal.integer(value)}::bigint") == value
    for bad in (True, 1.5, "1"):
        with pytest.raises(TypeError):
            literal.integer(bad)  # type: ignore[arg-type]
    for number in (0, 2**31 - 1, 2**31, 2**32 - 1):  # a lock key's halves, unsigned
        assert await db.fetchval(f"SELECT {literal.oid(number)}") == number
    assert await db.fetchval(f"SELECT {literal.boolean(True)}, {literal.boolean(False)}") is True
    assert await db.fetchval(f"SELECT NOT {literal.boolean(False)}") is True
    await db.execute("SET DateStyle = 'SQL, DMY'")  # the input is ISO 8601 whatever this says
    await db.execute("SET TimeZone = 'Asia/Kolkata'")
    for instant in (
        datetime(2027, 3, 28, 1, 0, 0, 123456, tzinfo=UTC),
        datetime(2026, 12, 4, 13, 0, tzinfo=timezone(timedelta(hours=-3, minutes=-30))),
    ):
        assert await db.fetchval(f"SELECT {literal.timestamptz(instant)}") == instant
    assert await db.fetchval(f"SELECT {literal.timestamptz(None)} IS NULL")
    with pytest.raises(ValueError, match="naive"):
        literal.timestamptz(datetime(2026, 1, 1))


async def test_selects_one_reads_the_command_tag(db: asyncpg.Connection) -> None:
    assert await literal.selects_one(db, "SELECT 1 WHERE true")
    assert not await literal.selects_one(db, "SELECT 1 WHERE false")
    assert not await literal.selects_one(db, "SELECT 1 FROM generate_series(1, 2)")
