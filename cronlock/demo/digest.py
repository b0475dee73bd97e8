"""The article's daily digest, done set-based: one statement stamps the due users and queues
their emails in the job's own transaction, so a rollback takes both back and a repeat finds
nobody due.
"""

from __future__ import annotations

from cronlock.core.jobs import JobContext, job
from cronlock.delivery import outbox
from cronlock.sql import qualify

# The demo's own tables (cronlock_demo.users), made by its migrations when it is loaded.
CRONLOCK_MIGRATIONS = "migrations"

# Due: digest enabled and no digest since this slot began (a digest stamps at least its
# slot). The subject and body are frozen in the outbox row now, so every delivery attempt
# sends the same bytes; what is the same for every row (the key's prefix, the subject) is
# computed once, not per user.
#
# A plain INSERT, not ON CONFLICT DO NOTHING (which costs a speculative insertion per row,
# about 15 % of the statement): the due filter and the job's lock already keep a second row
# for a (job, slot, user) out, and the unique index on it stays the last guard (the key,
# `<job>:<epoch>:<user>`, is derived from it, so it is unique too and needs no index of its
# own: migration 0012). A state that would break it (`last_digest_at` moved back by hand)
# fails the run, loudly and with nothing sent, rather than skipping users in silence.
# The parts of the statement the chunked digest (cronlock/demo/chunked.py) shares: the per-slot
# constants, and the queueing of the `due` users' emails.
PER_SLOT_SQL = """
per_slot AS (
    SELECT format('%s:%s:', $2::text, extract(epoch FROM $1::timestamptz)::bigint) AS key,
           'Your daily digest for '
               || to_char($1::timestamptz AT TIME ZONE 'UTC', 'YYYY-MM-DD') AS subject
)"""
QUEUED_SQL = """
queued AS (
    INSERT INTO {schema}.email_outbox (idempotency_key, job, slot, user_id, sender, recipient,
                              subject, body)
    SELECT per_slot.key || due.id, $2, $1, due.id, $3, due.email, per_slot.subject,
           'Hello ' || due.email || E',\n\nhere is what happened since your last digest.\n'
    FROM due CROSS JOIN per_slot
    RETURNING user_id
)"""
DIGEST_SQL = f"""
WITH {PER_SLOT_SQL}, due AS (
    UPDATE cronlock_demo.users
    -- Never before the slot: a run triggered a little early (within the job's early
    -- tolerance) would otherwise leave its users due for the same slot.
    SET last_digest_at = greatest(now(), $1::timestamptz)
    WHERE digest_enabled AND (last_digest_at IS NULL OR last_digest_at < $1)
    RETURNING id, email
), {QUEUED_SQL}
SELECT count(*) FROM queued
"""

SENDER = "cronlock <digest@example.com>"


@job("daily-digest", schedule="0 7 * * *", tz="UTC", timeout=300, grace=1800)
async def daily_digest(ctx: JobContext) -> int:
    """Queue one digest email per enabled user who has not had one for this slot."""
    assert ctx.slot is not None
    queued = await ctx.conn.fetchval(
        qualify(DIGEST_SQL, ctx.schema), ctx.slot, ctx.job.name, SENDER
    )
    if queued:
        # Delivered at commit, so senders wake up only for emails that really exist.
        await outbox.notify(ctx.conn, ctx.schema)
    return int(queued)
