"""The daily digest as a fan-out job: the same emails as `daily-digest`
(cronlock/demo/digest.py), planned as ranges of 10,000 user ids and worked by every instance at
once. Each range is one item, one transaction that stamps its due users and queues their
outbox rows together: a range committed is mailed once, a range whose worker died is worked
again from nothing, and no user is mailed twice for a slot.

Load it instead of the other digests (CRON_JOBS=cronlock.demo.fanout,cronlock.housekeeping):
all three queue the same digest, and whichever ran first for a slot would leave the others
nobody to mail. It shares the demo's users table (the same migrations folder).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, Field

from cronlock.core.fanout import DoneContext, ItemContext
from cronlock.core.jobs import JobContext, job
from cronlock.delivery import outbox
from cronlock.demo.digest import PER_SLOT_SQL, QUEUED_SQL, SENDER
from cronlock.sql import qualify

CRONLOCK_MIGRATIONS = "migrations"

# One range's due users, stamped and queued as the one-transaction digest does (see
# cronlock/demo/digest.py for the key, the subject and why a plain INSERT).
RANGE_SQL = f"""
WITH {PER_SLOT_SQL}, due AS (
    UPDATE cronlock_demo.users
    SET last_digest_at = greatest(now(), $1::timestamptz)
    WHERE id >= $4 AND id < $5
      AND digest_enabled AND (last_digest_at IS NULL OR last_digest_at < $1)
    RETURNING id, email
), {QUEUED_SQL}
SELECT count(*) FROM queued
"""

BOUNDS_SQL = "SELECT min(id) AS lo, max(id) AS hi FROM cronlock_demo.users"


class Ranges(BaseModel):
    size: int = Field(default=10_000, ge=1, le=1_000_000)


@job(
    "fanout-digest",
    schedule="0 7 * * *",
    tz="UTC",
    timeout=300,
    grace=1800,
    params=Ranges,
    fanout=True,
)
async def fanout_digest(ctx: JobContext) -> AsyncIterator[dict[str, int]]:
    """Queue the daily digest in ranges of user ids, worked by every instance at once."""
    size = ctx.params.size if ctx.params is not None else Ranges().size
    row = await ctx.conn.fetchrow(BOUNDS_SQL)
    if row is None or row["lo"] is None:
        return
    for start in range(int(row["lo"]), int(row["hi"]) + 1, size):
        yield {"from": start, "to": start + size}


@fanout_digest.each(timeout=120, retries=3)
async def digest_range(ctx: ItemContext) -> int:
    """One range of users: stamped and queued in the item's transaction."""
    assert ctx.slot is not None
    queued = await ctx.conn.fetchval(
        qualify(RANGE_SQL, ctx.schema),
        ctx.slot,
        ctx.job.name,
        SENDER,
        ctx.item["from"],
        ctx.item["to"],
    )
    if queued:
        await outbox.notify(ctx.conn, ctx.schema)
    return int(queued)


@fanout_digest.done
async def digest_done(ctx: DoneContext) -> dict[str, Any]:
    """Once every range is settled: what was queued for the slot, in the run's result."""
    assert ctx.slot is not None
    queued = await ctx.conn.fetchval(
        qualify(
            "SELECT count(*) FROM {schema}.email_outbox WHERE job = $1 AND slot = $2",
            ctx.schema,
        ),
        ctx.job.name,
        ctx.slot,
    )
    return {"queued": int(queued), "ranges": ctx.total, "failed_ranges": ctx.failed}
