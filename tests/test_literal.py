"""cronlock/db/literal.py: values written into SQL text come back from the server as they
went in, whatever they hold and whatever `standard_conforming_strings` says."""

from __future__ import annotations

import json
from typing import Any

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
async def test_text_and_jsonb_round_trip(db: asyncpg.Connection, conforming: str) -> None:
    await db.execute(f"SET standard_conforming_strings = {conforming}")
    for value in TEXTS:
        assert await db.fetchval(f"SELECT {literal.text(value)}") == value
        document: Any = {"v": value, "n": [1, 2.5, None, True]}
        back = await db.fetchval(f"SELECT ({literal.jsonb(document)})::text")
        assert json.loads(back) == document
    assert await db.fetchval(f"SELECT {literal.text(None)} IS NULL")
    assert await db.fetchval(f"SELECT {literal.jsonb(None)} IS NULL")


async def test_integer(db: asyncpg.Connection) -> None:
    for value in (0, -1, 2**62, None):
        assert await db.fetchval(f"SELECT {literal.integer(value)}::bigint") == value
    for bad in (True, 1.5, "1"):
        with pytest.raises(TypeError):
            literal.integer(bad)  # type: ignore[arg-type]
