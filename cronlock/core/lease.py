"""Leases: a run of a lease job (`@job(..., lease=30)`) outside one transaction, fenced.

A lease run is its ledger row (`<DB_SCHEMA>.runs`, migration 0007): while the row says
`running` and `lease_expires_at` is ahead of the database's clock, the run is live and owns
its (job, key). The row carries a fencing token (`lease_token`, from one sequence, so a newer
holder's token is always greater). Everything that writes on the run's behalf first locks
that row and checks the token and the lease in the same transaction as the write:

- a **step** (`async with ctx.step() as conn:`): one short read-committed transaction that
  extends the lease, runs the job's writes and stores the checkpoint, all committed together;
- the **heartbeat**, between steps: a renewal that checks the token;
- the final **succeeded** (or failed) update.

A takeover (another instance, once the lease expired) locks the same row, `NOWAIT`: it is
ordered after any step that got the row first, and a stale holder's next step finds the row
no longer its own (`LeaseLost`), so nothing it does after the takeover commits. Work done
outside steps (an API call) is not fenced: a frozen holder can still do it after its lease
ran out. docs/long-jobs.md says what that means for a job.

This module is the lease's SQL and the holder's side (`Fence`); cronlock/core/lease_runner.py
starts, takes over and settles lease runs.

Long on purpose: it is the only module that speaks SQL for leases (CONVENTIONS.md); every fenced
statement (step, heartbeat, final update, takeover) checks the same token and lease, and they
are read against one another.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import asyncpg

from cronlock.db.lock import ms_setting
from cronlock.db.pool import Conn, Database, deadline, terminate
from cronlock.errors import (
    CONNECTION_ERRORS,
    DATABASE_ERRORS,
    DatabaseUnavailable,
    LeaseLost,
    RunCancelled,
    describe,
)
from cronlock.settings import Settings
from cronlock.sql import qualify
from cronlock.tracing import step_span

if TYPE_CHECKING:
    from cronlock.core.jobs import JobContext

log = logging.getLogger("cronlock.lease")

# Failures of the lease's own statements that leave this holder unable to tell what the
# database has: the lease (and a step's outcome) are then no longer known to be its own.
UNREACHABLE: tuple[type[BaseException], ...] = (*CONNECTION_ERRORS, DatabaseUnavailable)
# The errors that mean a step's connection broke under the job's own statements (the job's
# other errors, an OSError or a TimeoutError of its own code among them, are its failure).
BROKEN: tuple[type[BaseException], ...] = (
    asyncpg.exceptions.ConnectionDoesNotExistError,
    asyncpg.exceptions.AdminShutdownError,
    asyncpg.exceptions.CrashShutdownError,
    asyncpg.exceptions.ConnectionFailureError,
)

_RUN = "job = $1 AND coalesce(key, '') = coalesce($2::text, '')"

# The lease run of a (job, key), live or expired: at most one, since a new one is only made
# under the (job, key)'s advisory lock after this found none live (and an expired one is
# closed first). Read without a row lock: the common answer ("live: already running") needs
# none.
CURRENT_SQL = f"""
SELECT id, lease_expires_at > now() AS live, lease_expires_at,
       deadline_at IS NOT NULL AND deadline_at <= now() AS past_deadline
FROM {{schema}}.runs
WHERE {_RUN} AND status = 'running' AND lease_token IS NOT NULL
ORDER BY id DESC
LIMIT 1
"""

# The takeover's row lock. NOWAIT: a step of the old holder has the row, so the lease is in
# use right now (or is about to be freed by that step's timeouts); the trigger answers
# "already running" rather than queueing behind it.
LOCK_SQL = """
SELECT id, lease_expires_at > now() AS live, status, slot, trigger, source, params,
       cancel_requested_at IS NOT NULL AS cancel_requested,
       deadline_at IS NOT NULL AND deadline_at <= now() AS past_deadline
FROM {schema}.runs WHERE id = $1
FOR UPDATE NOWAIT
"""

# A new attempt row holding a fresh lease. `$12` is the attempt it continues (a takeover, or
# the next attempt at a slot whose previous one failed): its checkpoint, params and deadline
# come along. The run's deadline is set once, by its first attempt (the job's timeout bounds
# the whole run, takeovers included).
BEGIN_SQL = """
INSERT INTO {schema}.runs
    (job, key, slot, trigger, source, instance, started_at, params, attempt, retry_of,
     lease_token, lease_seconds, lease_expires_at, deadline_at, checkpoint, message_id)
