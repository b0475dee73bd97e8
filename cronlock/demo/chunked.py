"""The daily digest as a lease job, for a user table too big for one transaction: the same
emails as `daily-digest` (cronlock/demo/digest.py), queued in chunks of users in id order, each
chunk one fenced step that commits its users' stamps, their outbox rows and the checkpoint
(the last user id) together. A run that dies half way is taken over by another instance and
resumes after the last committed chunk; no user is mailed twice for a slot.

Load it instead of the one-transaction digest
(CRON_JOBS=cronlock.demo.chunked,cronlock.housekeeping): both queue the same digest, and
whichever ran first for a slot would leave the other nobody to mail. It shares the demo's users
table (the same migrations folder, which makes the table only once).
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from cronlock.core.jobs import JobContext, job
from cronlock.delivery import outbox
from cronlock.demo.digest import PER_SLOT_SQL, QUEUED_SQL, SENDER
from cronlock.sql import qualify

CRONLOCK_MIGRATIONS = "migrations"

# One chunk: the next `$5` due users after the checkpoint's id, stamped and queued as the
# one-transaction digest does (see cronlock/demo/digest.py for the key, the subject and why a
# plain INSERT), returning how many were queued and the chunk's last id. The primary key
# walks the chunks; the due filter skips users a previous attempt already stamped.
CHUNK_SQL = f"""
WITH {PER_SLOT_SQL}, chunk AS (
    SELECT id FROM cronlock_demo.users
    WHERE id > $4 AND digest_enabled AND (last_digest_at IS NULL OR last_digest_at < $1)
    ORDER BY id
    LIMIT $5
), due AS (
    UPDATE cronlock_demo.users AS u
    SET last_digest_at = greatest(now(), $1::timestamptz)
    FROM chunk WHERE u.id = chunk.id
    RETURNING u.id, u.email
), {QUEUED_SQL}
SELECT count(*) AS queued, max(user_id) AS last_id FROM queued
"""


class Chunks(BaseModel):
    chunk: int = Field(default=10_000, ge=1, le=1_000_000)


@job(
    "chunked-digest",
    schedule="0 7 * * *",
    tz="UTC",
    lease=30,
    timeout=4 * 3600,
    grace=1800,
    params=Chunks,
)
async def chunked_digest(ctx: JobContext) -> int:
    """Queue the daily digest in chunks of users, resuming after the last committed chunk."""
    assert ctx.slot is not None
    chunk = ctx.params.chunk if ctx.params is not None else Chunks().chunk
    checkpoint = ctx.checkpoint or {}
    last, total = int(checkpoint.get("last_id", 0)), int(checkpoint.get("queued", 0))
    while True:
        async with ctx.step() as conn:
            row = await conn.fetchrow(
                qualify(CHUNK_SQL, ctx.schema), ctx.slot, ctx.job.name, SENDER, last, chunk
            )
            assert row is not None
            if row["queued"]:
                last, total = int(row["last_id"]), total + int(row["queued"])
                ctx.checkpoint = {"last_id": last, "queued": total}
                ctx.progress = {"queued": total, "last_user_id": last}
                await outbox.notify(conn, ctx.schema)
        if not row["queued"]:
            return total
