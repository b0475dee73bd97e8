"""The outbox's delivery loop: one `Sender` per service instance (or per `python -m cronlock
outbox drain` process) claims due rows, sends them with bounded concurrency outside any
transaction, and marks each outcome (cronlock/delivery/outbox.py holds the queue's operations).

With EMAIL_BATCH_SIZE above 1 (and a backend with a batch endpoint) the same loop works in
batches: it claims batches that are due again and forms new ones (frozen in the database
before their first attempt), sends each as one request and writes one outcome per member.
OUTBOX_CONCURRENCY and OUTBOX_RATE_LIMIT then count requests (batches).

Long on purpose: it is one class, `Sender`, whose loop, concurrency, rate limit and batch mode
share its state (the rows it holds, its concurrency slots, the rate limit's last wait, whether
it is stopping); cut apart, they would pass that state around.
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
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, Literal, Protocol, TypeVar

import asyncpg

from cronlock.db import pool as db
from cronlock.db.pool import Conn
from cronlock.db.schema import notify_channel
from cronlock.delivery.mailer import (
    BatchMailer,
    BatchResult,
    Mailer,
    SendResult,
    create_mailer,
    error_text,
    max_send_time,
    supports_batches,
)
from cronlock.delivery.outbox import (
    PRUNE_CHUNK,
    PRUNE_INTERVAL,
    Batch,
    BatchMark,
    BatchMarked,
    Claim,
    Mark,
    Row,
    backoff_delay,
    claim,
    claim_batches,
    form_batches,
    mark_batch,
    mark_many,
    next_batch_due,
    prune_chunk,
    release,
    release_batches,
    unavailable,
)
from cronlock.delivery.pace import (
    LATE,
    Window,
    correct,
    observe,
    reserve,
    room,
    window,
    worth_recording,
)
from cronlock.errors import DATABASE_ERRORS, DatabaseUnavailable, describe
from cronlock.settings import Settings
from cronlock.tracing import Span, Tracing, from_env

log = logging.getLogger("cronlock.outbox")

T = TypeVar("T")


# An outcome waiting for the next group write: claim token, row id, outcome, the writer's answer.
_Pending = tuple[uuid.UUID, int, "Mark", "asyncio.Future[str | None]"]


@dataclass(slots=True)
class _Stats:
    sent: int = 0
    retried: int = 0
    dead: int = 0
    lost: int = 0  # outcomes not written because another sender had taken the row over
    released: int = 0
    unwritten: int = 0  # outcomes the database refused; those rows come back after their lease
    throttled: int = 0  # requests the provider refused with 429 (given back, not an attempt)


@dataclass(frozen=True, slots=True)
class _Start:
    """A request's start in the rate window: as recorded (the database's clock), and when it
    was taken (time.monotonic())."""

    at: datetime
    taken: float


class _Outcome(Protocol):
    @property
    def outcome(self) -> str: ...


M = TypeVar("M", bound=_Outcome)


@dataclass(frozen=True, slots=True)
class _Unit(Generic[M]):
    """One send as `Sender._send` sees it: a claimed row (under its claim's lease) or a
    claimed batch (its own lease), and what attempting, finishing and giving it back are."""

    kind: Literal["row", "batch"]
    id: int
    size: int  # emails
    lease: Claim | Batch
    attempt: Callable[[_Start | None], Awaitable[M | None]]
    finish: Callable[[M], Awaitable[None]]
    give_back: Callable[[bool], Awaitable[None]]  # (attempted)


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
        tracing: Tracing | None = None,
    ) -> None:
        self.pool = pool
        # Provider requests as client spans (cronlock/tracing.py), linked to the queueing runs.
        self.tracing = tracing if tracing is not None else Tracing.detect(settings)
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
        self._rate_wait = 0.0  # how long the shared window said to wait, when it had no room
        self._window: Window | None = window(settings.outbox_rate_limit)
        self._known_limit: int | None = None  # the provider's ratelimit-limit, as last recorded
        self._prune_task: asyncio.Task[None] | None = None
        self._outcomes: list[_Pending] = []
        self._writer: asyncio.Task[None] | None = None
        self._prune_conn: Conn | None = None
        # Batches only with a backend that has a batch endpoint (http); others send one by one.
        # Such a backend claims batches that are due whatever EMAIL_BATCH_SIZE says now: ones
        # formed while it was higher (or by another instance) are delivered by nobody else.
        # It forms new ones only with EMAIL_BATCH_SIZE above 1.
        self._batch_mailer: BatchMailer | None = None
        self.batch_size = 1
        if supports_batches(mailer):
            self._batch_mailer = mailer  # type: ignore[assignment]  # checked just above
            self.batch_size = settings.email_batch_size
        elif settings.email_batch_size > 1:
            log.warning(
                "EMAIL_BATCH_SIZE=%d: this backend (%s) has no batch endpoint; sending "
                "one email per request",
                settings.email_batch_size,
                type(mailer).__name__,
            )
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

    @property
    def forming(self) -> bool:
        """This sender forms new batches (EMAIL_BATCH_SIZE above 1, a batch endpoint)."""
        return self._batch_mailer is not None and self.batch_size > 1

    async def drain_once(self) -> int:
        """Claim one batch (as the rate limit allows), send it, mark it; returns rows handled.
        A sender with a batch endpoint claims batches first, then rows sent alone."""
        if self._stopping:
            return 0
        found: list[Batch] = []
        if self._batch_mailer is not None:
            claimed = await self._claim_batches(self._batches_per_claim(), wait_for_tokens=True)
            found = claimed or []
        batch = None
        if not self._stopping:
            batch = await self._claim(
                self.settings.outbox_batch_size, wait_for_tokens=True, batchable=not self.forming
            )
        rows = batch.rows if batch is not None else []
        if not found and not rows:
            return 0
        await asyncio.gather(
            *(self._deliver_batch(b) for b in found),
            *(self._deliver(batch, row) for row in rows if batch is not None),
        )
        return sum(b.size for b in found) + len(rows)

    async def next_batch_due(self) -> float | None:
        """Seconds until a pending batch nobody holds is due (see `outbox.next_batch_due`);
        None if there is none, or this sender cannot send batches."""
        if self._batch_mailer is None:
            return None
        async with self._connection() as conn:
            return await next_batch_due(conn, schema=self.settings.db_schema)

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[Conn]:
        """A pooled connection for a few short statements, all within DB_QUERY_TIMEOUT: a
        database or pooler that stops answering with its socket open would otherwise stall
        claims and outcomes until the kernel gives up on the socket (see `db.deadline`)."""
        s = self.settings
        async with self.pool.acquire(timeout=s.db_acquire_timeout) as conn:
            with db.deadline(conn, s.db_query_timeout):
                yield conn

    async def _claim(
        self, want: int, *, wait_for_tokens: bool, batchable: bool = True
    ) -> Claim | None:
        """A claim of up to `want` rows (with `batchable` False only those a batch sender
        sends alone); None when the rate limit has nothing for us yet."""
        s = self.settings
        while True:
            async with self._connection() as conn:
                # Each row is a request: no more than could start within one window.
                space = await room(conn, schema=s.db_schema, win=self._window, want=want)
                if space.free:
                    batch = await claim(
                        conn,
                        schema=s.db_schema,
                        limit=space.free,
                        lease=s.outbox_lease,
                        batchable=batchable,
                    )
                    self._held += len(batch.rows)
                    return batch
            if not wait_for_tokens or self._stopping:
                self._rate_wait = space.wait
                return None
            await asyncio.sleep(min(space.wait, s.outbox_poll_interval))

    async def _deliver(self, batch: Claim, row: Row) -> None:
        """Send one claimed row and write its outcome (`_send`)."""
        await self._send(
            _Unit(
                "row",
                row.id,
                1,
                batch,
                attempt=lambda turn: self._attempt(row, turn),
                finish=lambda outcome: self._finish(batch, row, outcome),
                give_back=lambda attempted: self._give_back(batch, row, attempted=attempted),
            )
        )

    async def _deliver_batch(self, batch: Batch) -> None:
        """Send one claimed batch and write its outcome (`_send`); one given back is unchanged:
        the next attempt sends the same members, bytes and key."""
        await self._send(
            _Unit(
                "batch",
                batch.id,
                batch.size,
                batch,
                attempt=lambda turn: self._attempt_batch(batch, turn),
                finish=lambda outcome: self._finish_batch(batch, outcome),
                give_back=lambda attempted: self._give_back_batch(batch, attempted=attempted),
            )
        )

    async def _send(self, unit: _Unit[Any]) -> None:
        """Send one claimed row or batch within a slot and a turn, write its outcome, and give
        it back if it was not sent.

        One whose send ended but whose outcome could not be written (a bug, a cut-off at
        shutdown) is never given back due at once: it may have been delivered, and a retry
        needs its backoff. Its lease is that backoff."""
        started = False
        finished = False
        outcome: _Outcome | None = None
        try:
            async with self._slots:
                if self._stopping or not self._lease_allows_send(unit.lease):
                    return
                turn = await self._take_turn(unit.lease.deadline)
                if turn is False or self._stopping or not self._lease_allows_send(unit.lease):
                    return
                started = True
                outcome = await unit.attempt(turn)
                if outcome is None:  # 429: not an attempt; given back, due when the pause ends
                    started = False
                    return
            # Outside the slot: the next send starts while this outcome is being written.
            await unit.finish(outcome)
            finished = True
        except Exception:
            if outcome is None:
                raise
            finished = True
            self.stats.unwritten += unit.size
            log.exception(
                "could not record outbox %s %s as %s; it comes back after its lease",
                unit.kind,
                unit.id,
                outcome.outcome,
                extra={"event": "outbox_unwritten", unit.kind: unit.id, "instance": self.instance},
            )
        finally:
            if not finished:
                if outcome is None:
                    await unit.give_back(started)
                else:
                    log.warning(
                        "outbox %s %s: outcome %s not recorded (stopped); it comes back "
                        "after its lease",
                        unit.kind,
                        unit.id,
                        outcome.outcome,
                    )
            self._held -= 1
            self._changed.set()

    def _lease_allows_send(self, batch: Claim | Batch) -> bool:
        # A send started with less lease left than it may take could still be running when
        # another sender takes the row over: give it back instead.
        needed = min(self.max_send_time, self.settings.outbox_lease / 2)
        return batch.deadline - time.monotonic() >= needed

    def _past_its_end(self, key_age: float, attempts: int, key: str) -> str | None:
        """Why a claimed row or batch is dead before it is sent, if it is: its key is past the
        retry window (the provider may no longer know it), or earlier claims all ended without
        an outcome (the sender died each time)."""
        s = self.settings
        if key_age >= s.outbox_retry_window:
            return (
                f"retry window ended before attempt {attempts}: {key} is {key_age:.0f}s old, "
                f"past OUTBOX_RETRY_WINDOW ({s.outbox_retry_window:g}s)"
            )
        if attempts > s.outbox_max_attempts:
            return f"claimed {attempts - 1} times without an outcome; gave up"
        return None

    def _backoff(self, attempts: int, retry_after: float | None) -> float:
        s = self.settings
        return backoff_delay(
            attempts,
            base=s.outbox_backoff_base,
            cap=s.outbox_backoff_max,
            retry_after=retry_after,
            rng=self._rng,
        )

    async def _take_turn(self, deadline: float) -> _Start | Literal[False] | None:
        """Wait until the shared window lets this request start (`pace.reserve`), and return
        its start as recorded (None: no window, or no row to keep it). False when the wait
        would run too near the lease's end, or the database cannot say: the caller gives its
        claim back unsent. The start is taken at the moment of sending, not booked ahead: a
        sender that wakes late records a late start, and the next requests count from it."""
        win = self._window
        if win is None:
            return None
        needed = min(self.max_send_time, self.settings.outbox_lease / 2)
        while True:
            asked = time.monotonic()
            try:
                async with self._connection() as conn:
                    turn = await reserve(conn, schema=self.settings.db_schema, win=win, ahead=0)
            except DATABASE_ERRORS as exc:
                log.debug("outbox: no start time from the rate window: %s", describe(exc))
                return False
            if turn.granted:
                return None if turn.at is None else _Start(turn.at, time.monotonic())
            if self._stopping or time.monotonic() + turn.wait > deadline - needed:
                return False
            # The wait counts from when we asked (the answer's trip back is not added to it);
            # waiters wake a little apart, so they do not all ask at the same instant.
            await asyncio.sleep(
                max(0.0, asked + turn.wait - time.monotonic()) + self._rng.uniform(0, 0.003)
            )

    async def _heed(self, start: _Start | None, result: SendResult) -> None:
        """Move the start of a request that left late (`pace.correct`), and record what an
        answer said about the provider's limit, for every sender to pace by (`pace.observe`);
        only answers that can change the pace cost a statement."""
        if start is not None and result.written is not None:
            late = result.written - start.taken
            if late > LATE:
                try:
                    async with self._connection() as conn:
                        await correct(conn, schema=self.settings.db_schema, at=start.at, late=late)
                except DATABASE_ERRORS as exc:
                    log.debug("outbox: could not move a late start: %s", describe(exc))
        rate = result.rate
        at = start.at if start is not None else None
        if rate is None or not worth_recording(rate, self._window, self._known_limit):
            return
        if rate.throttled:
            self.stats.throttled += 1
            log.info(
                "outbox: the provider refused a request for its rate limit (429, Retry-After "
                "%s); every sender waits",
                rate.retry_after,
                extra={"event": "outbox_throttled", "instance": self.instance},
            )
        try:
            async with self._connection() as conn:
                await observe(
                    conn, schema=self.settings.db_schema, win=self._window, at=at, info=rate
                )
            self._known_limit = rate.limit if rate.limit is not None else self._known_limit
        except DATABASE_ERRORS as exc:
            log.debug("outbox: could not record the provider's rate headers: %s", describe(exc))

    async def _attempt(self, row: Row, start: _Start | None = None) -> Mark | None:
        """Send one row; its outcome, or None when the provider refused it for its rate
        limit (429: not an attempt, and no backoff beyond what the provider asked)."""
        reason = self._past_its_end(row.key_age, row.attempts, "the key")
        if reason is not None:
            return Mark("dead", error=reason)
        with self.tracing.send(
            "email send", (row.traceparent,), email_id=row.id, attempt=row.attempts
        ) as span:
            try:
                result = await self.mailer.send(row.email)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug in a backend must not stop delivery of other rows
                log.exception("mailer failed on outbox row %s", row.id)
                result = SendResult.retry(error_text(f"mailer error: {type(exc).__name__}: {exc}"))
            _annotate(span, result)
        await self._heed(start, result)
        if result.rate is not None and result.rate.throttled:
            return None
        if result.status == "sent":
            return Mark("sent", message_id=result.message_id)
        if result.status == "failed":
            return Mark("dead", error=result.error or "permanent failure")
        delay = self._backoff(row.attempts, result.retry_after)
        return Mark("retry", delay=delay, error=result.error or "retryable failure")

    async def _while_leased(
        self, write: Callable[[], Awaitable[T]], deadline: float, what: str
    ) -> tuple[bool, T | None]:
        """Write an outcome, again after a database outage while the claim's lease lasts:
        (True, what `write` returned), or (False, None) once the lease is too near its end, when
        the row or batch comes back on its own and is sent again under the same key."""
        s = self.settings
        while True:
            try:
                return True, await write()
            except DATABASE_ERRORS as exc:
                if time.monotonic() + s.outbox_poll_interval >= deadline:
                    log.warning(
                        "could not record %s: %s; it is retried after its lease",
                        what,
                        describe(exc),
                    )
                    return False, None
                await asyncio.sleep(min(1.0, s.outbox_poll_interval))

    async def _finish(self, batch: Claim, row: Row, outcome: Mark) -> None:
        """Write the outcome; a database outage is retried while the lease lasts, after that
        the row comes back on its own and is sent again with the same key. An outcome the
        database refuses is not retried (the writer has logged it): the row waits out its
        lease."""
        try:
            written, status = await self._while_leased(
                lambda: self._record(batch.token, row.id, outcome),
                batch.deadline,
                f"outbox row {row.id} as {outcome.outcome}",
            )
        except OutcomeRefused:
            self.stats.unwritten += 1
            return  # logged by the writer; the row comes back after its lease
        if not written:
            return
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

    async def _record(self, token: uuid.UUID, row_id: int, outcome: Mark) -> str | None:
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
        except DATABASE_ERRORS as exc:
            log.warning(
                "could not release outbox row %s (%s); it comes back after its lease",
                row.id,
                describe(exc),
            )

    # -- batches (EMAIL_BATCH_SIZE > 1) ------------------------------------------------------

    def _batches_per_claim(self) -> int:
        # OUTBOX_BATCH_SIZE stays the claim's size in rows, rounded up to whole batches.
        return max(1, math.ceil(self.settings.outbox_batch_size / self.batch_size))

    async def _claim_batches(self, want: int, *, wait_for_tokens: bool) -> list[Batch] | None:
        """Up to `want` batches, one rate-limit token each: first batches due again (their
        members and bytes are already frozen), then new ones formed from due rows. None when
        the rate limit has nothing for us yet."""
        s = self.settings
        while True:
            async with self._connection() as conn:
                space = await room(conn, schema=s.db_schema, win=self._window, want=want)
                if space.free:
                    found = []
                    try:
                        found = await claim_batches(
                            conn, schema=s.db_schema, limit=space.free, lease=s.outbox_lease
                        )
                        if len(found) < space.free and self.forming:
                            found += await form_batches(
                                conn,
                                schema=s.db_schema,
                                batches=space.free - len(found),
                                size=self.batch_size,
                                lease=s.outbox_lease,
                            )
                    except BaseException:
                        # Batches claimed before the formation failed are given back unsent,
                        # not left to their lease (and counted as an attempt).
                        if found:
                            await _quietly(release_batches(conn, found, schema=s.db_schema))
                        raise
                    self._held += len(found)
                    return found
            if not wait_for_tokens or self._stopping:
                self._rate_wait = space.wait
                return None
            await asyncio.sleep(min(space.wait, s.outbox_poll_interval))

    async def _attempt_batch(self, batch: Batch, start: _Start | None = None) -> BatchMark | None:
        """As `_attempt`, for a batch (None: a 429, given back unchanged)."""
        assert self._batch_mailer is not None
        reason = self._past_its_end(batch.key_age, batch.attempts, "the batch key")
        if reason is not None:
            return BatchMark("dead", error=reason)
        with self.tracing.send(
            "email send batch",
            batch.queued_by,
            batch_id=batch.id,
            size=batch.size,
            attempt=batch.attempts,
        ) as span:
            try:
                result = await self._batch_mailer.send_batch(batch.key, batch.body, batch.size)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug in a backend must not stop delivery of others
                log.exception("mailer failed on outbox batch %s", batch.id)
                error = error_text(f"mailer error: {type(exc).__name__}: {exc}")
                result = BatchResult(SendResult.retry(error))
            _annotate(span, result.request)
        answer = result.request
        await self._heed(start, answer)
        if answer.rate is not None and answer.rate.throttled:
            return None
        if answer.status == "sent":
            return BatchMark(
                "done",
                members=tuple(
                    Mark("sent", message_id=m.message_id)
                    if m.status == "sent"
                    else Mark("dead", error=m.error or "refused by the provider")
                    for m in result.members
                ),
            )
        if answer.status == "failed":
            return BatchMark("dead", error=answer.error or "permanent failure")
        delay = self._backoff(batch.attempts, answer.retry_after)
        return BatchMark("retry", delay=delay, error=answer.error or "retryable failure")

    async def _finish_batch(self, batch: Batch, outcome: BatchMark) -> None:
        """As `_finish`, for a batch: an outage is retried while the lease lasts; after that
        the batch comes back on its own and is sent again, the same bytes under the same key."""
        s = self.settings

        async def write() -> BatchMarked | None:
            async with self._connection() as conn:
                return await mark_batch(
                    conn,
                    batch,
                    outcome,
                    schema=s.db_schema,
                    max_attempts=s.outbox_max_attempts,
                    retry_window=s.outbox_retry_window,
                )

        written, marked = await self._while_leased(
            write, batch.deadline, f"outbox batch {batch.id} as {outcome.outcome}"
        )
        if not written:
            return
        if marked is None:
            self.stats.lost += batch.size
            log.warning(
                "outbox batch %s was taken over by another sender (lease ended mid-send); "
                "its outcome %s is not recorded",
                batch.id,
                outcome.outcome,
                extra={"event": "outbox_lost_claim", "batch": batch.id, "instance": self.instance},
            )
            return
        statuses = list(marked.rows.values())
        self.stats.sent += statuses.count("sent")
        self.stats.dead += statuses.count("dead")
        if marked.status == "pending":
            self.stats.retried += batch.size
            log.info(
                "outbox batch %s (%d emails) retried in %.1fs: %s",
                batch.id,
                batch.size,
                outcome.delay,
                outcome.error,
                extra={"event": "outbox_retry", "batch": batch.id, "attempts": batch.attempts},
            )
        elif statuses.count("dead"):
            log.warning(
                "outbox batch %s: %d of %d emails dead: %s",
                batch.id,
                statuses.count("dead"),
                batch.size,
                outcome.error or next((m.error for m in outcome.members if m.error), None),
                extra={"event": "outbox_dead", "batch": batch.id, "attempts": batch.attempts},
            )

    async def _give_back_batch(self, batch: Batch, *, attempted: bool) -> None:
        try:
            async with self._connection() as conn:
                if await release_batches(
                    conn, [batch], schema=self.settings.db_schema, attempted=attempted
                ):
                    self.stats.released += batch.size
        except DATABASE_ERRORS as exc:
            log.warning(
                "could not release outbox batch %s (%s); it comes back after its lease",
                batch.id,
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
                found: list[Batch] | None = []
                batch: Claim | None = None
                try:
                    # Batches first (already frozen, their retries are due), then rows sent
                    # alone: all rows, or with EMAIL_BATCH_SIZE above 1 those never to batch.
                    if self._batch_mailer is not None:
                        found = await self._claim_batches(
                            self._batches_per_claim(), wait_for_tokens=False
                        )
                    if found is not None:
                        batch = await self._claim(
                            s.outbox_batch_size, wait_for_tokens=False, batchable=not self.forming
                        )
                except DATABASE_ERRORS as exc:
                    self._report_db_trouble(exc)
                    await _wait_any(stop, within=s.outbox_poll_interval)
                    continue
                finally:
                    # Claimed before a later claim failed: delivered all the same.
                    for one in found or []:
                        task = asyncio.create_task(self._deliver_batch(one))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                self._report_db_ok()
                if batch is None:  # rate limited
                    await _wait_any(stop, within=min(self._rate_wait, s.outbox_poll_interval))
                    continue
                for row in batch.rows:
                    task = asyncio.create_task(self._deliver(batch, row))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                if not batch.rows and not found:
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
        except DATABASE_ERRORS as exc:
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
            except DATABASE_ERRORS as exc:
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


def _annotate(span: Span, result: SendResult) -> None:
    if not span.recording:
        return
    span.set(outcome=result.status, reason=result.error, retry_after=result.retry_after)
    if result.status != "sent":
        span.fail(result.error or result.status)


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


async def _drain_until_empty(sender: Sender, stop: asyncio.Event) -> None:
    """`drain --once`: until nothing is due. A batch waiting out a backoff no longer than
    OUTBOX_BACKOFF_MAX (or a lease that ended) is waited for, so a drain started to finish
    batches formed earlier does not exit while one is about to be retried. Single rows in
    backoff are not: they keep their own key and any sender delivers them later."""
    while not stop.is_set():
        if await sender.drain_once():
            continue
        wait = await sender.next_batch_due()
        if wait is None or wait > sender.settings.outbox_backoff_max:
            return
        await _wait_any(stop, within=max(wait, sender.settings.outbox_poll_interval / 10))


async def run_in_app(
    pool: asyncpg.Pool, settings: Settings, stop: asyncio.Event, tracing: Tracing | None = None
) -> None:
    """The delivery loop of a service instance, on the service's pool, until `stop`."""
    mailer = create_mailer(settings)
    try:
        await Sender(pool, settings, mailer, settings.instance_name, tracing=tracing).run(stop)
    finally:
        await mailer.aclose()


async def run_sender(settings: Settings, *, once: bool = False) -> None:
    """A dedicated delivery process (`python -m cronlock outbox drain`): its own pool, until SIGTERM
    or SIGINT; with `once`, until nothing is due. It traces as the service does (from_env)."""
    with from_env():
        await _run_sender(settings, once=once)


async def _run_sender(settings: Settings, *, once: bool) -> None:
    # Each concurrent send marks its row on a connection of its own, plus the claim.
    wanted = settings.outbox_concurrency + 2
    if settings.db_pool_max_size < wanted:
        settings = settings.model_copy(update={"db_pool_max_size": wanted})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    sender: Sender | None = None

    def on_signal() -> None:
        stop.set()
        if sender is not None:
            sender.stop_claiming()  # `--once`: the batch in hand is not sent on either

    # Installed before the pool connects: from here on a SIGTERM always stops gracefully.
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    try:
        pool = await db.create_pool(settings, settings.database_url)
        mailer = create_mailer(settings)
        try:
            sender = Sender(pool, settings, mailer, settings.instance_name)
            if once:
                await _drain_until_empty(sender, stop)
            else:
                await sender.run(stop)
        finally:
            await mailer.aclose()
            await asyncio.wait_for(pool.close(), settings.outbox_shutdown_timeout)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
