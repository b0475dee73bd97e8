"""The article's daily digest, done set-based: one statement stamps the due users and queues
their emails in the job's own transaction, so a rollback takes both back and a repeat finds
nobody due (and the outbox's unique (job, slot, user) index could not take a second row anyway).
"""

from __future__ import annotations

from app.jobs import JobContext, job
from app.outbox import NOTIFY_SQL

# Due: digest enabled and no digest since this slot began. The subject and body are frozen in
# the outbox row now, so every delivery attempt sends the same bytes.
DIGEST_SQL = """
WITH due AS (
    UPDATE users
    SET last_digest_at = now()
    WHERE digest_enabled AND (last_digest_at IS NULL OR last_digest_at < $1)
    RETURNING id, email
), queued AS (
    INSERT INTO email_outbox (idempotency_key, job, slot, user_id, sender, recipient,
                              subject, body)
    SELECT format('%s:%s:%s', $2::text, extract(epoch FROM $1::timestamptz)::bigint, due.id),
           $2, $1, due.id, $3, due.email,
           'Your daily digest for ' || to_char($1::timestamptz AT TIME ZONE 'UTC', 'YYYY-MM-DD'),
           format(E'Hello %s,\\n\\nhere is what happened since your last digest.\\n', due.email)
    FROM due
    ON CONFLICT (job, slot, user_id) DO NOTHING
    RETURNING 1
)
SELECT count(*) FROM queued
"""

SENDER = "cronlock <digest@example.com>"


@job("daily-digest", schedule="0 7 * * *", tz="UTC", timeout=300, grace=1800)
async def daily_digest(ctx: JobContext) -> int:
    """Queue one digest email per enabled user who has not had one for this slot."""
    assert ctx.slot is not None
    queued = await ctx.conn.fetchval(DIGEST_SQL, ctx.slot, ctx.job.name, SENDER)
    if queued:
        # Delivered at commit, so senders wake up only for emails that really exist.
        await ctx.conn.execute(NOTIFY_SQL)
    return int(queued)