SELECT $1, $2, $3, $4, $5, $6, now(), $7,
       coalesce(prev.attempt + 1, 1), prev.id,
       nextval('{schema}.lease_tokens'), $8, now() + make_interval(secs => $8),
       coalesce(CASE WHEN $11 THEN prev.deadline_at END, now() + make_interval(secs => $9)),
       prev.checkpoint,
       -- A takeover carries the run's message id (migration 0015) on to its next attempt.
       CASE WHEN $11 THEN prev.message_id ELSE $12 END
FROM (SELECT 1) AS one
LEFT JOIN {schema}.runs AS prev ON prev.id = $10
RETURNING id, attempt, retry_of, lease_token, lease_expires_at, deadline_at, checkpoint,
          started_at
"""

# The previous attempt at a scheduled or backfill slot that did not succeed (failed, timed
# out, abandoned, cancelled): its checkpoint belongs to the slot, so the next attempt
# resumes from it.
PREVIOUS_SQL = f"""
SELECT id FROM {{schema}}.runs
WHERE {_RUN} AND slot = $3 AND trigger IN ('scheduled', 'backfill')
  AND status <> 'succeeded' AND lease_token IS NOT NULL
ORDER BY id DESC
LIMIT 1
"""

# Close an expired attempt that is being taken over or that ran past the run's deadline.
CLOSE_SQL = """
UPDATE {schema}.runs
SET status = $2, error = left(coalesce(error || '; ', '') || $3, 2000),
    finished_at = clock_timestamp(),
    duration_ms = extract(epoch FROM clock_timestamp() - started_at) * 1000
WHERE id = $1 AND status = 'running'
"""

# The step's first statement: lock the row, check the token and the live lease, extend it.
# An UPDATE rather than SELECT ... FOR UPDATE and then an UPDATE: one round trip, and under
# read committed an UPDATE that waited for a takeover re-reads the row it locked, so its
# WHERE sees the takeover's `abandoned`. `steps` ($3, what this holder committed) checks
# that the database still has every step of the attempt: a failover to a standby that was
# behind (asynchronous replication) keeps the token and the lease but loses the newest
# steps, and a holder carrying on from its own checkpoint would skip their work for good.
RENEW_SQL = """
UPDATE {schema}.runs
SET lease_expires_at = now() + make_interval(secs => lease_seconds)
WHERE id = $1 AND lease_token = $2 AND steps = $3 AND status = 'running'
  AND lease_expires_at > now()
RETURNING lease_expires_at, cancel_requested_at IS NOT NULL AS cancel_requested
"""

# Why a renewal found nothing: for the holder's log and its LeaseLost.
WHY_SQL = """
SELECT status, lease_token, steps, lease_expires_at, now() AS db_now,
       (SELECT min(n.id) FROM {schema}.runs AS n WHERE n.retry_of = r.id) AS successor
FROM {schema}.runs AS r WHERE id = $1
"""

# A step's timeouts: every statement, every pause between them and every lock wait of the
# step ends within the lease, so a holder frozen inside a step frees the row for a takeover.
STEP_TIMEOUTS_SQL = """
SELECT set_config('statement_timeout', $1, true),
       set_config('idle_in_transaction_session_timeout', $1, true),
       set_config('lock_timeout', $1, true)
"""

SAVE_SQL = """
UPDATE {schema}.runs SET checkpoint = $3, progress = $4, steps = steps + 1
WHERE id = $1 AND lease_token = $2
"""

# The run's end, fenced like a step (`steps` too). `lease_expires_at` is left as it was: the
# row is no longer `running`, which is what "live" needs first.
SUCCEED_SQL = """
UPDATE {schema}.runs
SET status = 'succeeded', result = $3, checkpoint = $4, progress = $5,
    finished_at = clock_timestamp(),
    duration_ms = extract(epoch FROM clock_timestamp() - started_at) * 1000
WHERE id = $1 AND lease_token = $2 AND steps = $6 AND status = 'running'
  AND lease_expires_at > now()
RETURNING duration_ms
"""

# `failed` and `cancelled` need the lease live, as a step does: a holder that woke up after
# its lease ran out must not end a run another instance is about to resume. `timed_out` does
# not: the run's deadline has passed whoever holds it.
FINISH_SQL = """
UPDATE {schema}.runs
SET status = $3, error = $4, finished_at = clock_timestamp(),
    duration_ms = extract(epoch FROM clock_timestamp() - started_at) * 1000
