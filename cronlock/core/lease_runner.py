"""Lease runs, start to end: take the (job, key) in a short transaction, run the job in the
background under its lease, settle the ledger with a fenced update; take expired runs over.

A trigger for a lease job takes the job's advisory lock as every trigger does, but only for
the few statements that decide: is a lease of this (job, key) live (then "already running",
whatever the slot, `force` included), has one expired (then take that run over), or is the
slot done (then "already done")? Otherwise it writes the run's row with a fresh lease and a
new fencing token and commits at once: from then on the lease, not the lock, says that the
run is going on (cronlock/core/lease.py). The answer is 202: the run outlives any HTTP deadline.

The watcher (`watch`) runs on every instance that serves lease jobs: every LEASE_POLL_INTERVAL
it takes over the runs whose lease ran out (their holder died, froze or shut down), through
the same decision under the same lock, so a trigger and the watchers of several instances
never take one run over twice.

Long on purpose: the start, the takeover and the settling of a lease run share one decision
under one lock and one set of attempt rules; split, each would restate the others' invariants.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, Protocol

import asyncpg
from pydantic import ValidationError

from cronlock.core import lease, ledger, schedules
from cronlock.core.failure import failure_of
from cronlock.core.jobs import Job, JobContext, Registry, Trigger, steps_only
from cronlock.core.outcome import Kind, Outcome, annotate
from cronlock.db.lock import lock_text, try_lock
from cronlock.db.orm import Sessions
from cronlock.db.pool import Conn, Database, deadline
from cronlock.errors import (
    DATABASE_ERRORS,
    DRIVER_ERRORS,
    STANDBY_REASON,
    DatabaseUnavailable,
    InvalidTrigger,
    LeaseLost,
    RunCancelled,
    describe,
    translate,
)
from cronlock.settings import Settings, scrub
from cronlock.tracing import Tracing

if TYPE_CHECKING:
    from cronlock.core.metrics import Metrics

log = logging.getLogger("cronlock.lease")


@dataclass(frozen=True)
class TakenOver:
    """The attempt a takeover wrote, and what it continues of the run it took over."""

    begun: lease.Begun
    old_id: int
    slot: datetime | None
    trigger: Trigger
    source: str
    params: Any


@dataclass
class Holding:
    """A lease run this instance holds: its fence, context and task."""

    job: Job
    fence: lease.Fence
    ctx: JobContext
    source: str
    deadline: float  # monotonic: the run's deadline (the job's timeout, across attempts)
    started: float = field(default_factory=time.monotonic)
    task: asyncio.Task[Outcome] | None = None


class RunnerParts(Protocol):
    """What the lease half uses of the runner (cronlock/core/runner.py `Runner`, which holds
    a LeaseRunner of itself): a protocol, so that this module does not import the runner."""

    settings: Settings
    db: Database
    registry: Registry
    metrics: Metrics | None
    # The (job, key)s this instance runs or decides about now (`Runner.local`).
    local: dict[tuple[str, str | None], int | None]
    # How a run's `ctx.session` is made (cronlock/db/orm.py).
    sessions: Sessions
    # The runs' spans (cronlock/tracing.py).
    tracing: Tracing

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
    ) -> tuple[str | None, datetime | None]: ...

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
    ) -> Outcome: ...

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
    ) -> Outcome: ...

    async def message_done(
        self,
        conn: Conn,
        job: Job,
        key: str | None,
        trigger: Trigger,
        source: str,
        message_id: str | None,
    ) -> Outcome | None: ...

    def log_outcome(self, outcome: Outcome, source: str) -> None: ...


class LeaseRunner:
    """The lease half of the runner; `Runner.trigger` hands lease jobs here."""

    def __init__(self, runner: RunnerParts) -> None:
        self.runner = runner
        self.settings = runner.settings
        self.db = runner.db
        self.holding: dict[int, Holding] = {}
        # Set at shutdown: no more takeovers, and a run begun meanwhile is given up at once.
        self.closing = False

    async def start(
        self,
        job: Job,
        key: str | None,
        trigger: Trigger,
        backfill: datetime | None,
        params: Any,
        source: str,
        *,
        forced: bool = False,
        takeover_only: bool = False,
        retry_of: ledger.Run | None = None,
        first_attempt: bool = False,
        message_id: str | None = None,
        planned: schedules.Planned | None = None,
    ) -> Outcome | None:
        """Decide under the (job, key)'s lock, then start the run in the background.

        `forced`: an operator's `force=true` (the pause does not stop it).
        `planned` (a dynamic schedule's claimed row, cronlock/core/schedules.py): decided as the
        one-transaction runner does, and the row advances in the transaction that begins the
        run; from then on the run is the lease's (a takeover, a retry), not the row's.
        `takeover_only` (the watcher): take an expired run over, or do nothing (None).
        `retry_of` (cronlock/core/retries.py): the failed attempt this one retries, for its slot;
        its checkpoint comes along, as for any next attempt at a slot."""
        runner, settings = self.runner, self.settings
        schema = settings.db_schema
        await self.db.ensure_ready()
        conn = await self.db.acquire()
        begun: lease.Begun | None = None
        took_over: int | None = None
        slot: datetime | None = None
        try:
            with deadline(conn, settings.db_query_timeout):
                async with conn.transaction(isolation="read_committed"):
                    row = await try_lock(
                        conn,
                        lock_text(schema, job.name, key),
                        settings.lock_namespace,
                        db_timeout=settings.db_query_timeout,
                        client_check_interval=settings.db_client_check_interval,
                        server_version=self.db.server_version,
                    )
                    if row["standby"]:
                        self.db.standby, self.db.migrated = True, False
                        raise DatabaseUnavailable(STANDBY_REASON)
                    if not row["locked"]:
                        return None if takeover_only else self._skip(job, trigger, source, key)
                    now: datetime = row["db_now"]
                    if not takeover_only:
                        done = await runner.message_done(
                            conn, job, key, trigger, source, message_id
                        )
                        if done is not None:
                            return done
                    found = await lease.current(conn, schema, job.name, key)
                    if found is not None and found.live:
                        return None if takeover_only else self._skip(job, trigger, source, key)
                    if found is not None:
                        taken = await self._take_over(conn, job, key, found)
                        if taken == "busy":  # a step of the old holder has the row right now
                            return None if takeover_only else self._skip(job, trigger, source, key)
                        # "gone": closed (or ended) just now; decide afresh below
                        if isinstance(taken, TakenOver):
                            begun, took_over, slot = taken.begun, taken.old_id, taken.slot
                            trigger, source, params = taken.trigger, taken.source, taken.params
                    if begun is None:
                        if takeover_only:
                            return None
                        skip, slot = await runner.decide_slot(
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
                            return runner.skip(job, skip, slot, trigger, source, key)
                        if retry_of is not None and await ledger.retried(conn, schema, retry_of.id):
                            return runner.skip(job, "already retried", slot, trigger, source, key)
                        previous = (
                            retry_of.id
                            if retry_of is not None
                            else await lease.previous_attempt(conn, schema, job.name, key, slot)
                            if slot is not None and trigger != "manual"
                            else None
                        )
                        begun = await lease.begin(
                            conn,
                            schema,
                            job=job.name,
                            key=key,
                            slot=slot,
                            trigger=trigger,
                            source=source,
                            instance=settings.instance_name,
                            params=params.model_dump(mode="json")
                            if hasattr(params, "model_dump")
                            else None,
                            lease=job.lease or 0.0,
                            run_timeout=job.timeout,
                            previous=previous,
                            same_run=False,
                            message_id=message_id,
                        )
                        if planned is not None:
                            await schedules.advance(conn, schema, planned)
                    left = (begun.deadline_at - now).total_seconds()
        except DRIVER_ERRORS as exc:
            raise translate(exc, input_from=("body",)) from exc
        finally:
            await self.db.release(conn)
        assert begun is not None
        if self.closing:
            # Shut down meanwhile: give the lease straight back, for another instance to run.
            await lease.Fence(
                self.db,
                settings,
                job=job.name,
                run_id=begun.run_id,
                token=begun.token,
                lease=job.lease or 0.0,
                checkpoint=None,
            ).give_up()
            return None if takeover_only else self._skip(job, trigger, source, key)
        holding = self._hold(job, key, begun, slot, trigger, source, params, left)
        if took_over is not None:
            log.warning(
                "%s: took over run %s (its lease had expired) as run %s, attempt %s",
                job.name,
                took_over,
                begun.run_id,
                begun.attempt,
                extra={
                    "event": "lease_takeover",
                    "job": job.name,
                    "key": key,
                    "run_id": begun.run_id,
                    "retry_of": took_over,
                    "attempt": begun.attempt,
                    "token": begun.token,
                    "instance": settings.instance_name,
                },
            )
            if runner.metrics is not None:
                runner.metrics.lease_takeovers.labels(job.name).inc()
        outcome = Outcome(
            job.name,
            "accepted",
            begun.run_id,
            slot,
            trigger=trigger,
            key=key,
            lease_expires_at=begun.expires_at,
        )
        runner.log_outcome(outcome, source)
        assert holding.task is not None
        return outcome

    async def _take_over(
        self, conn: Any, job: Job, key: str | None, found: lease.Current
    ) -> TakenOver | Literal["busy", "gone"]:
        """Close the expired attempt and write its successor (same slot, params, checkpoint
        and deadline, a new token). "busy": a step of the old holder has the row, or the lease
        was renewed meanwhile. "gone": there is nothing to resume, and the caller decides
        afresh: the run ended meanwhile, or is closed here because it is past its deadline,
        has a cancel request pending, or has params this release no longer accepts."""
        schema = self.settings.db_schema
        locked = await lease.lock(conn, schema, found.id)
        if locked is None or locked["live"]:
            return "busy"
        if locked["status"] != "running":
            return "gone"
        trigger: Trigger = locked["trigger"]
        closing: tuple[str, str] | None = None
        params: Any = None
        if locked["past_deadline"]:
            closing = "timed_out", f"exceeded its timeout of {job.timeout} s (its lease ran out)"
        elif locked["cancel_requested"]:
            closing = "cancelled", "cancelled by an operator while it had no live holder"
        elif job.params is not None:
            try:
                params = job.params.model_validate(locked["params"])
            except ValidationError as exc:
                closing = "failed", f"its params are not valid for this release: {exc}"[:2000]
        if closing is not None:
            await lease.close(conn, schema, found.id, *closing)
            return "gone"
        begun = await lease.begin(
            conn,
            schema,
            job=job.name,
            key=key,
            slot=locked["slot"],
            trigger=trigger,
            source=locked["source"],
            instance=self.settings.instance_name,
            params=locked["params"],
            lease=job.lease or 0.0,
            run_timeout=job.timeout,
            previous=found.id,
            same_run=True,
        )
        await lease.close(
            conn,
            schema,
            found.id,
            "abandoned",
            f"its lease expired at {found.expires_at.isoformat()}; taken over by run "
            f"{begun.run_id} on {self.settings.instance_name}",
        )
        return TakenOver(begun, found.id, locked["slot"], trigger, locked["source"], params)

    def _skip(self, job: Job, trigger: Trigger, source: str, key: str | None) -> Outcome:
        return self.runner.skip(job, "already running", None, trigger, source, key)

    def _hold(
        self,
        job: Job,
        key: str | None,
        begun: lease.Begun,
        slot: datetime | None,
        trigger: Trigger,
        source: str,
        params: Any,
        left: float,
    ) -> Holding:
        fence = lease.Fence(
            self.db,
            self.settings,
            job=job.name,
            run_id=begun.run_id,
            token=begun.token,
            lease=job.lease or 0.0,
            checkpoint=begun.checkpoint,
        )
        ctx = JobContext(
            conn=steps_only(job.name),
            job=job,
            run_id=begun.run_id,
            slot=slot,
            now=begun.started_at,
            params=params,
            trigger=trigger,
            instance=self.settings.instance_name,
            settings=self.settings,
            key=key,
            attempt=begun.attempt,
            checkpoint=begun.checkpoint,
            steps=fence,
            sessions=self.runner.sessions,
        )
        holding = Holding(job, fence, ctx, source, time.monotonic() + max(0.0, left))
        holding.task = asyncio.create_task(
            self._run(holding), name=f"lease:{job.name}:{begun.run_id}"
        )
        self.holding[begun.run_id] = holding
        holding.task.add_done_callback(lambda _: self.holding.pop(begun.run_id, None))
        return holding

    async def _run(self, h: Holding) -> Outcome:
        """Run the job under its lease and settle the ledger, whatever happens, in the run's
        span (a child of the trigger's, whose context this task copied): its steps' spans and
        the job's own nest under it."""
        ctx = h.ctx
        with self.runner.tracing.run(
            h.job.name,
            ctx.run_id,
            attempt=ctx.attempt,
            slot=ctx.slot,
            key=ctx.key,
            trigger=ctx.trigger,
        ) as span:
            span.set(lease_token=h.fence.token, source=h.source)
            outcome = await self._settle(h)
            annotate(span, outcome)
            return outcome

    async def _settle(self, h: Holding) -> Outcome:
        job, fence, ctx = h.job, h.fence, h.ctx
        task: asyncio.Task[Any] = asyncio.create_task(
            job.func(ctx), name=f"job:{job.name}:{ctx.run_id}"
        )
        beat = asyncio.create_task(fence.heartbeat(task), name=f"heartbeat:{ctx.run_id}")
        try:
            try:
                done, _ = await asyncio.wait(
                    {task}, timeout=max(0.0, h.deadline - time.monotonic())
                )
            except asyncio.CancelledError:
                # Shutdown: stop the job, give the lease up so another instance resumes the
                # run at once. Not recorded as cancelled: the run goes on elsewhere.
                await _stop(task)
                await fence.give_up()
                raise
            if not done:
                await _stop(task)
                if not await fence.finish("timed_out", f"exceeded its timeout of {job.timeout} s"):
                    return await self._lost(h)
                return self._outcome(h, "timed_out")
            error: BaseException | None = (
                asyncio.CancelledError() if task.cancelled() else task.exception()
            )
            if fence.lost is not None:
                # The lease is lost, or no longer known to be ours (the database went away
                # under a step, whose commit may have landed): whatever the job then did, the
                # run is the next holder's, who resumes from what the database has.
                return await self._lost(h)
            if isinstance(error, RunCancelled) or (
                fence.cancel_requested and isinstance(error, asyncio.CancelledError)
            ):
                if not await fence.finish("cancelled", "cancelled by an operator"):
                    return await self._lost(h)
                return self._outcome(h, "cancelled", reason="cancelled by an operator")
            if isinstance(error, asyncio.CancelledError):
                error = RuntimeError("the job's task was cancelled (it raised CancelledError)")
            if error is None:
                try:
                    result = json.loads(json.dumps(task.result(), allow_nan=False))
                except (TypeError, ValueError) as exc:
                    error = TypeError(
                        f"returned a {type(task.result()).__name__} that is not JSON: {exc}"
                    )
                else:
                    return await self._succeed(h, result)
            secrets = self.settings.secret_values()
            line = scrub(f"{type(error).__name__}: {error}", secrets)[:2000]
            if not await fence.finish("failed", line):
                return await self._lost(h)
            failure = failure_of(error, secrets)
            with contextlib.suppress(*DATABASE_ERRORS):  # the detail only: the row says failed
                async with self.db.connection() as conn:
                    await ledger.record_failure(conn, self.settings.db_schema, ctx.run_id, failure)
            reason = scrub(str(error), secrets)[:200]
            return self._outcome(h, "failed", reason=reason, failure=failure)
        finally:
            beat.cancel()
            with contextlib.suppress(BaseException):
                await beat
            self.runner.local.pop((job.name, ctx.key), None)

    async def _succeed(self, h: Holding, result: Any) -> Outcome:
        fence, ctx = h.fence, h.ctx
        try:
            duration = await fence.succeed(
                result,
                lease.as_json(ctx.checkpoint, "checkpoint"),
                lease.as_json(ctx.progress, "progress"),
            )
        except LeaseLost:
            return await self._lost(h)
        except (TypeError, asyncpg.PostgresError) as exc:
            # Not JSON (ctx.checkpoint, ctx.progress), or a value the database refused in them:
            # the job's mistake, as a result that is not JSON is.
            reason = str(exc) if isinstance(exc, TypeError) else describe(exc)
            if not await fence.finish("failed", f"could not record success: {reason}"):
                return await self._lost(h)
            return self._outcome(h, "failed", reason=reason)
        return self._outcome(h, "succeeded", processed=result, duration=duration)

    async def _lost(self, h: Holding) -> Outcome:
        reason = h.fence.lost or "lease lost"
        log.warning(
            "%s: run %s stopped: %s",
            h.job.name,
            h.ctx.run_id,
            reason,
            extra={
                "event": "lease_lost",
                "job": h.job.name,
                "key": h.ctx.key,
                "run_id": h.ctx.run_id,
                "token": h.fence.token,
                "instance": self.settings.instance_name,
            },
        )
        if self.runner.metrics is not None:
            self.runner.metrics.leases_lost.labels(h.job.name).inc()
        # Fenced: a lease another holder has now is left alone; one still ours (the database
        # went away under us) ends now, so the takeover need not wait it out.
        await h.fence.give_up()
        await h.fence.note(f"its holder on {self.settings.instance_name} stopped: {reason}")
        return self._outcome(h, "lease_lost", reason=reason)

    def _outcome(
        self,
        h: Holding,
        kind: Kind,
        *,
        processed: Any = None,
        duration: float | None = None,
        reason: str | None = None,
        failure: dict[str, Any] | None = None,
    ) -> Outcome:
        return self.runner.finished(
            h.ctx,
            kind,
            h.source,
            h.started,
            processed=processed,
            duration=duration,
            reason=reason,
            failure=failure,
        )

    async def settle(self, run_id: int) -> Outcome | None:
        """Wait for a run this instance holds to end (the CLI's `run` of a lease job)."""
        h = self.holding.get(run_id)
        if h is None or h.task is None:
            return None
        return await asyncio.shield(h.task)

    async def watch(self, stop: asyncio.Event) -> None:
        """Take over, every LEASE_POLL_INTERVAL, the runs whose lease ran out."""
        jobs = [name for name, job in self.runner.registry.items() if job.lease is not None]
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.lease_poll_interval)
            if stop.is_set():
                return
            try:
                await self.take_over_expired(jobs)
            except DatabaseUnavailable as exc:
                log.debug("lease watch: %s", exc.reason)
            except Exception:
                log.exception("lease watch failed; trying again")

    async def take_over_expired(self, jobs: list[str]) -> None:
        if not self.db.migrated:
            return
        try:
            async with self.db.connection() as conn:
                rows = await lease.expired(conn, self.settings.db_schema, jobs)
        except DRIVER_ERRORS as exc:
            raise translate(exc) from exc
        for row in rows:
            if self.closing:
                return
            job = self.runner.registry[row["job"]]
            local = (job.name, row["key"])
            if local in self.runner.local:
                continue
            self.runner.local[local] = None
            started = None
            try:
                started = await self.start(
                    job, row["key"], "scheduled", None, None, "takeover", takeover_only=True
                )
            except (DatabaseUnavailable, InvalidTrigger) as exc:
                # One run that cannot be taken over now must not keep the others waiting.
                log.warning("could not take run %s over: %s", row["id"], exc)
            finally:
                if started is None:
                    self.runner.local.pop(local, None)

    async def shutdown(self) -> None:
        """At SIGTERM: stop the lease jobs at once and give their leases up, so that another
        instance resumes each from its last committed step now, rather than this one
        spending the grace period on work that a step boundary makes safe to redo."""
        self.closing = True
        tasks = [h.task for h in self.holding.values() if h.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            # Longer than `_stop` gives a job to unwind, so that each gets to give its lease up.
            await asyncio.wait(tasks, timeout=_STOP_WAIT + 3.0)


_STOP_WAIT = 5.0


async def _stop(task: asyncio.Task[Any]) -> None:
    task.cancel()
    with contextlib.suppress(BaseException):
        await asyncio.wait({task}, timeout=_STOP_WAIT)
