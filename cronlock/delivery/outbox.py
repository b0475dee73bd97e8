"""The email outbox's queue: enqueue in the caller's transaction; claim with SKIP LOCKED; mark;
retry; the operator's operations (dead letters, requeue, stats, retention). The delivery loop
that drives them is cronlock/delivery/sender.py.

A job writes rows into `<DB_SCHEMA>.email_outbox` inside its own transaction, so a rollback
takes its emails back with everything else. Senders (one loop per instance, plus
`python -m cronlock outbox drain` processes) then deliver them:

1. **claim** up to a batch of due rows in one short statement: `FOR UPDATE SKIP LOCKED`, a
   lease (`locked_until`, also written to `next_attempt_at` so a row whose sender died is due
   again the moment the lease ends) and a fresh `claim_token`;
2. **send** each row outside any transaction, with the per-request timeout, the same
   idempotency key and the same bytes on every attempt;
3. **mark** it sent, due again later (exponential backoff with jitter, or the provider's
   Retry-After), or dead, in one short statement that only matches while `claim_token` is
   still ours: a sender whose lease ran out cannot overwrite the claim of the sender that
   took the row over.

Every time that matters (leases, due times, key age) is the database's clock. Delivery is
at-least-once towards the provider, and exactly-once where the provider honours the key.

With EMAIL_BATCH_SIZE above 1 the unit of delivery is a **batch** (`<DB_SCHEMA>.email_batch`):
`form_batches` groups due rows into batches and freezes each one's members, request bytes and
idempotency key in the same transaction that claims them; `claim_batches` takes batches that
are due again; `mark_batch` writes the batch's outcome and one outcome per member at once.

Long on purpose: it is the only module that speaks SQL for the outbox (CONVENTIONS.md), and its
statements fence each other: claim, mark, batches, dead letters, requeue and retention all match
on the same claim token and lease, and are read against one another.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from cronlock.db import pool as db
from cronlock.db.schema import notify_channel
from cronlock.delivery.mailer import (
    Email,
    batch_bytes,
    error_text,
    pg_text,
)
from cronlock.errors import CONNECTION_ERRORS, DatabaseUnavailable
from cronlock.settings import Settings
from cronlock.sql import qualify
from cronlock.tracing import traceparent

log = logging.getLogger("cronlock.outbox")

# The channel a committed enqueue notifies (`schema.notify_channel`: one per deployment);
# NOTIFY is delivered only at commit, so a sender never wakes up for rows it cannot see yet.
NOTIFY_SQL = "SELECT pg_notify($1, '')"

# How often a running sender deletes sent rows older than the retention (OUTBOX_RETENTION_DAYS).
PRUNE_INTERVAL = 3600.0
PRUNE_CHUNK = 5000

# For `requeue` callers without settings at hand; kept equal to the setting's default.
DEFAULT_RETRY_WINDOW: float = Settings.model_fields["outbox_retry_window"].default

# The longest `last_error` the outbox writes (a backend's own snippet is shorter).
MAX_ERROR = 1000


def unavailable(exc: BaseException) -> bool:
    """The database (or the way to it) failed, not the statement: the same write may succeed
    later. A value the driver cannot encode (asyncpg's client-side DataError: an InterfaceError
    and a ValueError) or the server refuses is the statement's fault and fails again however
    often it is tried."""
    if isinstance(exc, ValueError):
        return False
    return isinstance(exc, (*CONNECTION_ERRORS, DatabaseUnavailable))


Conn = db.Conn


# --- enqueue --------------------------------------------------------------------------------

# One statement: the row, and a notification only if a row went in. ON CONFLICT makes a repeat
# of the same (job, key, slot, user), or of the same idempotency key, a no-op instead of an
# error that would abort the caller's transaction. Only with both slot and user set does the
# first apply: NULLs are distinct in a unique index, so a job without a schedule (no slot)
# gets one row per call, as its runs are not once per anything. The second is checked by
# email_outbox_key for emails without a user or a slot only (migration 0012): an email with
# both has a key derived from its (job, key, slot, user), which the first already makes unique.
ENQUEUE_SQL = """
WITH queued AS (
    INSERT INTO {schema}.email_outbox (idempotency_key, job, key, slot, user_id, sender,
                                       recipient, subject, body, traceparent)
    VALUES (coalesce($1, gen_random_uuid()::text), $2, $3, $4, $5, $6, $7, $8, $9, $11)
    ON CONFLICT DO NOTHING
    RETURNING idempotency_key
)
SELECT idempotency_key, pg_notify($10, '') FROM queued
"""


def stable_key(
    schema: str,
    job: str,
    key: str | None,
    slot: datetime,
    identity: str,
    user_id: int | None = None,
) -> str:
    """The idempotency key of the email `identity` of a job's run for `slot` (and `key`), to
    `user_id` when the caller named the email itself: the same whenever that slot runs again,
    on this database or on the standby promoted after a failover that lost the first run's
    commit, so a provider that honours keys delivers it once. Readable job and slot, then a
    digest of everything (bounded length, no separator ambiguity whatever the key and identity
    hold). With the user among the facts, a key of an email with a user and a slot is unique
    wherever its (job, key, slot, user) is, which the once-per index guarantees."""
    facts_list: list[object] = [schema, job, key, slot.isoformat(), identity]
    if user_id is not None:
        facts_list.append(user_id)
    facts = json.dumps(facts_list)
    digest = hashlib.sha256(facts.encode()).hexdigest()[:32]
    return f"{job}:{int(slot.timestamp())}:{digest}"


async def notify(conn: Conn, schema: str) -> None:
    """Wake the senders once the caller's transaction commits (for a job that wrote outbox
    rows itself, set-based)."""
    await conn.execute(NOTIFY_SQL, notify_channel(schema))


async def enqueue(
    conn: Conn,
    *,
    schema: str,
    job: str,
    slot: datetime | None,
    user_id: int | None,
    recipient: str,
    subject: str,
    body: str,
    sender: str,
    key: str | None = None,
    identity: str | None = None,
) -> str | None:
    """Queue one email in the caller's transaction; it is sent only if that transaction commits.
    Returns its idempotency key, frozen in the row with the payload (None: the same email was
    queued already, and this call changed nothing).

    With a slot, the key is derived from (job, key, slot, identity, user): `identity` names the
    email among the run's emails to its user (the caller's choice: "invoice:42", "welcome"),
    `user:<id>` when not given. A re-run of the same slot (after a failover lost the first
    commit, say) then sends the same key. Without a slot (a job with no schedule, a manual run)
    or without an identity, nothing stable names the email: the database mints a random key,
    and an email whose first commit a failover lost goes out under a new one
    (docs/guarantees.md). Two emails of one run with the same identity and user are one email:
    the second enqueue is a no-op.
    """
    named_user = None
    if identity is None and user_id is not None:
        identity = f"user:{user_id}"
    elif user_id is not None:
        named_user = user_id  # "welcome" of two users is two emails, with two keys
    idempotency_key = (
        stable_key(schema, job, key, slot, identity, named_user)
        if slot is not None and identity is not None
        else None
    )
    queued: str | None = await conn.fetchval(
        qualify(ENQUEUE_SQL, schema),
        idempotency_key,
        job,
        key,
        slot,
        user_id,
        sender,
        recipient,
        subject,
        body,
        notify_channel(schema),
        # The queueing run's span (None unless it is traced), for the send's link.
        traceparent(),
    )
    return queued


# --- claim / mark / release -----------------------------------------------------------------

# The lease is also the next due time: a row whose sender vanished needs no sweeper, it simply
# becomes due again when the lease ends. `attempts` counts claims, so a row that crashes its
# sender every time still reaches max_attempts.
_CLAIM_SQL = """
WITH due AS (
    SELECT id
    FROM {schema}.email_outbox
    WHERE status = 'pending' AND next_attempt_at <= now() AND batch_id IS NULL{alone}
    ORDER BY next_attempt_at, id
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.email_outbox AS o
SET claim_token = $2,
    locked_until = clock_timestamp() + make_interval(secs => $3),
    next_attempt_at = clock_timestamp() + make_interval(secs => $3),
    attempts = o.attempts + 1
FROM due
WHERE o.id = due.id
RETURNING o.id, o.idempotency_key, o.sender, o.recipient, o.subject, o.body, o.attempts,
          o.created_at, extract(epoch FROM now() - o.key_created_at)::float8 AS key_age,
          o.traceparent
"""
CLAIM_SQL = _CLAIM_SQL.replace("{alone}", "")
# A batch sender's single claims: the rows it must not form into batches (FORM_SELECT_SQL takes
# the others), literally the predicate of the index email_outbox_due_alone.
CLAIM_ALONE_SQL = _CLAIM_SQL.replace("{alone}", " AND (attempts > 0 OR last_error IS NOT NULL)")

# Outcomes of claimed rows, many at once (each with the claim token it was sent under), in one
# statement that writes a row only while its claim is still that token. A retry that would
# fall after max_attempts or outside the key's retry window is dead instead, decided by the
# database's clock.
MARK_SQL = """
UPDATE {schema}.email_outbox AS o
SET status = CASE
        WHEN r.outcome = 'sent' THEN 'sent'
        WHEN r.outcome = 'dead' THEN 'dead'
        WHEN o.attempts >= $1 THEN 'dead'
        WHEN clock_timestamp() + make_interval(secs => r.delay)
             > o.key_created_at + make_interval(secs => $2) THEN 'dead'
        ELSE 'pending' END,
    sent_at = CASE WHEN r.outcome = 'sent' THEN clock_timestamp() END,
    provider_message_id = CASE WHEN r.outcome = 'sent' THEN r.message_id
                               ELSE o.provider_message_id END,
    last_error = CASE
        WHEN r.outcome = 'sent' THEN o.last_error
        WHEN r.outcome = 'dead' THEN r.error
        WHEN o.attempts >= $1 THEN r.error || ' (gave up after ' || o.attempts || ' attempts)'
        WHEN clock_timestamp() + make_interval(secs => r.delay)
             > o.key_created_at + make_interval(secs => $2)
            THEN r.error || ' (retry window ended)'
        ELSE r.error END,
    next_attempt_at = CASE WHEN r.outcome = 'retry'
                           THEN clock_timestamp() + make_interval(secs => r.delay)
                           ELSE o.next_attempt_at END,
    locked_until = NULL,
    claim_token = NULL
FROM unnest($3::uuid[], $4::bigint[], $5::text[], $6::float8[], $7::text[], $8::text[])
     AS r(token, id, outcome, delay, message_id, error)
WHERE o.id = r.id AND o.claim_token = r.token AND o.status = 'pending'
RETURNING o.id, o.status
"""

# Give claimed rows (or batches: the same columns) back before their lease ends (shutdown, or
# a lease too short to start a send). A claim never sent does not count as an attempt.
_RELEASE = """
UPDATE {{schema}}.{table}
SET next_attempt_at = now(), locked_until = NULL, claim_token = NULL,
    attempts = attempts - CASE WHEN $3 THEN 0 ELSE 1 END
WHERE id = ANY($1::bigint[]) AND claim_token = $2 AND status = 'pending'
"""
RELEASE_SQL = _RELEASE.format(table="email_outbox")


@dataclass(frozen=True, slots=True)
class Row:
    id: int
    email: Email
    attempts: int  # including this claim
    key_age: float  # seconds, by the database's clock at claim
    traceparent: str | None = None  # the queueing run's span, when it was traced


@dataclass(slots=True)
class Claim:
    token: uuid.UUID
    rows: list[Row]
    # A local, conservative end of the lease: taken before the claim statement was sent, so it
    # falls no later than the database's locked_until.
    deadline: float


@dataclass(frozen=True, slots=True)
class Mark:
    """What to write for one claimed row."""

    outcome: Literal["sent", "retry", "dead"]
    delay: float = 0.0
    message_id: str | None = None
    error: str | None = None


async def claim(
    conn: Conn, *, schema: str, limit: int, lease: float, batchable: bool = True
) -> Claim:
    """Claim up to `limit` due rows for `lease` seconds under a new claim token; with
    `batchable` False only rows that may not be formed into batches (a batch sender's)."""
    token = uuid.uuid4()
    started = time.monotonic()
    sql = CLAIM_SQL if batchable else CLAIM_ALONE_SQL
    records = await conn.fetch(qualify(sql, schema), limit, token, lease)
    rows = [
        Row(
            id=r["id"],
            email=Email(
                idempotency_key=r["idempotency_key"],
                sender=r["sender"],
                recipient=r["recipient"],
                subject=r["subject"],
                body=r["body"],
                created_at=r["created_at"],
            ),
            attempts=r["attempts"],
            key_age=r["key_age"],
            traceparent=r["traceparent"],
        )
        for r in records
    ]
    rows.sort(key=lambda row: row.id)
    return Claim(token=token, rows=rows, deadline=started + lease)


async def mark(
    conn: Conn,
    token: uuid.UUID,
    results: Sequence[tuple[int, Mark]],
    *,
    schema: str,
    max_attempts: int,
    retry_window: float,
) -> dict[int, str]:
    """Write outcomes for rows claimed under `token`; returns {id: new status} for the rows
    that were still ours (a row missing from the answer was claimed by another sender)."""
    return await mark_many(
        conn,
        [(token, row_id, outcome) for row_id, outcome in results],
        schema=schema,
        max_attempts=max_attempts,
        retry_window=retry_window,
    )


async def mark_many(
    conn: Conn,
    results: Sequence[tuple[uuid.UUID, int, Mark]],
    *,
    schema: str,
    max_attempts: int,
    retry_window: float,
) -> dict[int, str]:
    """`mark` for rows of several claims at once: (claim token, row id, outcome) each."""
    if not results:
        return {}
    # Values PostgreSQL would refuse (a NUL in a provider's answer, an interval out of range)
    # must not reach it: one of them fails the whole statement, the other rows' outcomes too.
    records = await conn.fetch(
        qualify(MARK_SQL, schema),
        max_attempts,
        retry_window,
        [token for token, _, _ in results],
        [row_id for _, row_id, _ in results],
        [o.outcome for _, _, o in results],
        [retry_delay(o.delay, retry_window) for _, _, o in results],
        [None if o.message_id is None else pg_text(o.message_id) for _, _, o in results],
        [None if o.error is None else error_text(o.error, MAX_ERROR) for _, _, o in results],
    )
    return {r["id"]: r["status"] for r in records}


def retry_delay(delay: float, retry_window: float) -> float:
    """`delay` made writable: finite, 0 .. `retry_window` (a longer one is past the window
    anyway, and the row is dead either way). Not a number counts as the whole window."""
    if math.isnan(delay):
        return retry_window
    return min(max(0.0, delay), retry_window)


async def release(
    conn: Conn, token: uuid.UUID, ids: Sequence[int], *, schema: str, attempted: bool = False
) -> int:
    """Make claimed rows due again now; `attempted` keeps the claim counted as an attempt."""
    if not ids:
        return 0
    status = await conn.execute(qualify(RELEASE_SQL, schema), list(ids), token, attempted)
    return int(status.split()[-1])


# --- retry schedule -------------------------------------------------------------------------


def backoff_delay(
    attempt: int,
    *,
    base: float,
    cap: float,
    retry_after: float | None = None,
    rng: random.Random | None = None,
) -> float:
    """Seconds before the next attempt after `attempt` failed ones.

    Exponential with "equal jitter": half the step is fixed, half random, so retries spread out
    but never come sooner than half the schedule. A (finite) Retry-After from the provider is
    a floor; the write caps the result at the retry window (`retry_delay`).
    """
    step = min(cap, base * 2 ** min(max(0, attempt - 1), 64))
    uniform = rng.uniform if rng is not None else random.uniform
    delay: float = step / 2 + uniform(0, step / 2)
    if retry_after is not None and math.isfinite(retry_after):
        delay = max(delay, retry_after)
    return delay


# --- rate limit: cronlock/delivery/pace.py (the window senders share in email_outbox_rate) ----

# --- batches --------------------------------------------------------------------------------

# Due rows not in a batch yet, locked for the transaction that forms batches from them. Only
# rows never attempted: a row whose own key may have reached the provider (a single send that
# timed out but went through, in a fleet or a period with EMAIL_BATCH_SIZE=1) would be
# delivered again under the batch key. A re-queued row has attempts reset but keeps its last
# error, so it is sent alone too (its batch, when re-opened, carries it instead).
FORM_SELECT_SQL = """
SELECT id, job, slot, idempotency_key, sender, recipient, subject, body, created_at, traceparent
FROM {schema}.email_outbox
WHERE status = 'pending' AND batch_id IS NULL AND next_attempt_at <= now()
  AND attempts = 0 AND last_error IS NULL
ORDER BY next_attempt_at, id
LIMIT $1
FOR UPDATE SKIP LOCKED
"""

# A new batch is born claimed (its first attempt is this sender's), frozen with its key and
# bytes. Keys are distinct within one call (distinct members), so they name the new rows.
FORM_INSERT_SQL = """
INSERT INTO {schema}.email_batch
    (idempotency_key, body, size, attempts, claim_token, locked_until, next_attempt_at)
SELECT u.key, u.body, u.size, 1, $4,
       clock_timestamp() + make_interval(secs => $5),
       clock_timestamp() + make_interval(secs => $5)
FROM unnest($1::text[], $2::bytea[], $3::int[]) AS u(key, body, size)
RETURNING id, idempotency_key
"""

# Members point at their batch. While it is pending they are never due and hold no claim of
# their own: the batch's lease and token fence them. A single-row sender (a rolling deploy's
# older code scans for due rows without looking at batch_id; one whose lease on the row ran
# out) then can neither claim nor mark them: "never" is 'infinity' (here, in MARK_BATCH_SQL
# and REQUEUE_SQL).
FORM_MEMBERS_SQL = """
UPDATE {schema}.email_outbox AS o
SET batch_id = u.batch_id, batch_index = u.idx,
    next_attempt_at = 'infinity'::timestamptz, locked_until = NULL, claim_token = NULL
FROM unnest($1::bigint[], $2::bigint[], $3::int[]) AS u(id, batch_id, idx)
WHERE o.id = u.id
"""

# Batches due again: a retry whose time came, or a lease that ended (the sender died, or was
# cut off). As for rows, `attempts` counts claims.
CLAIM_BATCHES_SQL = """
WITH due AS (
    SELECT id
    FROM {schema}.email_batch
    WHERE status = 'pending' AND next_attempt_at <= now()
    ORDER BY next_attempt_at, id
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.email_batch AS b
SET claim_token = $2,
    locked_until = clock_timestamp() + make_interval(secs => $3),
    next_attempt_at = clock_timestamp() + make_interval(secs => $3),
    attempts = b.attempts + 1
FROM due
WHERE b.id = due.id
RETURNING b.id, b.idempotency_key, b.body, b.size, b.attempts,
          extract(epoch FROM now() - b.key_created_at)::float8 AS key_age,
          ARRAY(SELECT DISTINCT o.traceparent FROM {schema}.email_outbox AS o
                WHERE o.batch_id = b.id AND o.traceparent IS NOT NULL) AS queued_by
"""

# The batch's outcome and its members' in one statement, only while the claim is ours. A
# request the provider answered makes the batch `done` and each member `sent` or `dead` on
# its own (a member the provider refused in permissive mode); a retry that would fall after
# max_attempts or the retry window makes the batch and its members dead, as for rows.
MARK_BATCH_SQL = """
WITH n AS (
    SELECT clock_timestamp() AS ts, clock_timestamp() + make_interval(secs => $5) AS due
),
b AS (
    UPDATE {schema}.email_batch AS b
    SET status = CASE
            WHEN $3 = 'done' THEN 'done'
            WHEN $3 = 'dead' THEN 'dead'
            WHEN b.attempts >= $4 THEN 'dead'
            WHEN n.due > b.key_created_at + make_interval(secs => $6) THEN 'dead'
            ELSE 'pending' END,
        last_error = CASE
            WHEN $3 = 'done' THEN b.last_error
            WHEN $3 = 'dead' THEN $7
            WHEN b.attempts >= $4 THEN $7 || ' (gave up after ' || b.attempts || ' attempts)'
            WHEN n.due > b.key_created_at + make_interval(secs => $6)
                THEN $7 || ' (retry window ended)'
            ELSE $7 END,
        next_attempt_at = CASE WHEN $3 = 'retry' THEN n.due ELSE b.next_attempt_at END,
        finished_at = CASE
            WHEN $3 = 'retry' AND b.attempts < $4
                 AND n.due <= b.key_created_at + make_interval(secs => $6) THEN NULL
            ELSE n.ts END,
        locked_until = NULL,
        claim_token = NULL
    FROM n
    WHERE b.id = $1 AND b.claim_token = $2 AND b.status = 'pending'
    RETURNING b.id, b.status, b.attempts, b.last_error, b.next_attempt_at
),
m AS (
    UPDATE {schema}.email_outbox AS o
    SET status = CASE
            WHEN b.status = 'done' THEN CASE WHEN r.outcome = 'sent' THEN 'sent' ELSE 'dead' END
            WHEN b.status = 'dead' THEN 'dead'
            ELSE 'pending' END,
        sent_at = CASE WHEN b.status = 'done' AND r.outcome = 'sent' THEN clock_timestamp() END,
        provider_message_id = CASE WHEN b.status = 'done' AND r.outcome = 'sent'
                                   THEN r.message_id ELSE o.provider_message_id END,
        last_error = CASE WHEN b.status = 'done' THEN coalesce(r.error, o.last_error)
                          ELSE b.last_error END,
        attempts = b.attempts,
        next_attempt_at = CASE WHEN b.status = 'pending' THEN 'infinity'::timestamptz
                               ELSE b.next_attempt_at END,
        locked_until = NULL,
        claim_token = NULL
    FROM b, unnest($8::int[], $9::text[], $10::text[], $11::text[])
            AS r(idx, outcome, message_id, error)
    WHERE o.batch_id = b.id AND o.batch_index = r.idx AND o.status = 'pending'
    RETURNING o.id, o.status
)
SELECT b.status AS batch_status, m.id, m.status
FROM b LEFT JOIN m ON true
"""

# Batches go back as rows do (membership and bytes stay frozen).
RELEASE_BATCHES_SQL = _RELEASE.format(table="email_batch")


@dataclass(frozen=True, slots=True)
class Batch:
    """One claimed batch: what every attempt sends (key, bytes) and how many emails."""

    id: int
    key: str
    body: bytes
    size: int
    attempts: int  # including this claim
    key_age: float  # seconds, by the database's clock at claim
    token: uuid.UUID
    deadline: float  # local, conservative end of the lease (see Claim)
    queued_by: tuple[str, ...] = ()  # the traced runs that queued its members (traceparents)


def batch_key(member_keys: Sequence[str]) -> str:
    """The batch's idempotency key, from its members' own keys (in body order): the same
    members always make the same key, and distinct member sets distinct keys."""
    digest = hashlib.sha256("\n".join(member_keys).encode()).hexdigest()
    return f"batch-{digest}"


@dataclass(frozen=True, slots=True)
class _Planned:
    key: str
    body: bytes
    ids: list[int]
    queued_by: tuple[str, ...] = ()


def plan_batches(records: Sequence[Any], size: int) -> list[_Planned]:
    """Group rows into batches: by job and slot (one digest's emails travel together), each
    group's members ordered by their own keys, cut into `size`-long batches."""
    groups: dict[tuple[str, datetime | None], list[Any]] = {}
    for r in records:
        groups.setdefault((r["job"], r["slot"]), []).append(r)
    planned = []
    for members in groups.values():
        members.sort(key=lambda r: r["idempotency_key"])
        for start in range(0, len(members), size):
            chunk = members[start : start + size]
            emails = [
                Email(
                    idempotency_key=r["idempotency_key"],
                    sender=r["sender"],
                    recipient=r["recipient"],
                    subject=r["subject"],
                    body=r["body"],
                    created_at=r["created_at"],
                )
                for r in chunk
            ]
            planned.append(
                _Planned(
                    key=batch_key([e.idempotency_key for e in emails]),
                    body=batch_bytes(emails),
                    ids=[r["id"] for r in chunk],
                    queued_by=tuple({r["traceparent"] for r in chunk if r["traceparent"]}),
                )
            )
    return planned


async def form_batches(
    conn: Conn, *, schema: str, batches: int, size: int, lease: float
) -> list[Batch]:
    """Form up to `batches` new batches of up to `size` due rows each, claimed for `lease`
    seconds. Membership, bytes and key are committed before anything is sent."""
    token = uuid.uuid4()
    started = time.monotonic()
    async with conn.transaction():
        records = await conn.fetch(qualify(FORM_SELECT_SQL, schema), batches * size)
        planned = plan_batches(records, size)[:batches]
        if not planned:
            return []
        inserted = await conn.fetch(
            qualify(FORM_INSERT_SQL, schema),
            [p.key for p in planned],
            [p.body for p in planned],
            [len(p.ids) for p in planned],
            token,
            lease,
        )
        ids = {r["idempotency_key"]: r["id"] for r in inserted}
        members = [(row_id, ids[p.key], i) for p in planned for i, row_id in enumerate(p.ids)]
        await conn.execute(
            qualify(FORM_MEMBERS_SQL, schema),
            [m[0] for m in members],
            [m[1] for m in members],
            [m[2] for m in members],
        )
    return [
        Batch(ids[p.key], p.key, p.body, len(p.ids), 1, 0.0, token, started + lease, p.queued_by)
        for p in planned
    ]


async def claim_batches(conn: Conn, *, schema: str, limit: int, lease: float) -> list[Batch]:
    """Claim up to `limit` batches that are due again, for `lease` seconds."""
    token = uuid.uuid4()
    started = time.monotonic()
    records = await conn.fetch(qualify(CLAIM_BATCHES_SQL, schema), limit, token, lease)
    found = [
        Batch(
            r["id"],
            r["idempotency_key"],
            bytes(r["body"]),
            r["size"],
            r["attempts"],
            r["key_age"],
            token,
            started + lease,
            tuple(r["queued_by"]),
        )
        for r in records
    ]
    found.sort(key=lambda b: b.id)
    return found


# The soonest a pending batch nobody holds (a retry waiting out its backoff, or a lease that
# ended) is due, in seconds from now (<= 0: due now); NULL when there is none.
NEXT_BATCH_SQL = """
SELECT extract(epoch FROM min(next_attempt_at) - now())::float8
FROM {schema}.email_batch
WHERE status = 'pending' AND (locked_until IS NULL OR locked_until <= now())
"""


async def next_batch_due(conn: Conn, *, schema: str) -> float | None:
    """Seconds until the next pending batch nobody holds is due (0 if one is), or None."""
    value = await conn.fetchval(qualify(NEXT_BATCH_SQL, schema))
    return None if value is None else max(0.0, float(value))


@dataclass(frozen=True, slots=True)
class BatchMark:
    """What to write for one claimed batch: `done` (answered; `members` has one Mark per
    index, sent or dead), or `retry`/`dead` for the whole batch."""

    outcome: Literal["done", "retry", "dead"]
    members: tuple[Mark, ...] = ()
    delay: float = 0.0
    error: str | None = None


@dataclass(frozen=True, slots=True)
class BatchMarked:
    status: str  # the batch's new status
    rows: dict[int, str]  # row id -> new status


async def mark_batch(
    conn: Conn,
    batch: Batch,
    outcome: BatchMark,
    *,
    schema: str,
    max_attempts: int,
    retry_window: float,
) -> BatchMarked | None:
    """Write a batch's outcome; None if the claim was no longer ours."""
    if outcome.outcome == "done":
        marks = list(outcome.members)
        if len(marks) != batch.size:
            raise ValueError(f"{len(marks)} outcomes for a batch of {batch.size}")
    else:
        marks = [Mark("retry" if outcome.outcome == "retry" else "dead")] * batch.size
    error = error_text(outcome.error, MAX_ERROR) if outcome.error is not None else None
    records = await conn.fetch(
        qualify(MARK_BATCH_SQL, schema),
        batch.id,
        batch.token,
        outcome.outcome,
        max_attempts,
        retry_delay(outcome.delay, retry_window),
        retry_window,
        error or "batch failed",
        list(range(batch.size)),
        [m.outcome for m in marks],
        [None if m.message_id is None else pg_text(m.message_id) for m in marks],
        [None if m.error is None else error_text(m.error, MAX_ERROR) for m in marks],
    )
    if not records:
        return None
    rows = {r["id"]: r["status"] for r in records if r["id"] is not None}
    return BatchMarked(records[0]["batch_status"], rows)


async def release_batches(
    conn: Conn, batches: Sequence[Batch], *, schema: str, attempted: bool = False
) -> int:
    """Make claimed batches due again now, unchanged; `attempted` keeps the claim counted."""
    total = 0
    for token in {b.token for b in batches}:
        ids = [b.id for b in batches if b.token == token]
        status = await conn.execute(qualify(RELEASE_BATCHES_SQL, schema), ids, token, attempted)
        total += int(status.split()[-1])
    return total


# --- operations: dead rows, requeue, stats, retention --------------------------------------


@dataclass(frozen=True, slots=True)
class DeadRow:
    id: int
    job: str
    slot: datetime | None
    user_id: int | None
    recipient: str
    subject: str
    attempts: int
    last_error: str | None
    idempotency_key: str
    key_created_at: datetime
    created_at: datetime
    # The batch the email was last sent in (EMAIL_BATCH_SIZE above 1), and that batch's key.
    batch_id: int | None = None
    batch_key: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "batch_id": self.batch_id,
            "batch_key": self.batch_key,
            "job": self.job,
            "slot": self.slot.isoformat() if self.slot else None,
            "user_id": self.user_id,
            "recipient": self.recipient,
            "subject": self.subject,
            "attempts": self.attempts,
            "last_error": self.last_error,
            "idempotency_key": self.idempotency_key,
            "key_created_at": self.key_created_at.isoformat(),
            "created_at": self.created_at.isoformat(),
        }


DEAD_SQL = """
SELECT o.id, o.job, o.slot, o.user_id, o.recipient, o.subject, o.attempts, o.last_error,
       o.idempotency_key, o.key_created_at, o.created_at, o.batch_id,
       b.idempotency_key AS batch_key
FROM {schema}.email_outbox AS o
LEFT JOIN {schema}.email_batch AS b ON b.id = o.batch_id
WHERE o.status = 'dead'
ORDER BY o.id
LIMIT $1
"""


async def dead_rows(conn: Conn, *, schema: str, limit: int = 100) -> list[DeadRow]:
    """Dead-lettered rows, oldest first, with the last error each one got."""
    return [DeadRow(**dict(r.items())) for r in await conn.fetch(qualify(DEAD_SQL, schema), limit)]


@dataclass(frozen=True, slots=True)
class Requeued:
    id: int
    idempotency_key: str
    previous_key: str
    new_key: bool
    # The batch it is sent in again (its dead batch re-opened), or None: sent on its own.
    batch_id: int | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "idempotency_key": self.idempotency_key,
            "previous_key": self.previous_key,
            "new_key": self.new_key,
            "batch_id": self.batch_id,
        }