WHERE id = $1 AND lease_token = $2 AND status = 'running'
  AND ((lease_expires_at > now() AND steps = $5) OR $3 = 'timed_out')
RETURNING duration_ms
"""

# At shutdown: end the lease now, so that another instance takes the run over at once
# (rather than after the lease would have run out). The row stays `running`: the run is not
# over, only this holder is.
GIVE_UP_SQL = """
UPDATE {schema}.runs SET lease_expires_at = now()
WHERE id = $1 AND lease_token = $2 AND status = 'running'
"""

NOTE_SQL = """
UPDATE {schema}.runs SET error = left(coalesce(error || '; ', '') || $2, 2000)
WHERE id = $1 AND status <> 'succeeded'
"""

# Expired lease runs of these jobs: the watcher's list of runs to take over.
EXPIRED_SQL = """
SELECT id, job, key FROM {schema}.runs
WHERE status = 'running' AND lease_token IS NOT NULL AND lease_expires_at <= now()
  AND job = ANY($1::text[])
ORDER BY id
LIMIT 100
"""

# The live leases, for the lock views (cronlock/ops/views.py): a lease run holds no advisory lock
# while it runs, so `pg_locks` cannot show it.
LIVE_SQL = """
SELECT id, job, key, instance, lease_token, lease_expires_at,
       extract(epoch FROM now() - started_at) AS held_for
FROM {schema}.runs
WHERE status = 'running' AND lease_token IS NOT NULL AND lease_expires_at > now()
ORDER BY id
"""

# A cancel request (`python -m cronlock cancel`) for the lease run of a (job, key), whichever
# attempt it is at: the holder sees it at its next step or renewal; a takeover closes a run
# with a pending request as cancelled instead of resuming it.
REQUEST_CANCEL_SQL = f"""
UPDATE {{schema}}.runs SET cancel_requested_at = now(), cancel_requested_by = $3
WHERE {_RUN} AND status = 'running' AND lease_token IS NOT NULL
RETURNING id, lease_expires_at > now() AS live
"""

# A run with no live holder is cancelled by the request itself; the row lock orders this
# after any step, as a takeover is.
CANCEL_EXPIRED_SQL = """
UPDATE {schema}.runs
SET status = 'cancelled', error = 'cancelled (no live holder): ' || $2,
    finished_at = clock_timestamp(),
    duration_ms = extract(epoch FROM clock_timestamp() - started_at) * 1000
WHERE id = $1 AND status = 'running' AND lease_token IS NOT NULL
  AND lease_expires_at <= now()
"""


@dataclass(frozen=True)
class Current:
    """The lease run of a (job, key) as a trigger first sees it."""

    id: int
    live: bool
    expires_at: datetime
    past_deadline: bool


async def current(conn: Conn, schema: str, job: str, key: str | None) -> Current | None:
    row = await conn.fetchrow(qualify(CURRENT_SQL, schema), job, key)
    if row is None:
        return None
    return Current(row["id"], row["live"], row["lease_expires_at"], row["past_deadline"])


async def lock(conn: Conn, schema: str, run_id: int) -> asyncpg.Record | None:
    """The run's row, locked; None when a step holds it (NOWAIT). Inside a savepoint, so the
    refusal does not abort the caller's transaction."""
    try:
        async with conn.transaction():
            return await conn.fetchrow(qualify(LOCK_SQL, schema), run_id)
    except asyncpg.exceptions.LockNotAvailableError:
        return None


async def close(conn: Conn, schema: str, run_id: int, status: str, error: str) -> None:
    await conn.execute(qualify(CLOSE_SQL, schema), run_id, status, error)


async def previous_attempt(
    conn: Conn, schema: str, job: str, key: str | None, slot: datetime
) -> int | None:
    value = await conn.fetchval(qualify(PREVIOUS_SQL, schema), job, key, slot)
    return int(value) if value is not None else None


@dataclass(frozen=True)
class Begun:
    """A lease run's new attempt, as its row was written."""

    run_id: int
    attempt: int
    retry_of: int | None
    token: int
    expires_at: datetime
    deadline_at: datetime
    checkpoint: Any
    started_at: datetime


