"""SQL text that names cronlock's schema, what that schema's name may be, and the connection
type queries take.

cronlock's statements are written with a `{schema}` placeholder for the schema they live in
(DB_SCHEMA): identifiers cannot be bind parameters, and nothing may rely on `search_path`
(a job may change it, and PgBouncer shares sessions between clients).
"""

from __future__ import annotations

import functools
import re

import asyncpg

# A connection as queries see it: a plain one (CLI, LISTEN) or one borrowed from the pool
# (cronlock/db/pool.py).
Conn = asyncpg.Connection | asyncpg.pool.PoolConnectionProxy

# Unquoted-identifier characters only, so the name reads the same in SQL, in a lock key and in
# a NOTIFY channel; at most 56 bytes so that `<schema>.outbox` fits PostgreSQL's 63-byte names.
SCHEMA_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,55}$")


def check_name(name: str) -> str:
    """`name` if it can be cronlock's schema, else a ValueError saying why."""
    if not SCHEMA_PATTERN.match(name):
        raise ValueError(
            "must start with a letter or '_' and hold only letters, digits and '_' "
            "(at most 56 characters)"
        )
    lowered = name.lower()
    if lowered.startswith("pg_") or lowered in ("public", "information_schema"):
        raise ValueError(f"{name!r} is not a schema of cronlock's own; pick another name")
    return name


def quote(name: str) -> str:
    """A double-quoted identifier (quoting keeps the name's case exactly)."""
    return '"' + name.replace('"', '""') + '"'


@functools.cache
def qualify(sql: str, schema: str) -> str:
    """`sql` with `{schema}` replaced by the quoted schema; cached, as it runs per statement."""
    return sql.replace("{schema}", quote(schema))