# A key older than the retry window may be past the provider's idempotency window: sending it
# again could be treated as new anyway, so the row gets a fresh key (and a fresh window), and
# the caller is told. A younger key is kept, so a delivery that did go through is still
# recognised by the provider; its window keeps running from when the key was made.
#
# A row that died with its batch (the batch is `dead`: its request may have gone through,
# e.g. timeouts until the end) re-opens that batch, with all of its members, the same bytes,
# the same key and the same key age: re-formed into another batch it would get another key
# and be delivered again. If the batch's key is past the window, its members get fresh keys
# and leave it instead (sent alone: see FORM_SELECT_SQL). A row the provider refused inside a
# `done` batch leaves it, as a row that was never in one is re-queued alone.
REQUEUE_SQL = """
WITH picked AS (
    SELECT id, batch_id
    FROM {schema}.email_outbox
    WHERE status = 'dead' AND ($1::bigint[] IS NULL OR id = ANY($1::bigint[]))
),
dead_batch AS (
    SELECT b.id, b.key_created_at >= now() - make_interval(secs => $2) AS reopen
    FROM {schema}.email_batch AS b
    WHERE b.status = 'dead' AND b.id IN (SELECT batch_id FROM picked)
    FOR UPDATE
),
reopened AS (
    UPDATE {schema}.email_batch AS b
    SET status = 'pending', attempts = 0, next_attempt_at = now(), locked_until = NULL,
        claim_token = NULL, finished_at = NULL
    FROM dead_batch AS d
    WHERE b.id = d.id AND d.reopen
    RETURNING b.id
),
d AS (
    SELECT o.id, o.idempotency_key AS previous_key, coalesce(db.reopen, false) AS stays,
           CASE WHEN db.id IS NOT NULL THEN NOT db.reopen
                ELSE o.key_created_at < now() - make_interval(secs => $2) END AS fresh
    FROM {schema}.email_outbox AS o
    LEFT JOIN dead_batch AS db ON db.id = o.batch_id
    WHERE o.status = 'dead' AND (o.id IN (SELECT id FROM picked) OR db.id IS NOT NULL)
)
UPDATE {schema}.email_outbox AS o
SET status = 'pending',
    attempts = 0,
    next_attempt_at = CASE WHEN d.stays THEN 'infinity'::timestamptz ELSE now() END,
    locked_until = NULL,
    claim_token = NULL,
    batch_id = CASE WHEN d.stays THEN o.batch_id END,
    batch_index = CASE WHEN d.stays THEN o.batch_index END,
    idempotency_key = CASE WHEN d.fresh THEN gen_random_uuid()::text ELSE o.idempotency_key END,
    key_created_at = CASE WHEN d.fresh THEN now() ELSE o.key_created_at END
FROM d
WHERE o.id = d.id AND o.status = 'dead'
RETURNING o.id, o.idempotency_key, d.previous_key, d.fresh, o.batch_id
"""


