"""Fan-out runs, start to end: plan in the run's lock transaction, then work the items on every
instance that serves the job (cronlock/core/fanout.py says what each transaction guarantees).

`FanoutRunner.start` is the trigger's side (`Runner.trigger` hands fan-out jobs here): under
the job's lock it answers "already running" while the (job, key) has a fan-out in progress,
decides the slot as every trigger does, records the run, and either continues the slot's
fan-out that did not succeed or runs the planner and writes its items; the commit publishes
them, a NOTIFY wakes the workers, and the answer is 202 with the number of items.

`FanoutRunner.work` runs on every instance serving fan-out jobs: FANOUT_CONCURRENCY workers,
each one item at a time, woken by NOTIFY on a connection of its own (DATABASE_DIRECT_URL
when set: PgBouncer in transaction mode cannot carry LISTEN) and polling every
FANOUT_POLL_INTERVAL regardless.

Long on purpose: planning, the workers' claims, an item's transaction and the settling of the
last item share one set of rules about the run's state; apart, each would restate them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import json
import logging
import time
from collections.abc import AsyncIterable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import asyncpg
from pydantic import ValidationError

from cronlock.core import fanout, ledger, pause
from cronlock.core.fanout import Active, DoneContext, ItemContext
from cronlock.core.jobs import Job, JobContext, Trigger
from cronlock.core.lease_runner import RunnerParts
from cronlock.core.outcome import Outcome, annotate
from cronlock.db import pool as db
from cronlock.db.lock import lock_text, reset_session, try_lock
from cronlock.db.pool import Conn, deadline, terminate
from cronlock.errors import (
    DATABASE_ERRORS,
    DRIVER_ERRORS,
    STANDBY_REASON,
    DatabaseUnavailable,
    describe,
    translate,
)
from cronlock.tracing import NO_SPAN, Span, traceparent


class FanoutHost(RunnerParts, Protocol):
    """What the fan-out half uses of the runner (cronlock/core/runner.py `Runner`, which holds
    a FanoutRunner of itself): a protocol, so that this module does not import the runner."""

    lock_slots: asyncio.Semaphore

    async def _record(
        self, run_id: int, status: str, error: str, failure: dict[str, Any] | None = None
    ) -> None: ...


log = logging.getLogger("cronlock.fanout")


class PlanRefused(Exception):
    """The planner's items cannot be a fan-out (not JSON, over FANOUT_MAX_ITEMS)."""


@dataclass
class Planned:
    run_id: int
    slot: Any
    total: int


# The item's work runs in a savepoint: a failed attempt rolls back to it and is counted in
# the same transaction, under the item's row lock.
SAVEPOINT_ITEM_SQL = "SAVEPOINT cronlock_item"
ROLLBACK_ITEM_SQL = "ROLLBACK TO SAVEPOINT cronlock_item"


def _closed(conn: Conn) -> bool:
    """Whether the connection is gone (a pool's proxy of one we terminated is detached)."""
    try:
        return conn.is_closed()
    except asyncpg.InterfaceError:
        return True


