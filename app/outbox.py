"""The email outbox: enqueue in the caller's transaction; claim with SKIP LOCKED; deliver; retry.

A job writes rows into `<DB_SCHEMA>.email_outbox` inside its own transaction, so a rollback
takes its emails back with everything else. Senders (one loop per instance, plus
`python -m app outbox drain` processes) then deliver them:

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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import signal
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import asyncpg

from app import db
from app.errors import CONNECTION_ERRORS, DatabaseUnavailable, describe
from app.mailer import (
    Email,
    Mailer,
    SendResult,
    create_mailer,
    error_text,
    max_send_time,
    pg_text,
)
from app.schema import notify_channel
from app.settings import Settings
from app.sql import qualify

log = logging.getLogger("cronlock.outbox")

# The channel a committed enqueue notifies (`schema.notify_channel`: one per deployment);
# NOTIFY is delivered only at commit, so a sender never wakes up for rows it cannot see yet.
NOTIFY_SQL = "SELECT pg_notify($1, '')"

# How often a running sender deletes sent rows older than the retention (OUTBOX_RETENTION_DAYS).
PRUNE_INTERVAL = 3600.0
PRUNE_CHUNK = 5000

# For `requeue` callers without settings at hand; kept equal to the setting's default.
DEFAULT_RETRY_WINDOW: float = Settings.model_fields["outbox_retry_window"].default

# Errors that mean "the database cannot serve us now": wait and try again.
DB_ERRORS: tuple[type[BaseException], ...] = (
    *CONNECTION_ERRORS,
    DatabaseUnavailable,
    asyncpg.PostgresError,
)

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
# of the same (job, slot, user) a no-op instead of an error that would abort the caller's
# transaction. Only with both slot and user set: NULLs are distinct in a unique index, so a job
# without a schedule (no slot) gets one row per call, as its runs are not once per anything.
ENQUEUE_SQL = """
WITH queued AS (
    INSERT INTO {schema}.email_outbox (job, slot, user_id, sender, recipient, subject, body)
    VALUES ($1, $2, $3, $4, $5, $6, $7)
    ON CONFLICT DO NOTHING
    RETURNING id
)
SELECT pg_notify($8, '') FROM queued
"""


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
) -> None:
    """Queue one email in the caller's transaction; it is sent only if that transaction commits.

    The idempotency key is minted by the database and, with the payload, frozen in the row.
    """
    await conn.execute(
        qualify(ENQUEUE_SQL, schema),
        job,
        slot,
        user_id,
        sender,
        recipient,
        subject,
        body,
        notify_channel(schema),
    )


# --- claim / mark / release -----------------------------------------------------------------

# The lease is also the next due time: a row whose sender vanished needs no sweeper, it simply
# becomes due again when the lease ends. `attempts` counts claims, so a row that crashes its
# sender every time still reaches max_attempts.
CLAIM_SQL = """
WITH due AS (
    SELECT id
    FROM {schema}.email_outbox
    WHERE status = 'pending' AND next_attempt_at <= now()
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
          o.created_at, extract(epoch FROM now() - o.key_created_at)::float8 AS key_age
"""

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

# Give rows back before their lease ends (shutdown, or a lease too short to start a send).
# A row never sent does not count as an attempt.
RELEASE_SQL = """
UPDATE {schema}.email_outbox
SET next_attempt_at = now(), locked_until = NULL, claim_token = NULL,
    attempts = attempts - CASE WHEN $3 THEN 0 ELSE 1 END
WHERE id = ANY($1::bigint[]) AND claim_token = $2 AND status = 'pending'
"""


@dataclass(frozen=True, slots=True)
class Row:
    id: int
    email: Email
    attempts: int  # including this claim
    key_age: float  # seconds, by the database's clock at claim


@dataclass(slots=True)
class Claim:
    token: uuid.UUID
    rows: list[Row]
    # A local, conservative end of the lease: taken before the claim statement was sent, so it
    # falls no later than the database's locked_until.
    deadline: float


@dataclass(frozen=True, slots=True)
class Outcome:
    """What to write for one claimed row."""

    outcome: Literal["sent", "retry", "dead"]
    delay: float = 0.0
    message_id: str | None = None
    error: str | None = None


async def claim(conn: Conn, *, schema: str, limit: int, lease: float) -> Claim:
    """Claim up to `limit` due rows for `lease` seconds under a new claim token."""
    token = uuid.uuid4()
    started = time.monotonic()
    records = await conn.fetch(qualify(CLAIM_SQL, schema), limit, token, lease)
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
        )
        for r in records
    ]
    rows.sort(key=lambda row: row.id)
    return Claim(token=token, rows=rows, deadline=started + lease)


async def mark(
    conn: Conn,
    token: uuid.UUID,
    results: Sequence[tuple[int, Outcome]],
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
    results: Sequence[tuple[uuid.UUID, int, Outcome]],
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


# --- rate limit -----------------------------------------------------------------------------

# A token bucket in one row, refilled by elapsed time on the database clock. Each sender asks
# for as many tokens as it would like to send and gets what is there (0..want); the UPDATE's
# row lock makes take-and-decrement atomic across processes. The sub-select sees the row as
# locked, so a sender that waited for the lock computes from the winner's values.
TAKE_TOKENS_SQL = """
UPDATE {schema}.email_outbox_rate AS r
SET (tokens, updated_at, granted) = (
    SELECT b.avail - g.n, c.ts, g.n
    FROM (SELECT clock_timestamp() AS ts) AS c
    CROSS JOIN LATERAL (
        SELECT least($3::float8, r.tokens + $2::float8
                     * greatest(0, extract(epoch FROM c.ts - r.updated_at)::float8)) AS avail
    ) AS b
    CROSS JOIN LATERAL (SELECT least($1::int, floor(b.avail)::int) AS n) AS g
)
WHERE r.id
RETURNING r.granted, r.tokens
"""

RETURN_TOKENS_SQL = """
UPDATE {schema}.email_outbox_rate SET tokens = least($2::float8, tokens + $1::float8) WHERE id
"""


@dataclass(frozen=True, slots=True)
class Tokens:
    granted: int
    # Seconds until one more token is there, when none was granted.
    wait: float


async def take_tokens(conn: Conn, want: int, *, schema: str, rate: float) -> Tokens:
    """Up to `want` sends under the global rate (per second, burst of one second's worth)."""
    if rate <= 0:
        return Tokens(want, 0.0)
    burst = max(1.0, rate)
    row = await conn.fetchrow(qualify(TAKE_TOKENS_SQL, schema), want, rate, burst)
    if row is None:  # the bucket row is missing: never block delivery on it
        return Tokens(want, 0.0)
    granted = int(row["granted"])
    wait = 0.0 if granted else max(0.0, (1.0 - float(row["tokens"])) / rate)
    return Tokens(granted, wait)


async def return_tokens(conn: Conn, count: int, *, schema: str, rate: float) -> None:
    if rate > 0 and count > 0:
        await conn.execute(qualify(RETURN_TOKENS_SQL, schema), count, max(1.0, rate))


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

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
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
SELECT id, job, slot, user_id, recipient, subject, attempts, last_error, idempotency_key,
       key_created_at, created_at
FROM {schema}.email_outbox
WHERE status = 'dead'
ORDER BY id
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

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "idempotency_key": self.idempotency_key,
            "previous_key": self.previous_key,
            "new_key": self.new_key,
        }


# A key older than the retry window may be past the provider's idempotency window: sending it
# again could be treated as new anyway, so the row gets a fresh key (and a fresh window), and
# the caller is told. A younger key is kept, so a delivery that did go through is still
# recognised by the provider; its window keeps running from when the key was made.
REQUEUE_SQL = """
UPDATE {schema}.email_outbox AS o
SET status = 'pending',
    attempts = 0,
    next_attempt_at = now(),
    locked_until = NULL,
    claim_token = NULL,
    idempotency_key = CASE WHEN d.fresh THEN gen_random_uuid()::text ELSE o.idempotency_key END,
    key_created_at = CASE WHEN d.fresh THEN now() ELSE o.key_created_at END
FROM (
    SELECT id, idempotency_key AS previous_key,
           key_created_at < now() - make_interval(secs => $2) AS fresh
    FROM {schema}.email_outbox
    WHERE status = 'dead' AND ($1::bigint[] IS NULL OR id = ANY($1::bigint[]))
) AS d
WHERE o.id = d.id AND o.status = 'dead'
RETURNING o.id, o.idempotency_key, d.previous_key, d.fresh
"""


async def requeue(
    conn: Conn,
    ids: Sequence[int] | Literal["all"],
    *,
    schema: str,
    retry_window: float = DEFAULT_RETRY_WINDOW,
) -> list[Requeued]:
    """Put dead rows back in the queue (attempts reset, due now). Pass `retry_window` from
    settings: keys older than it get a fresh key, reported as `new_key`."""
    selected = None if ids == "all" else list(ids)
    records = await conn.fetch(qualify(REQUEUE_SQL, schema), selected, retry_window)
    found = [
        Requeued(r["id"], r["idempotency_key"], r["previous_key"], r["fresh"]) for r in records
    ]
    found.sort(key=lambda r: r.id)
    if found:
        await notify(conn, schema)
    return found


STATS_SQL = """
SELECT p.pending, p.due, p.oldest_pending_seconds, d.dead
FROM (
    SELECT count(*) AS pending,
           count(*) FILTER (WHERE next_attempt_at <= now()) AS due,
           coalesce(extract(epoch FROM now() - min(created_at))::float8, 0)
               AS oldest_pending_seconds
    FROM {schema}.email_outbox
    WHERE status = 'pending'
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


async def prune_chunk(
    conn: Conn, retention_days: float, *, schema: str, chunk: int = PRUNE_CHUNK
) -> int:
    """Delete up to `chunk` sent rows older than the retention; returns how many."""
    status = await conn.execute(qualify(PRUNE_SQL, schema), retention_days * 86400.0, chunk)
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


# --- the sender -----------------------------------------------------------------------------


# An outcome waiting for the next group write: claim token, row id, outcome, the writer's answer.
_Pending = tuple[uuid.UUID, int, "Outcome", "asyncio.Future[str | None]"]


@dataclass(slots=True)
class _Stats:
    sent: int = 0
    retried: int = 0
    dead: int = 0
    lost: int = 0  # outcomes not written because another sender had taken the row over
    released: int = 0
    unwritten: int = 0  # outcomes the database refused; those rows come back after their lease


class OutcomeRefused(Exception):
    """The database refused one row's outcome on its own (not an outage): writing it again
    would fail again, so the row is left to its lease."""


class Sender:
    """One delivery loop: claims batches, sends with bounded concurrency, marks outcomes."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        settings: Settings,
        mailer: Mailer,
        instance_name: str | None = None,
        *,
        prune_interval: float = PRUNE_INTERVAL,
        rng: random.Random | None = None,
    ) -> None:
        self.pool = pool
        self.settings = settings
        self.mailer = mailer
        self.instance = instance_name or settings.instance_name
        self.prune_interval = prune_interval
        self.stats = _Stats()
        self._rng = rng or random.Random()
        self._slots = asyncio.Semaphore(settings.outbox_concurrency)
        self._wake = asyncio.Event()
        self._stopping = False
        self._held = 0  # rows claimed and not yet marked or released
        self._changed = asyncio.Event()  # set whenever _held drops
        self._db_trouble = False
        self._rate_wait = 0.0  # how long the last refused token request said to wait
        self._prune_task: asyncio.Task[None] | None = None
        self._outcomes: list[_Pending] = []
        self._writer: asyncio.Task[None] | None = None
        self._prune_conn: Conn | None = None
        # What one send can really take with this backend (SMTP: the timeout and a grace).
        self.max_send_time = max_send_time(mailer, settings.outbox_send_timeout)
        if settings.outbox_lease <= self.max_send_time:
            log.warning(
                "OUTBOX_LEASE (%gs) is not longer than a send may take (%gs with "
                "OUTBOX_SEND_TIMEOUT %gs and this backend): a slow send can outlive its lease "
                "and be sent again by another sender",
                settings.outbox_lease,
                self.max_send_time,
                settings.outbox_send_timeout,
            )

    # -- one batch ---------------------------------------------------------------------------

    def stop_claiming(self) -> None:
        """No more claims (a `drain_once` waiting for the rate limit gives up), and rows of
        a batch still waiting for a send slot are given back instead of sent."""
        self._stopping = True

    async def drain_once(self) -> int:
        """Claim one batch (as the rate limit allows), send it, mark it; returns rows handled."""
        if self._stopping:
            return 0
        batch = await self._claim(self.settings.outbox_batch_size, wait_for_tokens=True)
        if batch is None or not batch.rows:
            return 0
        await asyncio.gather(*(self._deliver(batch, row) for row in batch.rows))
        return len(batch.rows)

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[Conn]:
        """A pooled connection for a few short statements, all within DB_QUERY_TIMEOUT: a
        database or pooler that stops answering with its socket open would otherwise stall
        claims and outcomes until the kernel gives up on the socket (see `db.deadline`)."""
        s = self.settings
        async with self.pool.acquire(timeout=s.db_acquire_timeout) as conn:
            with db.deadline(conn, s.db_query_timeout):
                yield conn

    async def _claim(self, want: int, *, wait_for_tokens: bool) -> Claim | None:
        """A claim of up to `want` rows; None when the rate limit has nothing for us yet."""
        s = self.settings
        while True:
            async with self._connection() as conn:
                tokens = await take_tokens(conn, want, schema=s.db_schema, rate=s.outbox_rate_limit)
                if tokens.granted:
                    try:
                        batch = await claim(
                            conn, schema=s.db_schema, limit=tokens.granted, lease=s.outbox_lease
                        )
                    except BaseException:
                        await _quietly(
                            return_tokens(
                                conn, tokens.granted, schema=s.db_schema, rate=s.outbox_rate_limit
                            )
                        )
                        raise
                    # Tokens for rows that were not there go back: an idle poll costs nothing.
                    await return_tokens(
                        conn,
                        tokens.granted - len(batch.rows),
                        schema=s.db_schema,
                        rate=s.outbox_rate_limit,
                    )
                    self._held += len(batch.rows)
                    return batch
            if not wait_for_tokens or self._stopping:
                self._rate_wait = tokens.wait
                return None
            await asyncio.sleep(min(tokens.wait, s.outbox_poll_interval))

    async def _deliver(self, batch: Claim, row: Row) -> None:
        """Send one claimed row and write its outcome; gives the row back if it was not sent.

        A row whose send ended but whose outcome could not be written (a bug, a cut-off at
        shutdown) is never given back due at once: it may have been delivered, and a retry
        needs its backoff. Its lease is that backoff."""
        started = False
        finished = False
        outcome: Outcome | None = None
        try:
            async with self._slots:
                if self._stopping or not self._lease_allows_send(batch):
                    return
                started = True
                outcome = await self._attempt(row)
            # Outside the slot: the next send starts while this outcome is being written.
            await self._finish(batch, row, outcome)
            finished = True
        except Exception:
            if outcome is None:
                raise
            finished = True
            self.stats.unwritten += 1
            log.exception(
                "could not record outbox row %s as %s; it comes back after its lease",
                row.id,
                outcome.outcome,
                extra={"event": "outbox_unwritten", "row": row.id, "instance": self.instance},
            )
        finally:
            if not finished:
                if outcome is None:
                    await self._give_back(batch, row, attempted=started)
                else:
                    log.warning(
                        "outbox row %s: outcome %s not recorded (stopped); it comes back "
                        "after its lease",
                        row.id,
                        outcome.outcome,
                    )
            self._held -= 1
            self._changed.set()

    def _lease_allows_send(self, batch: Claim) -> bool:
        # A send started with less lease left than it may take could still be running when
        # another sender takes the row over: give it back instead.
        needed = min(self.max_send_time, self.settings.outbox_lease / 2)
        return batch.deadline - time.monotonic() >= needed

    async def _attempt(self, row: Row) -> Outcome:
        s = self.settings
        if row.key_age >= s.outbox_retry_window:
            return Outcome(
                "dead",
                error=f"retry window ended before attempt {row.attempts}: the key is "
                f"{row.key_age:.0f}s old, past OUTBOX_RETRY_WINDOW ({s.outbox_retry_window:g}s)",
            )
        if row.attempts > s.outbox_max_attempts:
            # Earlier claims ended without an outcome (the sender died each time).
            return Outcome(
                "dead", error=f"claimed {row.attempts - 1} times without an outcome; gave up"
            )
        try:
            result = await self.mailer.send(row.email)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug in a backend must not stop delivery of other rows
            log.exception("mailer failed on outbox row %s", row.id)
            result = SendResult.retry(error_text(f"mailer error: {type(exc).__name__}: {exc}"))
        if result.status == "sent":
            return Outcome("sent", message_id=result.message_id)
        if result.status == "failed":
            return Outcome("dead", error=result.error or "permanent failure")
        delay = backoff_delay(
            row.attempts,
            base=s.outbox_backoff_base,
            cap=s.outbox_backoff_max,
            retry_after=result.retry_after,
            rng=self._rng,
        )
        return Outcome("retry", delay=delay, error=result.error or "retryable failure")

    async def _finish(self, batch: Claim, row: Row, outcome: Outcome) -> None:
        """Write the outcome; a database outage is retried while the lease lasts, after that
        the row comes back on its own and is sent again with the same key. An outcome the
        database refuses is not retried (the writer has logged it): the row waits out its
        lease."""
        s = self.settings
        while True:
            try:
                status = await self._record(batch.token, row.id, outcome)
                break
            except OutcomeRefused:
                self.stats.unwritten += 1
                return  # logged by the writer; the row comes back after its lease
            except DB_ERRORS as exc:
                if time.monotonic() + s.outbox_poll_interval >= batch.deadline:
                    log.warning(
                        "could not record outbox row %s as %s: %s; it is retried after its lease",
                        row.id,
                        outcome.outcome,
                        describe(exc),
                    )
                    return
                await asyncio.sleep(min(1.0, s.outbox_poll_interval))
        if status is None:
            self.stats.lost += 1
            log.warning(
                "outbox row %s was taken over by another sender (lease ended mid-send); "
                "its outcome %s is not recorded",
                row.id,
                outcome.outcome,
                extra={"event": "outbox_lost_claim", "row": row.id, "instance": self.instance},
            )
            return
        if status == "sent":
            self.stats.sent += 1
        elif status == "dead":
            self.stats.dead += 1
            log.warning(
                "outbox row %s is dead: %s",
                row.id,
                outcome.error,
                extra={"event": "outbox_dead", "row": row.id, "attempts": row.attempts},
            )
        else:
            self.stats.retried += 1
            log.info(
                "outbox row %s retried in %.1fs: %s",
                row.id,
                outcome.delay,
                outcome.error,
                extra={"event": "outbox_retry", "row": row.id, "attempts": row.attempts},
            )

    async def _record(self, token: uuid.UUID, row_id: int, outcome: Outcome) -> str | None:
        """Queue an outcome for the next group write; returns the row's new status, or None
        if the claim was no longer ours. Sends that finish while a write is under way share
        the next one, so a busy sender writes many outcomes per statement."""
        done: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._outcomes.append((token, row_id, outcome, done))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_outcomes(), name="outbox-mark")
        return await done

    async def _write_outcomes(self) -> None:
        while self._outcomes:
            group, self._outcomes = self._outcomes, []
            try:
                await self._write_group(group)
            except BaseException:
                # Cancelled with the loop: nobody will write these, their senders give up.
                for *_, done in group + self._outcomes:
                    done.cancel()
                self._outcomes = []
                raise

    async def _write_group(self, group: list[_Pending]) -> None:
        """One statement for the group. If the database refuses it (not an outage), one row's
        values are to blame: each outcome is then written on its own, so that row cannot keep
        the others from being recorded (a sent row not marked sent is sent again)."""
        s = self.settings
        try:
            async with self._connection() as conn:
                written = await mark_many(
                    conn,
                    [(token, row_id, outcome) for token, row_id, outcome, _ in group],
                    schema=s.db_schema,
                    max_attempts=s.outbox_max_attempts,
                    retry_window=s.outbox_retry_window,
                )
        except Exception as exc:
            if unavailable(exc):
                # Their senders try again while their leases last.
                for *_, done in group:
                    if not done.done():
                        done.set_exception(exc)
            elif len(group) > 1:
                log.warning(
                    "outbox: %d outcomes written together failed (%s); writing them one at a time",
                    len(group),
                    describe(exc),
                )
                for pending in group:
                    await self._write_group([pending])
            else:
                [(_, row_id, outcome, done)] = group
                # The server's message, not its DETAIL: that quotes the row (addresses, body).
                message = getattr(exc, "message", None) or type(exc).__name__
                log.error(
                    "outbox row %s: its outcome %s cannot be written (%s: %s); it is not "
                    "retried, the row comes back after its lease",
                    row_id,
                    outcome.outcome,
                    describe(exc),
                    error_text(str(message)),
                    extra={"event": "outbox_outcome_refused", "row": row_id},
                )
                if not done.done():
                    done.set_exception(OutcomeRefused(describe(exc)))
            return
        for _, row_id, _, done in group:
            if not done.done():
                done.set_result(written.get(row_id))

    async def _give_back(self, batch: Claim, row: Row, *, attempted: bool) -> None:
        try:
            async with self._connection() as conn:
                self.stats.released += await release(
                    conn,
                    batch.token,
                    [row.id],
                    schema=self.settings.db_schema,
                    attempted=attempted,
                )
        except DB_ERRORS as exc:
            log.warning(
                "could not release outbox row %s (%s); it comes back after its lease",
                row.id,
                describe(exc),
            )

    # -- the loop ----------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Deliver until `stop` is set; then stop claiming, let in-flight sends finish within
        OUTBOX_SHUTDOWN_TIMEOUT, and give back whatever is left."""
        s = self.settings
        tasks: set[asyncio.Task[None]] = set()
        listener = asyncio.create_task(self._listen(stop), name="outbox-listen")
        next_prune = time.monotonic()
        log.info(
            "outbox sender started",
            extra={"event": "outbox_start", "instance": self.instance, "rate": s.outbox_rate_limit},
        )
        try:
            while not stop.is_set():
                if time.monotonic() >= next_prune:
                    # In the background: a first prune of a big table must not delay sends.
                    # One at a time: a prune still running (a slow database) skips this turn.
                    if self._prune_task is None or self._prune_task.done():
                        self._prune_task = asyncio.create_task(self._prune(), name="outbox-prune")
                    next_prune = time.monotonic() + self.prune_interval
                if self._held > s.outbox_concurrency:
                    # Enough rows in hand: claim again when a send slot is about to free up.
                    self._changed.clear()
                    await _wait_any(stop, self._changed, within=s.outbox_poll_interval)
                    continue
                self._wake.clear()
                self._rate_wait = 0.0
                try:
                    batch = await self._claim(s.outbox_batch_size, wait_for_tokens=False)
                except DB_ERRORS as exc:
                    self._report_db_trouble(exc)
                    await _wait_any(stop, within=s.outbox_poll_interval)
                    continue
                self._report_db_ok()
                if batch is None:  # rate limited
                    await _wait_any(stop, within=min(self._rate_wait, s.outbox_poll_interval))
                    continue
                for row in batch.rows:
                    task = asyncio.create_task(self._deliver(batch, row))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                if not batch.rows:
                    await _wait_any(stop, self._wake, within=s.outbox_poll_interval)
        finally:
            self._stopping = True
            await self._shutdown(tasks)
            await self._end_prune()
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener
            log.info(
                "outbox sender stopped",
                extra={
                    "event": "outbox_stop",
                    "instance": self.instance,
                    "sent": self.stats.sent,
                    "retried": self.stats.retried,
                    "dead": self.stats.dead,
                    "lost": self.stats.lost,
                    "released": self.stats.released,
                },
            )

    async def _shutdown(self, tasks: set[asyncio.Task[None]]) -> None:
        if not tasks:
            return
        self._stopping = True  # rows still waiting for a send slot are given back at once
        timeout = self.settings.outbox_shutdown_timeout
        # Keep a little of the budget for giving back the sends we have to cut off, and half a
        # second more: the rows are then due at once instead of after their lease.
        reserve = min(1.0, timeout / 4)
        _, pending = await asyncio.wait(set(tasks), timeout=timeout - reserve)
        for task in pending:
            task.cancel()
        if pending:
            log.warning("outbox: cut off %d in-flight sends at shutdown", len(pending))
            await asyncio.wait(pending, timeout=reserve + 0.5)

    async def _prune(self) -> None:
        """Delete old sent rows a chunk at a time, each chunk on a pooled connection of its
        own within DB_QUERY_TIMEOUT: a database that stops answering costs one chunk's
        timeout, not a connection held for ever."""
        deleted = 0
        try:
            while not self._stopping:
                async with self._connection() as conn:
                    self._prune_conn = conn
                    try:
                        chunk = await prune_chunk(
                            conn,
                            self.settings.outbox_retention_days,
                            schema=self.settings.db_schema,
                        )
                    finally:
                        self._prune_conn = None
                deleted += chunk
                if chunk < PRUNE_CHUNK:
                    break
        except DB_ERRORS as exc:
            log.debug("outbox prune stopped: %s", describe(exc))
        if deleted:
            log.info("outbox: pruned %d sent rows", deleted, extra={"event": "outbox_prune"})

    async def _end_prune(self) -> None:
        """At shutdown: close a running prune's connection (no cancel request to a database
        that may not answer, which could keep us waiting), then wait a moment for the task."""
        task = self._prune_task
        if task is None or task.done():
            return
        conn = self._prune_conn
        if conn is not None:
            db.terminate(conn)
        within = min(1.0, self.settings.outbox_shutdown_timeout / 4)
        if not (await asyncio.wait({task}, timeout=within))[0]:
            task.cancel()
            await asyncio.wait({task}, timeout=within)

    async def _listen(self, stop: asyncio.Event) -> None:
        """Wake the loop on NOTIFY, on a connection of its own (the pool's connections are
        shared, and PgBouncer in transaction mode cannot carry LISTEN). Polling goes on
        regardless, so losing this connection only costs latency."""
        if not self.settings.listen_url:
            return
        failing = False
        while not stop.is_set():
            try:
                conn = await db.connect(self.settings, self.settings.listen_url)
            except Exception as exc:
                # Any error, not only an outage: a listener that ended would cost latency
                # until the process restarts, with nothing in the log to say why.
                if isinstance(exc, DatabaseUnavailable):
                    log.debug("outbox listener cannot connect: %s", exc.reason)
                elif not failing:
                    log.warning(
                        "outbox listener cannot connect: %s; polling goes on, retrying",
                        describe(exc),
                    )
                failing = True
                await _wait_any(stop, within=self.settings.outbox_poll_interval)
                continue
            failing = False
            lost = asyncio.Event()

            def on_notify(*_: object) -> None:
                self._wake.set()

            def on_close(_: object, lost: asyncio.Event = lost) -> None:
                lost.set()

            try:
                conn.add_termination_listener(on_close)
                await conn.add_listener(notify_channel(self.settings.db_schema), on_notify)
                # Anything committed while we were not listening is found by this poll.
                self._wake.set()
                await _wait_any(stop, lost)
            except DB_ERRORS as exc:
                log.debug("outbox listener lost: %s", describe(exc))
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(conn.close(), self.settings.db_connect_timeout)
            if not stop.is_set():
                # The database's retry cadence: a lost listener comes back soon, and polling
                # covers the gap.
                retry = min(
                    self.settings.outbox_poll_interval, self.settings.migrate_retry_interval
                )
                await _wait_any(stop, within=retry)

    def _report_db_trouble(self, exc: BaseException) -> None:
        if not self._db_trouble:
            log.warning("outbox: cannot claim rows: %s", describe(exc))
        self._db_trouble = True

    def _report_db_ok(self) -> None:
        if self._db_trouble:
            log.info("outbox: database reachable again")
        self._db_trouble = False


async def _wait_any(*events: asyncio.Event, within: float | None = None) -> None:
    """Until any event is set or the timeout passes."""
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=within, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


async def _quietly(aw: Any) -> None:
    with contextlib.suppress(Exception):
        await aw


# --- entry points ---------------------------------------------------------------------------


async def run_in_app(pool: asyncpg.Pool, settings: Settings, stop: asyncio.Event) -> None:
    """The delivery loop of a service instance, on the service's pool, until `stop`."""
    mailer = create_mailer(settings)
    try:
        await Sender(pool, settings, mailer, settings.instance_name).run(stop)
    finally:
        await mailer.aclose()


async def run_sender(settings: Settings, *, once: bool = False) -> None:
    """A dedicated delivery process (`python -m app outbox drain`): its own pool, until SIGTERM
    or SIGINT; with `once`, until nothing is due."""
    # Each concurrent send marks its row on a connection of its own, plus the claim.
    wanted = settings.outbox_concurrency + 2
    if settings.db_pool_max_size < wanted:
        settings = settings.model_copy(update={"db_pool_max_size": wanted})
    pool = await db.create_pool(settings, settings.database_url)
    mailer = create_mailer(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    sender = Sender(pool, settings, mailer, settings.instance_name)

    def on_signal() -> None:
        stop.set()
        sender.stop_claiming()  # `--once`: the batch in hand is not sent on either

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    try:
        if once:
            while not stop.is_set() and await sender.drain_once():
                pass
        else:
            await sender.run(stop)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await mailer.aclose()
        await asyncio.wait_for(pool.close(), settings.outbox_shutdown_timeout)