async def requeue(
    conn: Conn,
    ids: Sequence[int] | Literal["all"],
    *,
    schema: str,
    retry_window: float = DEFAULT_RETRY_WINDOW,
) -> list[Requeued]:
    """Put dead rows back in the queue (attempts reset, due now). Pass `retry_window` from
    settings: keys older than it get a fresh key, reported as `new_key`. A row that died with
    its batch brings the batch's other members back with it, in the same batch."""
    selected = None if ids == "all" else list(ids)
    records = await conn.fetch(qualify(REQUEUE_SQL, schema), selected, retry_window)
    found = [
        Requeued(r["id"], r["idempotency_key"], r["previous_key"], r["fresh"], r["batch_id"])
        for r in records
    ]
    found.sort(key=lambda r: r.id)
    if found:
        await notify(conn, schema)
    return found


# A row in a pending batch is due when its batch is (its own next_attempt_at is "never").
STATS_SQL = """
SELECT p.pending, p.due, p.oldest_pending_seconds, d.dead
FROM (
    SELECT count(*) AS pending,
           count(*) FILTER (WHERE coalesce(b.next_attempt_at, o.next_attempt_at) <= now()) AS due,
           coalesce(extract(epoch FROM now() - min(o.created_at))::float8, 0)
               AS oldest_pending_seconds
    FROM {schema}.email_outbox AS o
    LEFT JOIN {schema}.email_batch AS b ON b.id = o.batch_id AND b.status = 'pending'
    WHERE o.status = 'pending'
) AS p,
(SELECT count(*) AS dead FROM {schema}.email_outbox WHERE status = 'dead') AS d
"""