class FanoutRunner:
    """The fan-out half of the runner."""

    def __init__(self, runner: FanoutHost) -> None:
        self.runner = runner
        self.settings = runner.settings
        self.db = runner.db
        self.schema = runner.settings.db_schema
        self.jobs = {name: j for name, j in runner.registry.items() if j.fanout is not None}
        # Items in flight on this instance, per fan-out (published for /cron/runs/{id}).
        self.in_flight: dict[int, int] = {}
        self.active: list[Active] = []
        self.refreshed = 0.0
        self.wake = asyncio.Event()
        self._refreshing = asyncio.Lock()
        self._params_of: dict[int, Any] = {}

    # --- planning ------------------------------------------------------------------------

    async def start(
        self,
        job: Job,
        key: str | None,
        trigger: Trigger,
        backfill: Any,
        params: Any,
        source: str,
        *,
        forced: bool = False,
        retry_of: ledger.Run | None = None,
        first_attempt: bool = False,
    ) -> Outcome:
        """Decide under the (job, key)'s lock and plan the run; `forced`: an operator's
        `force=true` (the pause does not stop it)."""
        # The run's span (when traced) covers its planning: opened once the run is recorded,
        # a child of the trigger's; its context is stored with the fan-out, the parent of
        # every item's span on whichever instance works it (cronlock/tracing.py).
        with contextlib.ExitStack() as spans:
            traced: list[Span] = []
            outcome = await self._start(
                job,
                key,
                trigger,
                backfill,
                params,
                source,
                forced=forced,
                retry_of=retry_of,
                first_attempt=first_attempt,
                spans=spans,
                traced=traced,
            )
            for span in traced:
                annotate(span, outcome)
            return outcome

    async def _start(
        self,
        job: Job,
        key: str | None,
        trigger: Trigger,
        backfill: Any,
        params: Any,
        source: str,
        *,
        forced: bool,
        retry_of: ledger.Run | None,
        first_attempt: bool,
        spans: contextlib.ExitStack,
        traced: list[Span],
    ) -> Outcome:
        runner, settings, schema = self.runner, self.settings, self.schema
        await self.db.ensure_ready()
        try:
            await asyncio.wait_for(runner.lock_slots.acquire(), settings.db_acquire_timeout)
        except TimeoutError as exc:
            raise DatabaseUnavailable("no database connection free (pool exhausted)") from exc
        started = time.monotonic()
        run_id: int | None = None
        ctx: JobContext | None = None
        ended: Outcome | None = None
        try:
            conn = await self.db.acquire()
        except BaseException:
            runner.lock_slots.release()
            raise
        tx = conn.transaction(isolation="read_committed")
        committed = False
        try:
            try:
                with deadline(conn, settings.db_query_timeout):
                    await tx.start()
                    row = await try_lock(
                        conn,
                        lock_text(schema, job.name, key),
                        settings.lock_namespace,
                        db_timeout=job.timeout + settings.db_timeout_margin,
                        client_check_interval=settings.db_client_check_interval,
                        server_version=self.db.server_version,
                    )
                    if row["standby"]:
                        self.db.standby, self.db.migrated = True, False
                        raise DatabaseUnavailable(STANDBY_REASON)
                    if not row["locked"]:
                        return runner.skip(job, "already running", None, trigger, source, key)
                    now = row["db_now"]
                    if await fanout.running(conn, schema, job.name, key) is not None:
                        return runner.skip(job, "already running", None, trigger, source, key)
                    if retry_of is not None and await ledger.retried(conn, schema, retry_of.id):
                        return runner.skip(job, "already retried", backfill, trigger, source, key)
                    skip, slot = await runner.decide_slot(
                        conn,
                        job,
                        key,
                        trigger,
                        backfill,
                        now,
                        forced=forced,
                        first_attempt=first_attempt,
                    )
                    if skip is not None:
                        return runner.skip(job, skip, slot, trigger, source, key)
                    prev = (
                        await fanout.previous(conn, schema, job.name, key, slot)
                        if slot is not None and trigger != "manual"
                        else None
                    )
                async with self.db.connection() as other:
                    attempt, retried = 1, None
                    if retry_of is not None:
                        attempt, retried = retry_of.attempt + 1, retry_of.id
                    elif prev is not None:
                        attempt, retried = prev.attempt + 1, prev.run_id
                    run_id = await ledger.start(
                        other,
                        schema,
                        job=job.name,
                        slot=slot,
                        trigger=trigger,
                        source=source,
                        instance=settings.instance_name,
                        backend_pid=row["backend_pid"],
                        started_at=now,
                        params=params.model_dump(mode="json")
                        if hasattr(params, "model_dump")
                        else None,
                        key=key,
                        attempt=attempt,
                        retry_of=retried,
                    )
            except DRIVER_ERRORS as exc:
                raise translate(exc, input_from=("body",)) from exc
            traced.append(
                spans.enter_context(
                    runner.tracing.run(
                        job.name, run_id, attempt=attempt, slot=slot, key=key, trigger=trigger
                    )
                )
            )
            parent = traceparent()
            ctx = JobContext(
                conn=conn,
                job=job,
                run_id=run_id,
                slot=slot,
                now=now,
                params=params,
                trigger=trigger,
                instance=settings.instance_name,
                settings=settings,
                key=key,
                attempt=attempt,
                sessions=runner.sessions,
            )
            try:
                if prev is not None:
                    with deadline(conn, settings.db_query_timeout):
                        resumed = await fanout.resume(
                            conn, schema, prev.id, run_id, traceparent=parent
                        )
                    total, left, fanout_id = resumed.total, resumed.left, prev.id
                else:
                    items = await asyncio.wait_for(self._plan(job, ctx), job.timeout)
                    with deadline(conn, max(settings.db_query_timeout, job.timeout)):
                        fanout_id = await fanout.create(
                            conn,
                            schema,
                            run_id=run_id,
                            job=job.name,
                            key=key,
                            slot=slot,
                            items=items,
                            traceparent=parent,
                        )
                    total, left = len(items), min(fanout.SHARDS, len(items))
                with deadline(conn, settings.db_query_timeout):
                    await reset_session(
                        conn,
                        settings.db_schema,
                        db_timeout=job.timeout + settings.db_timeout_margin,
                        client_check_interval=settings.db_client_check_interval,
                        server_version=self.db.server_version,
                    )
                a = Active(
                    fanout_id, run_id, job.name, key, slot, 0, ctx.params, trigger, now, False, ""
                )
                if left == 0:
                    # Nothing to work (no items, or every one settled before): the run ends here.
                    ended = await self._finish(conn, job, a, total, source)
                with deadline(conn, settings.db_query_timeout):
                    await fanout.notify(conn, schema, fanout_id)
                    await tx.commit()
                committed = True
            except TimeoutError:
                await self._fail(
                    conn,
                    tx,
                    run_id,
                    "timed_out",
                    f"planning exceeded its timeout of {job.timeout} s",
                )
                return self._outcome(ctx, "timed_out", source, started)
            except Exception as exc:
                reason = (
                    str(exc)
                    if isinstance(exc, PlanRefused)
                    else exc.reason
                    if isinstance(exc, DatabaseUnavailable)
                    else describe(exc)
                    if isinstance(exc, asyncpg.PostgresError)
                    else f"{type(exc).__name__}: {exc}"
                )
                await self._fail(conn, tx, run_id, "failed", f"planning failed: {reason}"[:2000])
                return self._outcome(ctx, "failed", source, started, reason=reason[:200])
        finally:
            if not committed:
                with contextlib.suppress(Exception):
                    if not _closed(conn):
                        with deadline(conn, settings.db_query_timeout):
                            await tx.rollback()
            await self.db.release(conn)
            runner.lock_slots.release()
        self.wake.set()
        # Answered 202 even when the run ended already (no items, or none left to work):
        # the answer of a fan-out trigger has one shape; its end is logged and counted.
        del ended
        outcome = Outcome(job.name, "accepted", run_id, slot, trigger=trigger, key=key, items=total)
        runner.log_outcome(outcome, source)
        return outcome

    async def _plan(self, job: Job, ctx: JobContext) -> list[str]:
        """The planner's items, each as its JSON text (PlanRefused if one is not JSON or there
        are more than FANOUT_MAX_ITEMS); its session settled into the planning transaction."""
        cap = self.settings.fanout_max_items
        items: list[str] = []
        returned = False
        try:
            made = job.func(ctx)
            if inspect.isawaitable(made):
                made = await made
            if isinstance(made, AsyncIterable):
                async for item in made:
                    items.append(self._encode(item, len(items), cap))
            elif isinstance(made, Iterable) and not isinstance(made, str | bytes | dict):
                for item in made:
                    items.append(self._encode(item, len(items), cap))
            else:
                raise PlanRefused(
                    f"the planner returned a {type(made).__name__}: return (or yield) the items"
                )
            returned = True
        finally:
            await ctx.leave_session_scope(commit=returned)
        return items

    @staticmethod
    def _encode(item: Any, n: int, cap: int) -> str:
        if n >= cap:
            raise PlanRefused(f"more than FANOUT_MAX_ITEMS ({cap}) items")
        try:
            return fanout.encode(item)
        except TypeError as exc:
            raise PlanRefused(f"item {n}: {exc}") from exc

    async def _fail(
        self, conn: Conn, tx: asyncpg.transaction.Transaction, run_id: int, status: str, error: str
    ) -> None:
        try:
            with deadline(conn, self.settings.db_query_timeout):
                await tx.rollback()
        except Exception:
            terminate(conn)
        await self.runner._record(run_id, status, error)

    def _outcome(
        self,
        ctx: JobContext | None,
        kind: Any,
        source: str,
        started: float,
        *,
        reason: str | None = None,
    ) -> Outcome:
        assert ctx is not None
        return self.runner.finished(ctx, kind, source, started, reason=reason)

    # --- the run's end, in the transaction that settled its last item -----------------------

    async def _finish(self, conn: Conn, job: Job, a: Active, total: int, source: str) -> Outcome:
        """Run `done` (in a savepoint) and end the run; the caller commits."""
        schema, spec = self.schema, job.fanout
        assert spec is not None
        done, failed = await fanout.counts(conn, schema, a.id)
        result: Any = None
        problem: str | None = None
        if spec.done is not None:
            ctx = DoneContext(
                conn=conn,
                job=job,
                run_id=a.run_id,
                slot=a.slot,
                now=a.started_at,
                params=self._params(job, a),
                trigger=a.trigger,
                instance=self.settings.instance_name,
                settings=self.settings,
                key=a.key,
                sessions=self.runner.sessions,
                total=total,
                done=done,
                failed=failed,
            )
            try:
                async with conn.transaction():
                    ctx.enter_session_scope(conn)
                    returned = False
                    try:
                        value = await asyncio.wait_for(spec.done(ctx), spec.timeout)
                        returned = True
                    finally:
                        await ctx.leave_session_scope(commit=returned)
                    result = json.loads(json.dumps(value, allow_nan=False))
            except (asyncpg.exceptions.ConnectionDoesNotExistError, DatabaseUnavailable):
                raise
            except Exception as exc:
                problem = f"done failed: {type(exc).__name__}: {exc}"
        state = "succeeded" if failed == 0 and problem is None else "failed"
        await fanout.close(conn, schema, a.id, state)
        summary = {"items": total, "done": done, "failed": failed, "result": result}
        if state == "succeeded":
            duration = await ledger.succeed(conn, schema, a.run_id, summary)
            kind: Any = "succeeded"
            reason = None
        else:
            parts = [f"{failed} of {total} items failed"] if failed else []
            parts += [problem] if problem else []
            reason = "; ".join(parts)
            await ledger.finish(conn, schema, a.run_id, "failed", reason[:2000])
            duration = None
            kind = "failed"
        outcome = Outcome(
            job.name,
            kind,
            a.run_id,
            a.slot,
            summary,
            round(duration, 3) if duration is not None else None,
            reason,
            a.trigger,
            a.key,
            items=total,
        )
        self.runner.log_outcome(outcome, source)
        return outcome

    # --- workers -------------------------------------------------------------------------

    async def work(self, stop: asyncio.Event) -> None:
        """Work the items of every fan-out in progress until `stop`."""
        concurrency = self.settings.fanout_concurrency
        tasks = [
            asyncio.create_task(self._listen(stop), name="fanout-listen"),
            asyncio.create_task(self._publish(stop), name="fanout-publish"),
            *(
                asyncio.create_task(self._worker(stop), name=f"fanout-worker-{i}")
                for i in range(concurrency)
            ),
        ]
        try:
            await stop.wait()
            # Items in flight get the grace period to finish; the rest roll back (they are
            # worked again, elsewhere or after the restart).
            await asyncio.wait(tasks, timeout=self.settings.graceful_shutdown_timeout)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks, timeout=2.0)

    async def _worker(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            worked = False
            try:
                if self.db.migrated:
                    await self._refresh()
                    for a in list(self.active):
                        if stop.is_set():
                            return
                        if await self._one(a):
                            worked = True
                            break
            except DatabaseUnavailable as exc:
                log.debug("fan-out worker: %s", exc.reason)
            except Exception:
                log.exception("fan-out worker failed; going on")
            if not worked:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._idle(stop), self.settings.fanout_poll_interval)

    async def _idle(self, stop: asyncio.Event) -> None:
        waiters = [asyncio.ensure_future(self.wake.wait()), asyncio.ensure_future(stop.wait())]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()
        self.refreshed = 0.0  # woken: look again now

    async def _refresh(self) -> None:
        """The fan-outs in progress (at most every poll interval, or when woken); those of
        paused jobs left out, those with a cancel request ended here."""
        if time.monotonic() - self.refreshed < self.settings.fanout_poll_interval / 2:
            return
        async with self._refreshing:
            if time.monotonic() - self.refreshed < self.settings.fanout_poll_interval / 2:
                return
            self.wake.clear()
            async with self.db.connection() as conn:
                found = await fanout.active(conn, self.schema, list(self.jobs))
                paused = await pause.active(conn, self.schema) if found else {}
            keep = []
            for a in found:
                if a.cancel_requested:
                    await self._cancel(a)
                elif a.job not in paused:
                    keep.append(a)
            self.active = keep
            self.refreshed = time.monotonic()

    async def _cancel(self, a: Active) -> None:
        """End a fan-out whose run an operator cancelled: no more claims; items in flight
        finish (their commits count, `done` does not run) or roll back."""
        async with self.db.connection() as conn, conn.transaction():
            run_id = await fanout.close(conn, self.schema, a.id, "cancelled")
            if run_id is None:
                return
            await ledger.finish(
                conn, self.schema, run_id, "cancelled", f"cancelled by {a.cancelled_by}"
            )
        job = self.jobs[a.job]
        outcome = Outcome(
            job.name,
            "cancelled",
            a.run_id,
            a.slot,
            reason=f"cancelled by {a.cancelled_by}",
            trigger=a.trigger,
            key=a.key,
        )
        self.runner.log_outcome(outcome, "fanout")

    async def _one(self, a: Active) -> bool:
        """Claim one item of `a` and work it; False when it has none to give now."""
        settings, schema = self.settings, self.schema
        job = self.jobs[a.job]
        spec = job.fanout
        assert spec is not None
        assert spec.each is not None
        db_timeout = spec.timeout + settings.db_timeout_margin
        conn = await self.db.acquire()
        tx = conn.transaction(isolation="read_committed")
        settled = False
        task: asyncio.Task[Any] | None = None
        # The item's span, once it is claimed: current while the item function runs (the
        # task copies it) and until its outcome is counted.
        spans = contextlib.ExitStack()
        span = NO_SPAN
        try:
            try:
                with deadline(conn, settings.db_query_timeout):
                    await tx.start()
                    row = await fanout.claim(
                        conn,
                        schema,
                        a.id,
                        db_timeout=db_timeout,
                        client_check_interval=settings.db_client_check_interval,
                        server_version=self.db.server_version,
                    )
                    if row is not None:
                        await conn.execute(SAVEPOINT_ITEM_SQL)
            except DRIVER_ERRORS as exc:
                raise translate(exc) from exc
            if row is None:
                return False
            if row["run_id"] != a.run_id:  # continued by a later attempt since the last look
                a = dataclasses.replace(a, run_id=row["run_id"], traceparent=row["traceparent"])
                self.refreshed = 0.0
            n, attempt = row["n"], row["attempts"] + 1
            span = spans.enter_context(
                self.runner.tracing.item(
                    a.job, a.run_id, n, attempt=attempt, parent=row["traceparent"]
                )
            )
            span.set(instance=settings.instance_name)
            ctx = ItemContext(
                conn=conn,
                job=job,
                run_id=a.run_id,
                slot=a.slot,
                now=a.started_at,
                params=self._params(job, a),
                trigger=a.trigger,
                instance=settings.instance_name,
                settings=settings,
                key=a.key,
                attempt=attempt,
                sessions=self.runner.sessions,
                item=row["item"],
                n=n,
            )
            self.in_flight[a.id] = self.in_flight.get(a.id, 0) + 1
            began = time.monotonic()
            try:
                task = asyncio.create_task(self._call(spec.each, ctx), name=f"item:{a.job}:{n}")
                done, _ = await asyncio.wait({task}, timeout=spec.timeout)
                error: BaseException | None
                if not done:
                    # Close the socket (no cancel request through PgBouncer): the server rolls
                    # the item back and frees its row at once.
                    terminate(conn)
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await asyncio.wait({task}, timeout=1.0)
                    error = TimeoutError(f"exceeded its timeout of {spec.timeout} s")
                elif task.cancelled():
                    error = RuntimeError("the item's task was cancelled")
                else:
                    error = task.exception()
                result: Any = None
                if error is None:
                    try:
                        result = json.loads(json.dumps(task.result(), allow_nan=False))
                    except (TypeError, ValueError) as exc:
                        error = TypeError(
                            f"returned a {type(task.result()).__name__} that is not JSON: {exc}"
                        )
                if error is None:
                    settled = await self._commit(conn, tx, job, a, n, result)
                    self._observe(job, "succeeded" if settled else "lost", began, span)
                    return True
            finally:
                self.in_flight[a.id] -= 1
                if not self.in_flight[a.id]:
                    del self.in_flight[a.id]
            # The item failed: its effects roll back to the savepoint, and the attempt is
            # counted in its transaction, still holding the item's row (no other worker can
            # take it before its backoff is written).
            message = f"{type(error).__name__}: {error}"[: fanout.MAX_ERROR]
            if not _closed(conn):
                try:
                    with deadline(conn, settings.db_query_timeout):
                        await conn.execute(ROLLBACK_ITEM_SQL)
                        outcome = await self._count_failure(
                            conn, job, a, n, row["attempts"], message
                        )
                        await tx.commit()
                    settled = True
                    self._observe(job, outcome, began, span, message)
                    return True
                except DATABASE_ERRORS:
                    terminate(conn)
            # Its connection is gone (a timeout closed it): count it in a transaction of its own.
            settled = True
            outcome = await self._attempt_failed(job, a, n, message)
            self._observe(job, outcome, began, span, message)
            return True
        except asyncio.CancelledError:
            terminate(conn)
            if task is not None and not task.done():
                task.cancel()
            raise
        finally:
            if not settled and not _closed(conn):
                try:
                    with deadline(conn, settings.db_query_timeout):
                        await tx.rollback()
                except Exception:
                    terminate(conn)
            await self.db.release(conn)
            spans.close()

    @staticmethod
    async def _call(func: Any, ctx: ItemContext) -> Any:
        """The item function, then its session settled in the same task (its flush is the
        item's, within its timeout)."""
        ctx.enter_session_scope(ctx.conn)
        returned = False
        try:
            result = await func(ctx)
            returned = True
        finally:
            await ctx.leave_session_scope(commit=returned)
        return result

    def _params(self, job: Job, a: Active) -> Any:
        """The run's params as the job's model (once per fan-out; as stored if they no longer
        validate)."""
        if job.params is None:
            return None
        found = self._params_of.get(a.id)
        if found is None:
            try:
                found = job.params.model_validate(a.params or {})
            except ValidationError:
                found = a.params
            self._params_of = {k: v for k, v in self._params_of.items() if k in self._ids()}
            self._params_of[a.id] = found
        return found

    def _ids(self) -> set[int]:
        return {a.id for a in self.active}

    async def _commit(
        self,
        conn: Conn,
        tx: asyncpg.transaction.Transaction,
        job: Job,
        a: Active,
        n: int,
        result: Any,
    ) -> bool:
        """Mark item `n` succeeded with its effects; settle the run if it was the last one.
        True once committed (or, when the connection broke during the commit, perhaps
        committed: the item's row says)."""
        settings = self.settings
        spec = job.fanout
        assert spec is not None
        try:
            with deadline(conn, settings.db_query_timeout):
                emptied = await fanout.succeeded(
                    conn,
                    self.schema,
                    a,
                    n,
                    result,
                    instance=settings.instance_name,
                    db_timeout=spec.timeout + settings.db_timeout_margin,
                    client_check_interval=settings.db_client_check_interval,
                    server_version=self.db.server_version,
                )
            if emptied:
                await self._shard_done(conn, job, a)
            with deadline(conn, settings.db_query_timeout):
                await tx.commit()
        except DATABASE_ERRORS as exc:
            log.warning(
                "%s: item %s of run %s not committed (it will be worked again): %s",
                job.name,
                n,
                a.run_id,
                exc.reason if isinstance(exc, DatabaseUnavailable) else describe(exc),
            )
            return False
        return True

    async def _shard_done(self, conn: Conn, job: Job, a: Active) -> None:
        with deadline(conn, self.settings.db_query_timeout):
            row = await fanout.shard_settled(conn, self.schema, a.id)
        if row["shards_left"] == 0 and row["state"] == "running":
            # The attempt that works the fan-out now, as its row says under its lock.
            current = dataclasses.replace(a, run_id=row["run_id"])
            await self._finish(conn, job, current, row["total"], "fanout")

    async def _attempt_failed(self, job: Job, a: Active, n: int, error: str) -> str:
        """Count a failed attempt at item `n`: retried later (backoff), or failed for good,
        which settles it (and maybe the run)."""
        schema = self.schema
        try:
            async with self.db.connection() as conn, conn.transaction():
                done = await fanout.attempts(conn, schema, a.id, n)
                if done is None:  # settled meanwhile, or another worker has it now
                    return "lost"
                return await self._count_failure(conn, job, a, n, done, error)
        except DATABASE_ERRORS as exc:
            log.warning(
                "%s: could not record the failed attempt at item %s of run %s: %s",
                job.name,
                n,
                a.run_id,
                exc.reason if isinstance(exc, DatabaseUnavailable) else describe(exc),
            )
            return "lost"

    async def _count_failure(
        self, conn: Conn, job: Job, a: Active, n: int, done: int, error: str
    ) -> str:
        """With item `n`'s row locked (`done` attempts ended before this one): retry it after
        a backoff, or settle it failed (and maybe the run)."""
        settings, schema = self.settings, self.schema
        spec = job.fanout
        assert spec is not None
        if done + 1 <= spec.retries:
            delay = settings.fanout_retry_delay * 2**done
            await fanout.retry_later(conn, schema, a.id, n, error, settings.instance_name, delay)
            return "retried"
        left = await fanout.failed(conn, schema, a, n, error=error, instance=settings.instance_name)
        if left == 0:
            await self._shard_done(conn, job, a)
        return "failed"

    def _observe(
        self, job: Job, outcome: str, began: float, span: Span, error: str | None = None
    ) -> None:
        """Count an item's attempt (`outcome`: succeeded, retried, failed, lost) in the
        metrics and on its span (an error unless it succeeded)."""
        if span.recording:
            span.set(outcome=outcome, duration_ms=round((time.monotonic() - began) * 1000, 3))
            if outcome != "succeeded":
                span.fail(error or outcome)
        metrics = self.runner.metrics
        if metrics is not None:
            metrics.observe_item(job.name, outcome, time.monotonic() - began)

    # --- wake-ups and what operators see ----------------------------------------------------

    async def _listen(self, stop: asyncio.Event) -> None:
        """Wake the workers on NOTIFY, on a connection of its own; polling goes on anyway."""
        url = self.settings.listen_url
        if not url:
            return
        while not stop.is_set():
            try:
                conn = await db.connect(self.settings, url)
            except Exception as exc:
                log.debug("fan-out listener cannot connect: %s", describe(exc))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.settings.fanout_poll_interval)
                continue
            lost = asyncio.Event()

            def on_close(_: object, lost: asyncio.Event = lost) -> None:
                lost.set()

            try:
                conn.add_termination_listener(on_close)
                await conn.add_listener(
                    fanout.notify_channel(self.schema), lambda *_: self.wake.set()
                )
                self.wake.set()  # anything planned while not listening
                waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(lost.wait())]
                try:
                    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waiters:
                        w.cancel()
            except DATABASE_ERRORS as exc:
                log.debug("fan-out listener lost: %s", describe(exc))
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(conn.close(), self.settings.db_connect_timeout)
            if not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.settings.fanout_poll_interval)

    async def _publish(self, stop: asyncio.Event) -> None:
        """Publish this instance's items in flight, when they change and at least every few
        poll intervals (what counts as fresh is 3 of them)."""
        last: dict[int, int] | None = None
        last_at = 0.0
        interval = self.settings.fanout_poll_interval
        while not stop.is_set():
            now = dict(self.in_flight)
            if now != last or time.monotonic() - last_at > min(1.0, interval):
                with contextlib.suppress(*DATABASE_ERRORS):
                    if self.db.migrated and (now or last):
                        async with self.db.connection() as conn:
                            await fanout.publish(
                                conn, self.schema, self.settings.instance_name, now
                            )
                    last, last_at = now, time.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), min(0.5, interval))
