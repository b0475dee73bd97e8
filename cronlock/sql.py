"""SQL text that names cronlock's schema.

cronlock's statements are written with a `{schema}` placeholder for the schema they live in
(DB_SCHEMA): identifiers cannot be bind parameters, and nothing may rely on `search_path`
(a job may change it, and PgBouncer shares sessions between clients).
"""

from __future__ import annotations

import functools


def quote(name: str) -> str:
    """A double-quoted identifier (quoting keeps the name's case exactly)."""
    return '"' + name.replace('"', '""') + '"'


@functools.cache
def qualify(sql: str, schema: str) -> str:
    """`sql` with `{schema}` replaced by the quoted schema; cached, as it runs per statement."""
    return sql.replace("{schema}", quote(schema))