async def outbox_stats(conn: Conn, schema: str) -> dict[str, float]:
    """Queue health by the database's clock: pending (and due now), the oldest pending row's
    age in seconds, and dead rows."""
    row = await conn.fetchrow(qualify(STATS_SQL, schema))
    assert row is not None
    return {
        "pending": int(row["pending"]),
        "due": int(row["due"]),
        "oldest_pending_seconds": float(row["oldest_pending_seconds"]),
        "dead": int(row["dead"]),
    }


# Chunked so a big backlog never holds many row locks or one long transaction; SKIP LOCKED so
# instances pruning at the same time do not queue behind each other.
PRUNE_SQL = """
DELETE FROM {schema}.email_outbox
WHERE id IN (
    SELECT id FROM {schema}.email_outbox
    WHERE status = 'sent' AND sent_at < now() - make_interval(secs => $1)
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
"""


# Finished batches go once none of their rows is left (a dead row keeps its batch, so `outbox
# dead` can still say which batch it was in). No foreign key guards this (migration 0012): a
# row joins a batch only in the transaction that makes the batch, never a finished one, so a
# batch this finds without rows keeps none.
PRUNE_BATCHES_SQL = """
DELETE FROM {schema}.email_batch
WHERE id IN (
    SELECT b.id FROM {schema}.email_batch AS b
    WHERE b.status <> 'pending' AND b.finished_at < now() - make_interval(secs => $1)
      AND NOT EXISTS (SELECT 1 FROM {schema}.email_outbox AS o WHERE o.batch_id = b.id)
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
"""