async def begin(
    conn: Conn,
    schema: str,
    *,
    job: str,
    key: str | None,
    slot: datetime | None,
    trigger: str,
    source: str,
    instance: str,
    params: Any,
    lease: float,
    run_timeout: float,
    previous: int | None,
    same_run: bool,
    message_id: str | None = None,
) -> Begun:
    """Write a new attempt holding a fresh lease, in the caller's (advisory-locked)
    transaction. `previous`: the attempt it continues (checkpoint); `same_run`: a takeover,
    which keeps the run's deadline, rather than a new attempt at a slot, which gets its own."""
    row = await conn.fetchrow(
        qualify(BEGIN_SQL, schema),
        job,
        key,
        slot,
        trigger,
        source,
        instance,
        params,
        lease,
        run_timeout,
        previous,
        same_run,
        message_id,
    )
    assert row is not None
    return Begun(
        row["id"],
        row["attempt"],
        row["retry_of"],
        row["lease_token"],
        row["lease_expires_at"],
        row["deadline_at"],
        row["checkpoint"],
        row["started_at"],
    )


async def expired(conn: Conn | asyncpg.Pool, schema: str, jobs: list[str]) -> list[asyncpg.Record]:
    return await conn.fetch(qualify(EXPIRED_SQL, schema), jobs)


async def live(conn: Conn, schema: str) -> list[asyncpg.Record]:
    """The live leases, for the lock views."""
    return await conn.fetch(qualify(LIVE_SQL, schema))


async def request_cancel(
    conn: Conn, schema: str, job: str, key: str | None, by: str
) -> tuple[str, int | None]:
    """Ask the lease run of (job, key) to stop: ("requested", id) when a live holder will stop
    it at its next step or renewal, ("cancelled", id) when it had none (done here), or
    ("finished", None) when nothing runs."""
    async with conn.transaction():
        row = await conn.fetchrow(qualify(REQUEST_CANCEL_SQL, schema), job, key, by)
        if row is None:
            return "finished", None
        if row["live"]:
            return "requested", row["id"]
        await conn.execute(qualify(CANCEL_EXPIRED_SQL, schema), row["id"], by)
        return "cancelled", row["id"]


def json_copy(value: Any) -> Any:
    return json.loads(json.dumps(value)) if value is not None else None


def as_json(value: Any, what: str) -> Any:
    """A checkpoint or progress as the jsonb it will be (a copy: later changes to the job's
    object are not what was committed), or a TypeError naming it before the step commits,
    rather than a data error of the commit."""
    if value is None:
        return None
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"ctx.{what} is not JSON: {exc}") from exc


