"""One trigger, start to end: lock -> slot check -> run -> ledger, on one connection and one
transaction.

The advisory lock is transaction-level, so it lives exactly as long as the transaction that
also carries the job's writes and its succeeded ledger row: commit publishes all three, and
anything else (an exception, a timeout, a killed instance, a dropped connection) rolls all of
them back and frees the lock with them.

Long on purpose: one trigger, start to end; the order of lock, slot check, run and ledger within
one transaction is the guarantee, read top down.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import asyncpg

from cronlock.core import cancel, ledger, pause, schedules
from cronlock.core.failure import failure_of
from cronlock.core.fanout_runner import FanoutRunner
from cronlock.core.jobs import Job, JobContext, Registry, Trigger, call
from cronlock.core.lease_runner import LeaseRunner
from cronlock.core.outcome import Kind, Outcome, annotate
from cronlock.core.schedule import ScheduleError, slot_window
from cronlock.db.lock import (
    LockKey,
    done_already,
    done_question,
    lock_text,
    probe,
    reset_session,
    try_lock,
    verify_keys,
)
from cronlock.db.orm import SessionFactory, Sessions
from cronlock.db.pool import Conn, Database, deadline, terminate
from cronlock.errors import (
    CONNECTION_ERRORS,
    DATABASE_ERRORS,
    DRIVER_ERRORS,
    STANDBY_REASON,
    DatabaseUnavailable,
    InvalidTrigger,
    describe,
    translate,
)
from cronlock.settings import Settings, scrub
from cronlock.tracing import Tracing

if TYPE_CHECKING:
    from cronlock.core.metrics import Metrics

log = logging.getLogger("cronlock.run")


# Skips answered many times a slot by design; DEBUG with LOG_SKIPS=false (see `Runner.log_outcome`).
ROUTINE_SKIPS = ("already running", "already done", "already attempted")


@dataclass
class _Lease:
    """A won lock: the connection, its open transaction and the recorded run."""

    job: Job
    conn: asyncpg.pool.PoolConnectionProxy
    tx: asyncpg.transaction.Transaction
    ctx: JobContext
    attempt: int = 1  # at the slot (retries), for the run's span
    started: float = field(default_factory=time.monotonic)
    # A dynamic schedule's run: its recording transaction advances the row (core/schedules.py).
    planned: schedules.Planned | None = None


def _cancelled_by_operator(error: BaseException) -> bool:
    """pg_cancel_backend (`python -m cronlock cancel`) rather than a statement timeout: both are
    SQLSTATE 57014, told apart by the server's message (on a server whose messages are not in
    English the run is recorded as failed, as before)."""
    return isinstance(error, asyncpg.exceptions.QueryCanceledError) and "user request" in str(error)


class Runner:
    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        db: Database,
        metrics: Metrics | None = None,
        *,
        session_class: SessionFactory | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.settings = settings
        # Spans (cronlock/tracing.py): decided once here; OFF costs a shared no-op per trigger.
        self.tracing = tracing if tracing is not None else Tracing.detect(settings)
        self.registry = registry
        self.db = db
        self.metrics = metrics
        # What `ctx.session` is made with (cronlock/db/orm.py): SQLAlchemy's AsyncSession by
        # default, SQLModel's if asked; SQLAlchemy itself is imported at the first session.
        self.sessions = Sessions(session_class)
        # Jobs this instance is running (or deciding about) now, per key for keyed jobs (None
        # for the others): a second trigger for one of them is answered "already running"
        # without touching the database, so skips stay answerable even when long jobs hold
        # every pooled connection. Other keys of a keyed job go on to their own locks.
        self.local: dict[tuple[str, str | None], int | None] = {}
        self.background: set[asyncio.Task[Outcome]] = set()
        # The cancel watchers of running jobs (cronlock/core/cancel.py), kept until they end.
        self.watchers: set[asyncio.Task[str | None]] = set()
        # Lock transactions at once, at most one fewer than the pool's connections: each also
        # needs a second connection for a moment (its ledger row commits outside it), and if
        # every connection held a lock transaction waiting for one, none would get it (every
        # job refused, and their locks held meanwhile make other instances skip them too).
        self.lock_slots = asyncio.Semaphore(max(1, db.max_connections - 1))
        # Lock keys as computed here; checked against the server's once (see `_probe`).
        self.probe_keys: dict[str, LockKey] | None = {
            name: registry.lock(name) for name in registry
        }
        self._keys_checked = False
        # The database's clock minus this instance's, as the last probe saw it: the done hint
        # reads the database's time, so an instance whose clock is off still gets the hint
        # right (it only saves work, but the lock-table scan it saves is the probe's dearest).
        self._clock_offset = timedelta(0)
        # Per job (without a key): a slot the probe saw done, and the one-round-trip question
        # whether it still is (`_probe`), written once for every trigger of the slot.
        self._done: dict[str, tuple[datetime, str]] = {}
        self.leases = LeaseRunner(self)
        self.fanouts = FanoutRunner(self)

    async def trigger(
        self,
        job: Job,
        *,
        force: bool = False,
        slot: datetime | None = None,
        params: Any = None,
        wait: bool = True,
        source: str = "http",
        retry_of: ledger.Run | None = None,
        first_attempt: bool = False,
        planned: schedules.Planned | None = None,
        message_id: str | None = None,
    ) -> Outcome:
        """Run `job` if it is not running anywhere and its slot is not done yet. `planned`: a
        dynamic schedule's run, claimed by the dispatcher (cronlock/core/schedules.py). `retry_of`:
        this run is the next attempt at that failed one, for its slot (cronlock/core/retries.py).
        `first_attempt` (the built-in scheduler, catch-up): only if no attempt at the slot
        exists, checked under the lock; a failed one is the retries' business. `message_id`: a
        signed delivery's (QStash's), recorded with the run; once a run of it succeeded, the
        message is "already done" (that run's id), whatever the job and its slot."""
        if not self.tracing.on:  # the hot path of skips: not even a no-op span
            return await self._trigger(
                job, force, slot, params, wait, source, retry_of, first_attempt, planned, message_id
            )
        # The trigger's span is current throughout: the run's span (started once the lock is
        # won) is its child, in this task or in the one that runs on in the background.
        with self.tracing.trigger(job.name, source) as span:
            outcome = await self._trigger(
                job, force, slot, params, wait, source, retry_of, first_attempt, planned, message_id
            )
            annotate(span, outcome)
            return outcome

    async def _trigger(
        self,
        job: Job,
        force: bool,
        slot: datetime | None,
        params: Any,
        wait: bool,
        source: str,
        retry_of: ledger.Run | None,
        first_attempt: bool,
        planned: schedules.Planned | None,
        message_id: str | None,
    ) -> Outcome:
        # What the ledger records: `manual` for an operator's forced run and for any run of a
        # job without a schedule (nothing schedules it: each run is someone's request). What
        # decides (the pause's exemption, "already done") is `force`, not this label.
        trigger: Trigger = (
            "manual"
            if force or (slot is None and planned is None and job.schedule is None)
            else "backfill"
            if slot is not None
            else "scheduled"
        )
        if slot is not None:
            self._check_backfill_slot(job, slot, force, retry=retry_of is not None)
        # A keyed job's params were validated (cronlock/core/jobs.py `parse_params`), its key with
        # them.
        key = job.key_of(params)
        local = (job.name, key)
        if local in self.local:
            return self.skip(job, "already running", None, trigger, source, key)
        self.local[local] = None
        handed_off = False
        try:
            # A delivery with a message id goes to the lock: its "already done" names a run. A
            # dispatched row was just claimed for this run: what the probe would skip (paused,
            # running, attempted) is decided under the lock anyway, one round trip less.
            probing = message_id is None and planned is None
            if not force and slot is None and self.probe_keys and probing:
                skipped = await self._probe(job, key, trigger, source)
                if skipped is not None:
                    return skipped
            if job.fanout is not None:
                # Planned in the lock's transaction, then worked by every instance's workers.
                return await self.fanouts.start(
                    job,
                    key,
                    trigger,
                    slot,
                    params,
                    source,
                    forced=force,
                    retry_of=retry_of,
                    first_attempt=first_attempt,
                )
            if job.lease is not None:
                started = await self.leases.start(
                    job,
                    key,
                    trigger,
                    slot,
                    params,
                    source,
                    forced=force,
                    retry_of=retry_of,
                    first_attempt=first_attempt,
                    message_id=message_id,
                    planned=planned,
                )
                assert started is not None
                # An accepted run is the lease runner's now: it clears `local` at its end.
                handed_off = started.kind == "accepted"
                return started
            lease_or_skip = await self._acquire(
                job,
                key,
                trigger,
                force,
                slot,
                params,
                source,
                retry_of,
                first_attempt,
                planned,
                message_id,
            )
            if isinstance(lease_or_skip, Outcome):
                return lease_or_skip
            lease = lease_or_skip
            self.local[local] = lease.ctx.run_id
            if not wait:
                task = asyncio.create_task(self._finish(lease, source))
                self.background.add(task)
                task.add_done_callback(self.background.discard)
                handed_off = True
                return Outcome(
                    job.name,
                    "accepted",
                    lease.ctx.run_id,
                    lease.ctx.slot,
                    trigger=trigger,
                    key=key,
                )
            return await self._finish(lease, source)
        finally:
            if not handed_off:
                self.local.pop(local, None)

    def _lock_key(self, job: Job, key: str | None) -> LockKey:
        """The probe's key for the run: the job's (checked against the server's), or, for a
        keyed run, hashed here by the same mirror."""
        assert self.probe_keys is not None
        return self.probe_keys[job.name] if key is None else self.registry.lock(job.name, key)

    async def _probe(
        self, job: Job, key: str | None, trigger: Trigger, source: str
    ) -> Outcome | None:
        """The cheap first look: skip without a transaction when the lock is visibly held or
        the slot is done; None means "go and try for real"."""
        await self.db.ensure_ready()
        assert self.probe_keys is not None
        hint = self._done_hint(job)
        # Not for a keyed run: its key is a caller's, never written into statement text.
        known = self._done.get(job.name) if key is None else None
        conn = await self.db.acquire()
        try:
            with deadline(conn, self.settings.db_query_timeout):
                if not self._keys_checked:
                    await self._check_keys(conn)
                    if self.probe_keys is None:
                        return None
                if known is not None and hint == known[0]:
                    # The slot this instance last saw done is still the likely one: ask only
                    # whether it still is, in one round trip (a storm's late duplicates).
                    if await done_already(conn, known[1]):
                        return self.skip(job, "already done", hint, trigger, source, key)
                    self._done.pop(job.name, None)
                sent = datetime.now(UTC)
                row = await probe(
                    conn,
                    self.settings.db_schema,
                    job.name,
                    self._lock_key(job, key),
                    scheduled=job.schedule is not None,
                    done_hint=hint,
                    run_key=key,
                    lease=job.lease is not None,
                )
        except DRIVER_ERRORS as exc:
            raise translate(exc) from exc
        finally:
            await self.db.release(conn)
        # Taken as the probe left: the round trip makes the hint run a little ahead, which
        # at worst costs the lock-table scan, never the real attempt a lagging hint would.
        self._clock_offset = row["db_now"] - sent
        if row["standby"]:
            raise DatabaseUnavailable(STANDBY_REASON)
        if row["paused"]:
            return self.skip(job, "paused", None, trigger, source, key)
        # When both hold (a concurrent trigger is looking at a slot that is done), "already
        # done" wins: it is the more useful answer, and the lock holder can only be deciding.
        if job.schedule is not None:
            slot = job.schedule.slot_for(row["db_now"], job.early_tolerance)
            if row["done_slot"] == slot:
                if key is None:
                    question = done_question(
                        self.settings.db_schema,
                        job.name,
                        self._lock_key(job, key),
                        slot=slot,
                        window=slot_window(job.schedule, slot, job.early_tolerance),
                        lease=job.lease is not None,
                    )
                    self._done[job.name] = (slot, question)
                return self.skip(job, "already done", slot, trigger, source, key)
        if row["running"]:
            return self.skip(job, "already running", None, trigger, source, key)
        # running is None: the hint named a done slot the database's clock disagrees with (a
        # tick between the two clocks), so the lock was not looked at; the real attempt decides.
        return None

    def _done_hint(self, job: Job) -> datetime | None:
        """The slot a trigger is likely for, by this instance's clock corrected with the offset
        the last probe saw, only for the probe to skip its lock-table scan when that slot is
        done; never a decision (see `_probe`)."""
        if job.schedule is None:
            return None
        return job.schedule.slot_for(datetime.now(UTC) + self._clock_offset, job.early_tolerance)

    async def _check_keys(self, conn: Conn) -> None:
        assert self.probe_keys is not None
        schema = self.settings.db_schema
        names = {name: lock_text(schema, name) for name in self.probe_keys}
        server = await verify_keys(conn, list(names.values()), self.settings.lock_namespace)
        if any(server[names[name]] != key.key for name, key in self.probe_keys.items()):
            # A big-endian server hashes differently: keep to the lock statement alone.
            log.warning("lock keys computed here differ from the server's; probe disabled")
            self.probe_keys = None
        self._keys_checked = True

    def _check_backfill_slot(self, job: Job, slot: datetime, force: bool, retry: bool) -> None:
        if force:
            raise InvalidTrigger("force and slot cannot be combined", ("slot",))
        if job.dynamic and retry:
            # A key's failed slot, a tick of the key's schedule row: checked under its lock
            # (`_decide_retry`), where the row is read.
            if slot.tzinfo is None:
                raise InvalidTrigger("slot needs a time zone offset", ("slot",))
            return
        if job.dynamic:
            raise InvalidTrigger(
                f"job {job.name!r} is dynamic: its slots are its keys' schedules, run by the "
                "built-in scheduler; there is no slot to backfill",
                ("slot",),
            )
        if job.schedule is None:
            raise InvalidTrigger(
                f"job {job.name!r} has no schedule: there is no slot to backfill", ("slot",)
            )
        if slot.tzinfo is None:
            raise InvalidTrigger(
                "slot needs a time zone offset, e.g. 2026-01-01T07:00:00Z", ("slot",)
            )
        try:
            tick = job.schedule.is_tick(slot)
        except (OverflowError, ValueError) as exc:  # at the ends of the calendar (year 1, 9999)
            raise InvalidTrigger(
                f"{slot.isoformat()} is out of the schedule's range", ("slot",)
            ) from exc
        if not tick:
            raise InvalidTrigger(
                f"{slot.isoformat()} is not a tick of {job.schedule.expr!r}", ("slot",)
            )

    async def _acquire(
        self,
        job: Job,
        key: str | None,
        trigger: Trigger,
        forced: bool,
        backfill: datetime | None,
        params: Any,
        source: str,
        retry_of: ledger.Run | None = None,
        first_attempt: bool = False,
        planned: schedules.Planned | None = None,
        message_id: str | None = None,
    ) -> _Lease | Outcome:
        await self.db.ensure_ready()
        try:
            await asyncio.wait_for(self.lock_slots.acquire(), self.settings.db_acquire_timeout)
        except TimeoutError as exc:
            raise DatabaseUnavailable("no database connection free (pool exhausted)") from exc
        try:
            conn = await self.db.acquire()
        except BaseException:
            self.lock_slots.release()
            raise
        tx: asyncpg.transaction.Transaction | None = None
        handed_over = False
        try:
            with deadline(conn, self.settings.db_query_timeout):
                # Pinned: under a server default of repeatable read, the ledger's "already done"
                # would read a snapshot taken before the lock was won.
                tx = conn.transaction(isolation="read_committed")
                await tx.start()
                row = await try_lock(
                    conn,
                    lock_text(self.settings.db_schema, job.name, key),
                    self.settings.lock_namespace,
                    db_timeout=job.timeout + self.settings.db_timeout_margin,
                    client_check_interval=self.settings.db_client_check_interval,
                    server_version=self.db.server_version,
                )
                if row["standby"]:
                    self.db.standby, self.db.migrated = True, False
                    raise DatabaseUnavailable(STANDBY_REASON)
                if not row["locked"]:
                    return self.skip(job, "already running", None, trigger, source, key)
                now: datetime = row["db_now"]
                done = await self.message_done(conn, job, key, trigger, source, message_id)
                if done is not None:
                    return done
                # Under the lock: another instance may have made this retry already.
                if retry_of is not None and await ledger.retried(
                    conn, self.settings.db_schema, retry_of.id
                ):
                    return self.skip(job, "already retried", backfill, trigger, source, key)
                skip, slot = await self.decide_slot(
                    conn,
                    job,
                    key,
                    trigger,
                    backfill,
                    now,
                    forced=forced,
                    first_attempt=first_attempt,
                    planned=planned,
                )
            if skip is not None:
                return self.skip(job, skip, slot, trigger, source, key)
            async with self.db.connection() as other:
                run_id = await ledger.start(
                    other,
                    self.settings.db_schema,
                    job=job.name,
                    slot=slot,
                    trigger=trigger,
                    source=source,
                    instance=self.settings.instance_name,
                    backend_pid=row["backend_pid"],
                    started_at=now,
                    params=params.model_dump(mode="json")
                    if hasattr(params, "model_dump")
                    else None,
                    key=key,
                    attempt=retry_of.attempt + 1 if retry_of is not None else 1,
                    retry_of=retry_of.id if retry_of is not None else None,
                    message_id=message_id,
                )
            ctx = JobContext(
                conn=conn,
                job=job,
                run_id=run_id,
                slot=slot,
                now=now,
                params=params,
                trigger=trigger,
                instance=self.settings.instance_name,
                settings=self.settings,
                key=key,
                sessions=self.sessions,
            )
            handed_over = True
            attempt = retry_of.attempt + 1 if retry_of is not None else 1
            return _Lease(job, conn, tx, ctx, attempt, planned=planned)
        except DRIVER_ERRORS as exc:
            # The run's ledger row carries the request's params (and slot): a value the
            # database refuses there is the client's 422.
            raise translate(exc, input_from=("body",)) from exc
        finally:
            if not handed_over:
                try:
                    await self._close(conn, tx)
                finally:
                    self.lock_slots.release()

    async def message_done(
        self,
        conn: Conn,
        job: Job,
        key: str | None,
        trigger: Trigger,
        source: str,
        message_id: str | None,
    ) -> Outcome | None:
        """Under the job's lock: "already done", naming the run, when a run of this delivery's
        message succeeded (a redelivery); None to go on (no message id, or no success yet: a
        redelivery after a failed run is a retry, and runs)."""
        if message_id is None:
            return None
        run_id = await ledger.message_done(conn, self.settings.db_schema, message_id)
        if run_id is None:
            return None
        return self.skip(job, "already done", None, trigger, source, key, run_id=run_id)

    async def decide_slot(
        self,
        conn: Conn,
        job: Job,
        key: str | None,
        trigger: Trigger,
        backfill: datetime | None,
        now: datetime,
        *,
        forced: bool = False,
        first_attempt: bool = False,
        planned: schedules.Planned | None = None,
    ) -> tuple[str | None, datetime | None]:
        """The slot this run is for, and the reason to skip it, if any. `forced`: an operator's
        `force=true`, which runs whatever the pause or the slot's success say."""
        # Under the lock too: a pause committed since the probe still stops the run (lease
        # runs decide here as well). A forced run is an operator's: it runs. (Not the `manual`
        # label: a job without a schedule records each run as manual, and a pause stops it.)
        if not forced and await pause.is_paused(conn, self.settings.db_schema, job.name):
            return "paused", None
        if planned is not None:
            return await self._decide_planned(conn, job, planned, now)
        if job.dynamic and trigger == "backfill":
            assert backfill is not None
            assert key is not None
            return await self._decide_retry(conn, job, key, backfill, now)
        if job.schedule is None:
            return None, None
        if trigger == "backfill":
            assert backfill is not None
            if backfill > now:
                raise InvalidTrigger("a backfill slot must be in the past", ("slot",))
            if (now - backfill).total_seconds() > self.settings.backfill_window:
                raise InvalidTrigger(
                    f"slot is older than the backfill window ({self.settings.backfill_window} s)",
                    ("slot",),
                )
            slot = backfill
        else:
            slot = job.schedule.slot_for(now, job.early_tolerance)
            if forced:
                return None, slot
        if await ledger.already_done(conn, self.settings.db_schema, job.name, slot, key):
            return "already done", slot
        # The built-in scheduler ticks on every instance: one whose tick comes after another's
        # attempt failed (and freed the lock) must not make a second first attempt.
        if first_attempt and await ledger.slot_attempted(
            conn, self.settings.db_schema, job.name, slot
        ):
            return "already attempted", slot
        late = job.max_lateness is not None and now - slot > timedelta(seconds=job.max_lateness)
        if trigger == "scheduled" and late:
            return "too late", slot
        return None, slot

    async def _decide_planned(
        self, conn: Conn, job: Job, planned: schedules.Planned, now: datetime
    ) -> tuple[str | None, datetime | None]:
        """A dynamic schedule's slot, under its key's lock: only while the row still holds what
        was claimed, only as the slot's first attempt, not later than max_lateness after its
        start (tick plus spread)."""
        schema, slot = self.settings.db_schema, planned.slot
        if not await schedules.holds(conn, schema, planned):
            return "schedule changed", slot
        if await ledger.key_slot_attempted(conn, schema, job.name, planned.key, slot):
            # Done or failed: a failed one is the retries' business.
            return "already attempted", slot
        late = now - planned.start_at
        if job.max_lateness is not None and late > timedelta(seconds=job.max_lateness):
            return "too late", slot
        return None, slot

    async def _decide_retry(
        self, conn: Conn, job: Job, key: str, slot: datetime, now: datetime
    ) -> tuple[str | None, datetime | None]:
        """A retry of a dynamic key's failed slot (the only backfill a dynamic job takes), under
        the key's lock: only while the key still has a schedule, not paused, of which the slot
        is a tick. A schedule removed, or changed so that the slot is none of its ticks, runs
        nothing more of the old one; a paused one waits (the retry loop comes back)."""
        schema = self.settings.db_schema
        try:
            row = await schedules.current(conn, schema, job.name, key)
            tick = row is not None and row.slots.is_tick(slot)
        except (ScheduleError, OverflowError, ValueError):  # a row written by hand
            row, tick = None, False
        if row is None:
            raise InvalidTrigger(
                f"key {key!r} of {job.name!r} has no schedule any more: its slot is not retried",
                ("slot",),
            )
        if row.paused:
            return "paused", slot
        if not tick:
            raise InvalidTrigger(
                f"{slot.isoformat()} is no tick of key {key!r}'s schedule any more: not retried",
                ("slot",),
            )
        if (now - slot).total_seconds() > self.settings.backfill_window:
            raise InvalidTrigger(
                f"slot is older than the backfill window ({self.settings.backfill_window} s)",
                ("slot",),
            )
        if await ledger.already_done(conn, schema, job.name, slot, key):
            return "already done", slot
        return None, slot

    async def _finish(self, lease: _Lease, source: str) -> Outcome:
        """Run the job under its lease and settle the ledger, whatever happens, in the run's
        span: current while the job runs, so that the job's own spans nest under it."""
        ctx = lease.ctx
        with self.tracing.run(
            ctx.job.name,
            ctx.run_id,
            attempt=lease.attempt,
            slot=ctx.slot,
            key=ctx.key,
            trigger=ctx.trigger,
        ) as span:
            outcome = await self._settle(lease, source)
            annotate(span, outcome)
            return outcome

    async def _settle(self, lease: _Lease, source: str) -> Outcome:
        job, conn, ctx = lease.job, lease.conn, lease.ctx
        try:
            task: asyncio.Task[Any] = asyncio.create_task(
                call(job.func, ctx), name=f"job:{job.name}:{ctx.run_id}"
            )
            # The holder watches its row for a cancel request (cronlock/core/cancel.py): any
            # instance can write one, and it reaches a job whatever it awaits.
            stop_watching = asyncio.Event()
            watcher = asyncio.create_task(
                cancel.watch(
                    self.db,
                    self.settings.db_schema,
                    ctx.run_id,
                    self.settings.cancel_poll_interval,
                    stop_watching,
                ),
                name=f"cancel-watch:{ctx.run_id}",
            )
            self.watchers.add(watcher)
            watcher.add_done_callback(self.watchers.discard)
            try:
                done, _ = await asyncio.wait(
                    {task, watcher}, timeout=job.timeout, return_when=asyncio.FIRST_COMPLETED
                )
            except asyncio.CancelledError:
                # Shutdown past its grace period: roll back and record why, then go.
                await self._abort(lease, task, "cancelled", "instance shut down while running")
                raise
            finally:
                stop_watching.set()  # it ends after its poll in flight, if any
            by = watcher.result() if watcher in done and task not in done else None
            if by is not None:
                await self._abort(lease, task, "cancelled", f"cancelled at the request of {by}")
                return self._outcome(lease, "cancelled", source, reason=f"cancelled by {by}")
            if not done:
                await self._abort(
                    lease, task, "timed_out", f"exceeded its timeout of {job.timeout} s"
                )
                return self._outcome(lease, "timed_out", source)
            # A task that ended cancelled (the job awaited something a library cancelled, or
            # raised CancelledError itself) has no exception() to give: it would raise.
            error: BaseException | None = (
                RuntimeError("the job's task was cancelled (it raised CancelledError)")
                if task.cancelled()
                else task.exception()
            )
            if error is None:
                processed = task.result()
                try:
                    # allow_nan=False: jsonb refuses NaN and Infinity, and the commit would fail.
                    result = json.loads(json.dumps(processed, allow_nan=False))
                except (TypeError, ValueError) as exc:
                    error = TypeError(
                        f"returned a {type(processed).__name__} that is not JSON: {exc}"
                    )
                else:
                    return await self._commit(lease, result, source)
            status: Kind = "cancelled" if _cancelled_by_operator(error) else "failed"
            secrets = self.settings.secret_values()
            failure = failure_of(error, secrets) if status == "failed" else None
            line = scrub(f"{type(error).__name__}: {error}", secrets)[:2000]
            await self._rollback(lease, status, line, failure)
            reason = scrub(str(error), secrets)[:200]
            return self._outcome(lease, status, source, reason=reason, failure=failure)
        finally:
            self.local.pop((job.name, ctx.key), None)
            try:
                await self.db.release(conn)
            finally:
                self.lock_slots.release()

    async def _commit(self, lease: _Lease, result: Any, source: str) -> Outcome:
        committing = False
        try:
            with deadline(lease.conn, self.settings.db_query_timeout):
                await reset_session(
                    lease.conn,
                    self.settings.db_schema,
                    db_timeout=lease.job.timeout + self.settings.db_timeout_margin,
                    client_check_interval=self.settings.db_client_check_interval,
                    server_version=self.db.server_version,
                )
                if lease.planned is not None:
                    await schedules.advance(lease.conn, self.settings.db_schema, lease.planned)
                duration = await ledger.succeed(
                    lease.conn, self.settings.db_schema, lease.ctx.run_id, result
                )
                committing = True
                await lease.tx.commit()
        except DATABASE_ERRORS as exc:
            # Whether the commit landed is unknown when the connection broke during it (the
            # server's error answer to COMMIT, say a deferred constraint, is a sure rollback):
            # the conditional update in `ledger.finish` leaves a succeeded row alone.
            unknown = committing and (
                isinstance(exc, CONNECTION_ERRORS) or not isinstance(exc, asyncpg.PostgresError)
            )
            reason = exc.reason if isinstance(exc, DatabaseUnavailable) else describe(exc)
            await self._rollback(lease, "failed", f"commit failed: {reason}")
            return self._outcome(
                lease, "failed", source, reason=f"commit failed: {reason}", commit_unknown=unknown
            )
        return self._outcome(lease, "succeeded", source, processed=result, duration=duration)

    async def _rollback(
        self, lease: _Lease, status: str, error: str, failure: dict[str, Any] | None = None
    ) -> None:
        try:
            with deadline(lease.conn, self.settings.db_query_timeout):
                await lease.tx.rollback()
        except Exception:  # the connection is gone: the server rolled back for us
            terminate(lease.conn)
        await self._record(lease.ctx.run_id, status, error, failure, lease.planned)

    async def _abort(self, lease: _Lease, task: asyncio.Task[Any], status: str, error: str) -> None:
        # Closing the socket ends the transaction server-side at once (and, with
        # client_connection_check_interval, even a statement that is still running), without
        # the cancel request that asyncpg would send through PgBouncer on task cancellation.
        terminate(lease.conn)
        task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.wait({task}, timeout=1.0)
        await asyncio.shield(self._record(lease.ctx.run_id, status, error, planned=lease.planned))

    async def _record(
        self,
        run_id: int,
        status: str,
        error: str,
        failure: dict[str, Any] | None = None,
        planned: schedules.Planned | None = None,
    ) -> None:
        try:
            async with self.db.connection() as conn:
                schema = self.settings.db_schema
                if planned is None:
                    await ledger.finish(conn, schema, run_id, status, error, failure)
                    return
                # A failed dynamic run: its schedule moves on with the record of its failure
                # (the slot is the retries' business), so a failing key never loops.
                async with conn.transaction():
                    await ledger.finish(conn, schema, run_id, status, error, failure)
                    await schedules.advance(conn, schema, planned)
        except Exception as exc:
            # The row stays `running` and is closed as `abandoned` once its lock is seen gone.
            log.warning("could not record run %s as %s: %s", run_id, status, describe(exc))

    def _outcome(
        self,
        lease: _Lease,
        kind: Kind,
        source: str,
        *,
        processed: Any = None,
        duration: float | None = None,
        reason: str | None = None,
        commit_unknown: bool = False,
        failure: dict[str, Any] | None = None,
    ) -> Outcome:
        return self.finished(
            lease.ctx,
            kind,
            source,
            lease.started,
            processed=processed,
            duration=duration,
            reason=reason,
            commit_unknown=commit_unknown,
            failure=failure,
        )

    def finished(
        self,
        ctx: JobContext,
        kind: Kind,
        source: str,
        started: float,
        *,
        processed: Any = None,
        duration: float | None = None,
        reason: str | None = None,
        commit_unknown: bool = False,
        failure: dict[str, Any] | None = None,
    ) -> Outcome:
        """The outcome of a run that took the lock (or a lease), logged and counted once; the
        duration defaults to the time since `started` (monotonic)."""
        if duration is None:
            duration = (time.monotonic() - started) * 1000
        outcome = Outcome(
            ctx.job.name,
            kind,
            ctx.run_id,
            ctx.slot,
            processed,
            round(duration, 3),
            reason,
            ctx.trigger,
            ctx.key,
            commit_unknown=commit_unknown,
            failure=failure,
        )
        self.log_outcome(outcome, source)
        return outcome

    def skip(
        self,
        job: Job,
        reason: str,
        slot: datetime | None,
        trigger: Trigger,
        source: str,
        key: str | None = None,
        *,
        run_id: int | None = None,
    ) -> Outcome:
        outcome = Outcome(
            job.name, "skipped", run_id, slot=slot, reason=reason, trigger=trigger, key=key
        )
        self.log_outcome(outcome, source)
        return outcome

    def log_outcome(self, outcome: Outcome, source: str) -> None:
        # One line per trigger. LOG_SKIPS=false moves routine skips (a scheduler retrying, a
        # trigger storm) to DEBUG, for logs a storm would flood; they are still counted in the
        # metrics.
        routine = outcome.kind == "skipped" and outcome.reason in ROUTINE_SKIPS
        level = logging.DEBUG if routine and not self.settings.log_skips else logging.INFO
        failure = outcome.failure or {}
        if failure:
            level = logging.ERROR  # a job that raised: someone should read its traceback
        if self.metrics is not None:
            self.metrics.observe(outcome)
        if not log.isEnabledFor(level):
            return
        log.log(
            level,
            "%s %s",
            outcome.job,
            outcome.kind,
            extra={
                "event": "run" if outcome.run_id else "trigger",
                "job": outcome.job,
                "key": outcome.key,
                "outcome": outcome.kind,
                "reason": outcome.reason,
                "run_id": outcome.run_id,
                "slot": outcome.slot.isoformat() if outcome.slot else None,
                "duration_ms": outcome.duration_ms,
                "instance": self.settings.instance_name,
                "trigger": outcome.trigger,
                "source": source,
                "error_type": failure.get("type"),
                "traceback": failure.get("traceback"),
            },
        )

    async def _close(
        self, conn: asyncpg.pool.PoolConnectionProxy, tx: asyncpg.transaction.Transaction | None
    ) -> None:
        if tx is not None:
            try:
                with deadline(conn, self.settings.db_query_timeout):
                    await tx.rollback()
            except Exception:
                terminate(conn)
        await self.db.release(conn)

    async def shutdown(self, grace: float) -> None:
        """Give background runs (`wait=false`) their grace period, then cancel them; then wait
        a little for runs still settling, before the pool they record with closes. Lease runs
        stop at once and give their leases up (cronlock/core/lease_runner.py `shutdown`)."""
        await self.leases.shutdown()
        if self.background:
            _, pending = await asyncio.wait(set(self.background), timeout=grace)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=5.0)
        # Runs answered in their request were cancelled by uvicorn at the end of its own
        # graceful-shutdown timeout, just before the lifespan got here: they are still rolling
        # back and recording `cancelled`, which needs the pool (else their rows stay `running`
        # until swept as `abandoned`).
        until = time.monotonic() + 5.0
        while self.local and time.monotonic() < until:  # noqa: ASYNC110 - polls a dict
            await asyncio.sleep(0.05)