async def prune_chunk(
    conn: Conn, retention_days: float, *, schema: str, chunk: int = PRUNE_CHUNK
) -> int:
    """Delete up to `chunk` sent rows older than the retention (and as many finished batches
    left without rows); returns how many rows."""
    status = await conn.execute(qualify(PRUNE_SQL, schema), retention_days * 86400.0, chunk)
    await conn.execute(qualify(PRUNE_BATCHES_SQL, schema), retention_days * 86400.0, chunk)
    return int(status.split()[-1])


async def prune_sent(
    conn: Conn, retention_days: float, *, schema: str, chunk: int = PRUNE_CHUNK
) -> int:
    """Delete sent rows older than the retention; returns how many."""
    total = 0
    while True:
        deleted = await prune_chunk(conn, retention_days, schema=schema, chunk=chunk)
        total += deleted
        if deleted < chunk:
            return total


# --- the dashboard's views: one email, and the delivery rate (cronlock/web/ui) --------------------

EMAIL_SQL = """
SELECT o.id, o.job, o.slot, o.user_id, o.recipient, o.subject, o.status, o.attempts,
       o.next_attempt_at, o.locked_until, o.created_at, o.sent_at, o.provider_message_id,
       o.last_error, o.idempotency_key, o.key_created_at, o.batch_id,
       b.status AS batch_status, b.attempts AS batch_attempts, b.last_error AS batch_error
FROM {schema}.email_outbox AS o
LEFT JOIN {schema}.email_batch AS b ON b.id = o.batch_id
WHERE o.id = $1
"""