class Fence:
    """The holder's side of one lease run: steps, the heartbeat and the fenced end.

    `last_renewed` is the monotonic time just before the newest renewal that committed (a
    step's start counts once it commits; while a step is open, its own renewal counts too: it
    holds the row, so no takeover can come before it ends). The lease runs at least until
    then plus its length on the database's clock, so the holder stops its job once `stop_at`
    passes without a newer one.
    """

    def __init__(
        self,
        db: Database,
        settings: Settings,
        *,
        job: str,
        run_id: int,
        token: int,
        lease: float,
        checkpoint: Any,
    ) -> None:
        self.db = db
        self.settings = settings
        self.schema = settings.db_schema
        self.job = job
        self.run_id = run_id
        self.token = token
        self.lease = lease
        self.committed_checkpoint = checkpoint
        self.committed_progress: Any = None
        self.last_renewed = time.monotonic()
        self.in_step = False
        self.step_renewed: float | None = None  # the open step's renewal
        self.steps = 0
        # Why the holder stopped its job, when it did: the lease is lost, or no longer known
        # to be this holder's (the database went away under it).
        self.lost: str | None = None
        self.cancel_requested = False

    @property
    def stop_at(self) -> float:
        """The monotonic time past which the lease may have run out: a renewal can hang for
        DB_QUERY_TIMEOUT, and LEASE_MARGIN covers the rest (clock rates, scheduling)."""
        slack = self.settings.db_query_timeout + self.settings.lease_margin
        renewed = max(self.last_renewed, self.step_renewed or 0.0)
        return renewed + self.lease - slack

    def _renewed(self, at: float) -> None:
        self.last_renewed = max(self.last_renewed, at)

    def _give_up(self, reason: str) -> LeaseLost:
        """Stop holding: every later step raises, the runner gives the lease up, and whoever
        takes the run over resumes from what the database has."""
        self.lost = reason
        return LeaseLost(reason)

    async def _why(self, conn: Conn) -> str:
        row = await conn.fetchrow(qualify(WHY_SQL, self.schema), self.run_id)
        if row is None:
            return "its run was deleted"
        if row["status"] != "running":
            successor = f" by run {row['successor']}" if row["successor"] else ""
            return f"the run is {row['status']}{successor}"
        if row["lease_token"] != self.token:
            return f"the run has a newer token ({row['lease_token']})"
        if row["steps"] != self.steps:
            return (
                f"the database has {row['steps']} of the {self.steps} steps this holder "
                "committed (lost commits: a failover to a standby that was behind?)"
            )
        return f"the lease expired at {row['lease_expires_at'].isoformat()}"

    async def _renew(self, conn: Conn) -> None:
        """Extend the lease if it is still this holder's (LeaseLost if not), and stop for a
        cancel request (RunCancelled)."""
        row = await conn.fetchrow(
            qualify(RENEW_SQL, self.schema), self.run_id, self.token, self.steps
        )
        if row is None:
            raise self._give_up(f"lease lost: {await self._why(conn)}")
        if row["cancel_requested"]:
            self.cancel_requested = True
            raise RunCancelled("cancel requested by an operator")

    @contextlib.asynccontextmanager
    async def step(self, ctx: JobContext) -> AsyncIterator[Conn]:
        """One fenced transaction of the job: see the module docstring.

        A database or pooler that goes away under a step leaves its outcome unknown when the
        commit was under way (it may have landed): the holder then gives the run up
        (`LeaseLost`), and whoever takes it over resumes from the checkpoint the database has.
        Errors of the job itself (its SQL, its own code) fail the run as in one-transaction
        mode."""
        if self.lost is not None:
            raise LeaseLost(self.lost)
        if self.in_step:
            raise RuntimeError("steps do not nest: finish one before starting the next")
        # The step's span (a no-op unless the run is traced) is current within the step: the
        # job's own statements in it nest under it.
        with step_span(self.job, self.run_id, self.steps + 1) as span:
            span.set(lease_token=self.token)
            async with self._step(ctx) as conn:
                yield conn

    @contextlib.asynccontextmanager
    async def _step(self, ctx: JobContext) -> AsyncIterator[Conn]:
        self.in_step = True
        committed = False
        conn: asyncpg.pool.PoolConnectionProxy | None = None
        tx: asyncpg.transaction.Transaction | None = None
        try:
            started = time.monotonic()
            try:
                conn = await self.db.acquire()
                with deadline(conn, self.settings.db_query_timeout):
                    tx = conn.transaction(isolation="read_committed")
                    await tx.start()
                    await conn.fetchrow(STEP_TIMEOUTS_SQL, ms_setting(self.lease))
                    await self._renew(conn)
            except DATABASE_ERRORS as exc:
                reason = exc.reason if isinstance(exc, DatabaseUnavailable) else describe(exc)
                raise self._give_up(f"a step could not begin: {reason}") from exc
            self.step_renewed = started
            # `ctx.session` inside the step is the step's, in its transaction (cronlock/db/orm.py)
            ctx.enter_session_scope(conn)
            try:
                yield conn
                # Its pending writes flushed and its savepoint released, before the checkpoint.
                await ctx.leave_session_scope(commit=True)
            except BaseException as exc:
                await ctx.leave_session_scope(commit=False)
                if conn.is_closed() or isinstance(exc, BROKEN):
                    # The step's connection broke under the job's statements: nothing of the
                    # step committed, but this holder cannot tell what else the server saw.
                    self._give_up(f"the step's connection broke: {describe(exc)}")
                raise
            checkpoint = as_json(ctx.checkpoint, "checkpoint")
            progress = as_json(ctx.progress, "progress")
            try:
                with deadline(conn, self.settings.db_query_timeout):
                    await conn.execute(
                        qualify(SAVE_SQL, self.schema),
                        self.run_id,
                        self.token,
                        checkpoint,
                        progress,
                    )
                    await tx.commit()
            except UNREACHABLE as exc:
                reason = exc.reason if isinstance(exc, DatabaseUnavailable) else describe(exc)
                raise self._give_up(
                    f"a step's commit may or may not have landed: {reason}"
                ) from exc
            committed = True
            self._renewed(started)
            self.steps += 1
            self.committed_checkpoint, self.committed_progress = checkpoint, progress
        finally:
            self.in_step, self.step_renewed = False, None
            if not committed:
                # What the database has, as far as this holder knows: a job that goes on after
                # a failed step resumes from the last checkpoint it saw commit.
                ctx.checkpoint = json_copy(self.committed_checkpoint)
                ctx.progress = json_copy(self.committed_progress)
            if conn is not None:
                if not committed:
                    await self._discard(conn, tx)
                await self.db.release(conn)

    async def _discard(self, conn: Conn, tx: asyncpg.transaction.Transaction | None) -> None:
        """Roll a step back; on a cancelled task or a broken connection, close the socket
        instead (no cancel request through PgBouncer; the server rolls back)."""
        task = asyncio.current_task()
        if tx is None or conn.is_closed() or (task is not None and task.cancelling()):
            terminate(conn)
            return
        try:
            with deadline(conn, self.settings.db_query_timeout):
                await tx.rollback()
        except Exception:
            terminate(conn)

    async def heartbeat(self, job_task: asyncio.Task[Any]) -> None:
        """Renew the lease every third of its length between steps; cancel the job when the
        lease is lost, an operator asked, or no renewal succeeded in time (`stop_at`)."""
        interval = self.lease / 3
        while not job_task.done():
            wait = min(interval, self.stop_at - time.monotonic())
            if wait > 0:
                await asyncio.sleep(wait)
            if job_task.done():
                return
            if time.monotonic() >= self.stop_at:
                self.lost = (
                    f"lease not renewed for {time.monotonic() - self.last_renewed:.1f} s: it may "
                    "have expired, so the job was stopped"
                )
                job_task.cancel()
                return
            if self.in_step:
                continue  # the step renewed it, and holds the row
            started = time.monotonic()
            try:
                async with self.db.connection() as conn:
                    await self._renew(conn)
            except (LeaseLost, RunCancelled):
                job_task.cancel()
                return
            except DATABASE_ERRORS as exc:
                # Try again soon; `stop_at` decides when trying is no longer enough.
                log.warning(
                    "lease renewal of run %s failed: %s",
                    self.run_id,
                    exc.reason if isinstance(exc, DatabaseUnavailable) else describe(exc),
                    extra={"job": self.job, "run_id": self.run_id},
                )
                continue
            self._renewed(started)

    async def succeed(self, result: Any, checkpoint: Any, progress: Any) -> float:
        """The fenced end: the run is done. LeaseLost if the lease is no longer ours, or if
        the database went away meanwhile (the update may have landed: the next holder, or
        the ledger, knows)."""
        try:
            async with self.db.connection() as conn:
                duration = await conn.fetchval(
                    qualify(SUCCEED_SQL, self.schema),
                    self.run_id,
                    self.token,
                    result,
                    checkpoint,
                    progress,
                    self.steps,
                )
                if duration is None:
                    raise self._give_up(f"lease lost: {await self._why(conn)}")
        except UNREACHABLE as exc:
            reason = exc.reason if isinstance(exc, DatabaseUnavailable) else describe(exc)
            raise self._give_up(f"the final commit may or may not have landed: {reason}") from exc
        return float(duration)

    async def finish(self, status: str, error: str) -> bool:
        """Record an attempt that did not succeed; False if the run is no longer this
        holder's (its lease ran out: a takeover resumes it) or the database could not be
        told (the row stays `running`, its lease runs out, and the same happens)."""
        try:
            async with self.db.connection() as conn:
                value = await conn.fetchval(
                    qualify(FINISH_SQL, self.schema),
                    self.run_id,
                    self.token,
                    status,
                    error,
                    self.steps,
                )
        except Exception as exc:
            log.warning("could not record run %s as %s: %s", self.run_id, status, describe(exc))
            self.lost = f"could not record it as {status}: {describe(exc)}"
            return False
        if value is None:
            self.lost = f"its lease ran out before it could record {status}"
            return False
        return True

    async def give_up(self) -> None:
        """End the lease now (shutdown, a lost database): another instance resumes the run at
        once. Fenced like a renewal: a lease that is no longer ours is left alone."""
        try:
            async with self.db.connection() as conn:
                await conn.execute(qualify(GIVE_UP_SQL, self.schema), self.run_id, self.token)
        except Exception as exc:
            log.warning("could not give up the lease of run %s: %s", self.run_id, describe(exc))

    async def note(self, text: str) -> None:
        """Add to the run's error (a holder that found its lease lost says so)."""
        with contextlib.suppress(Exception):
            async with self.db.connection() as conn:
                await conn.execute(qualify(NOTE_SQL, self.schema), self.run_id, text)