async def email(conn: Conn, *, schema: str, email_id: int) -> dict[str, Any] | None:
    """One outbox row with its delivery state (attempts, next attempt, last error) and its
    batch's, or None. Only the latest error is kept per row: there is no per-attempt log."""
    row = await conn.fetchrow(qualify(EMAIL_SQL, schema), email_id)
    return dict(row.items()) if row is not None else None


# Each count walks the partial index on sent rows: the rates a range of it, the rows kept a
# bounded prefix (a table keeping millions of sent rows costs the page no more than 100,000).
KEPT_COUNT_LIMIT = 100_000
SENT_SQL = """
SELECT (SELECT count(*) FROM (
            SELECT 1 FROM {schema}.email_outbox WHERE status = 'sent' LIMIT $1 + 1
        ) AS k) AS kept,
       (SELECT count(*) FROM {schema}.email_outbox
        WHERE status = 'sent' AND sent_at > now() - interval '1 minute') AS last_minute,
       (SELECT count(*) FROM {schema}.email_outbox
        WHERE status = 'sent' AND sent_at > now() - interval '1 hour') AS last_hour
"""


@dataclass(frozen=True, slots=True)
class SentStats:
    kept: int  # sent rows still kept (OUTBOX_RETENTION_DAYS), at most KEPT_COUNT_LIMIT
    more: bool  # and more than that
    last_minute: int
    last_hour: int


async def sent_stats(conn: Conn, schema: str) -> SentStats:
    """Sent rows still kept (counted up to KEPT_COUNT_LIMIT), and how many left in the last
    minute and hour: the send rate."""
    row = await conn.fetchrow(qualify(SENT_SQL, schema), KEPT_COUNT_LIMIT)
    assert row is not None
    kept = int(row["kept"])
    return SentStats(
        kept=min(kept, KEPT_COUNT_LIMIT),
        more=kept > KEPT_COUNT_LIMIT,
        last_minute=int(row["last_minute"]),
        last_hour=int(row["last_hour"]),
    )
