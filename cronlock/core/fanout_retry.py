"""An operator's retry of a failed fan-out run's failed items: one item, or all of them
(`POST /cron/runs/{id}/items/{n}/retry`, `POST /cron/runs/{id}/items/retry`, the dashboard's
run page, `python -m cronlock retry-items`).

A retry is the run's next attempt, as cronlock's own retries make one (cronlock/core/retries.py):
a new ledger row (`attempt` + 1, `retry_of` the failed run; the same job, key, slot, trigger and
params) that takes the fan-out over, exactly as a retry or a backfill of a failed run's slot
continues it (cronlock/core/fanout.py `resume`). The items picked are pending again from attempt
1; the items that succeeded stay succeeded and are never redone; failed items not picked stay
failed and count as failed in the new attempt. The commit and its NOTIFY put the fan-out back
in front of the workers of every instance; the transaction that settles its last item runs
`done` once and ends the new attempt, `succeeded` only if no item is failed by then.

Made under the job's lock, as every attempt is: `retry_of` set under it makes this retry and
cronlock's own retry loop (which checks `ledger.retried` under the same lock) exclusive, and a
second operator's retry of the same run finds it retried already. The attempt's row commits
with its taking the fan-out over, in the lock's transaction, so a retry is made whole or not
at all. A failed fan-out's items are
all settled, so no worker holds one; the fan-out's row is locked while it is taken over.

Refused (RetryRefused, with the reason) for: a run or item that does not exist; a run that is
not a fan-out's, still running, not failed (succeeded, cancelled), or retried already (its
fan-out is the later attempt's: retry there); an item that did not fail; a job paused (its
workers would hold the items) or running another fan-out now; a run whose planning failed (it
has no items: trigger the job again).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from datetime import datetime
from typing import cast

from cronlock.core import fanout, ledger, pause
from cronlock.core.fanout_runner import FanoutRunner
from cronlock.core.jobs import Trigger
from cronlock.core.outcome import Outcome, annotate
from cronlock.db.lock import lock_text, reset_session, try_lock
from cronlock.db.pool import Conn, deadline
from cronlock.errors import (
    DRIVER_ERRORS,
    STANDBY_REASON,
    DatabaseUnavailable,
    RetryRefused,
    translate,
)
from cronlock.tracing import traceparent

log = logging.getLogger("cronlock.fanout")


@dataclass(frozen=True)
class Retried:
    """A retry made: the new attempt `run_id` continues `retry_of`'s fan-out with `retried`
    failed items pending again (of `total`)."""

    job: str
    run_id: int
    retry_of: int
    attempt: int
    slot: datetime | None
    key: str | None
    retried: int
    total: int


async def retry_items(
    fanouts: FanoutRunner, run_id: int, item: int | None = None, *, source: str
) -> Retried:
    """Retry item `item` of fan-out run `run_id` (None: every failed item of it) in a new
    attempt; RetryRefused says why not."""
    runner, settings, schema, db = fanouts.runner, fanouts.settings, fanouts.schema, fanouts.db
    await db.ensure_ready()
    try:
        async with db.connection() as conn:
            first = await ledger.get(conn, schema, run_id)
    except DRIVER_ERRORS as exc:
        raise translate(exc) from exc
    if first is None:
        raise RetryRefused(f"no run {run_id}", missing=True)
    job = runner.registry.get(first.job)
    if job is None:
        raise RetryRefused(f"run {run_id} is of job {first.job!r}, which is not served here")
    if job.fanout is None:
        raise RetryRefused(f"run {run_id} is not a fan-out run: job {job.name!r} has no items")
    try:
        await asyncio.wait_for(runner.lock_slots.acquire(), settings.db_acquire_timeout)
    except TimeoutError as exc:
        raise DatabaseUnavailable("no database connection free (pool exhausted)") from exc
    try:
        conn = await db.acquire()
    except BaseException:
        runner.lock_slots.release()
        raise
    tx = conn.transaction(isolation="read_committed")
    committed = False
    new_id: int | None = None
    # The new attempt's span, when traced: the parent of its items' spans, as a trigger's is.
    with contextlib.ExitStack() as spans:
        try:
            try:
                with deadline(conn, settings.db_query_timeout):
                    await tx.start()
                    row = await try_lock(
                        conn,
                        lock_text(schema, job.name, first.key),
                        settings.lock_namespace,
                        db_timeout=settings.db_query_timeout + settings.db_timeout_margin,
                        client_check_interval=settings.db_client_check_interval,
                        server_version=db.server_version,
                    )
                    if row["standby"]:
                        db.standby, db.migrated = True, False
                        raise DatabaseUnavailable(STANDBY_REASON)
                    if not row["locked"]:
                        raise RetryRefused(
                            f"job {job.name!r} is busy (a trigger or a retry holds its lock): "
                            "try again"
                        )
                    # Read again under the lock: what was true before it may not be now.
                    run = await ledger.get(conn, schema, run_id)
                    if run is None:  # removed meanwhile (retention, by hand)
                        raise RetryRefused(f"no run {run_id}", missing=True)
                    found = await _check(conn, schema, run, item)
                    # In the lock's transaction, unlike a trigger's row (committed at once, so
                    # that a long run can be followed): the attempt and its taking the fan-out
                    # over commit together or not at all. A row left behind by a retry that
                    # was not made would name the run as retried, and its fan-out, still the
                    # failed run's, could then be retried from neither.
                    new_id = await ledger.start(
                        conn,
                        schema,
                        job=run.job,
                        slot=run.slot,
                        trigger=run.trigger,
                        source=source,
                        instance=settings.instance_name,
                        backend_pid=row["backend_pid"],
                        started_at=row["db_now"],
                        params=run.params,
                        key=run.key,
                        attempt=run.attempt + 1,
                        retry_of=run.id,
                    )
                span = spans.enter_context(
                    runner.tracing.run(
                        job.name,
                        new_id,
                        attempt=run.attempt + 1,
                        slot=run.slot,
                        key=run.key,
                        trigger=run.trigger,
                    )
                )
                span.set(retry_of=run.id, source=source)
                with deadline(conn, settings.db_query_timeout):
                    resumed = await fanout.resume(
                        conn,
                        schema,
                        found.id,
                        new_id,
                        items=[item] if item is not None else None,
                        traceparent=traceparent(),
                    )
                    await reset_session(
                        conn,
                        settings.db_schema,
                        db_timeout=settings.db_query_timeout + settings.db_timeout_margin,
                        client_check_interval=settings.db_client_check_interval,
                        server_version=db.server_version,
                    )
                    await fanout.notify(conn, schema, found.id)
                    await tx.commit()
                committed = True
            except DRIVER_ERRORS as exc:
                raise translate(exc) from exc
        finally:
            if not committed:
                with contextlib.suppress(Exception), deadline(conn, settings.db_query_timeout):
                    await tx.rollback()
            await db.release(conn)
            runner.lock_slots.release()
        assert new_id is not None
        fanouts.wake.set()
        outcome = Outcome(
            job.name,
            "accepted",
            new_id,
            run.slot,
            trigger=cast(Trigger, run.trigger),
            key=run.key,
            items=resumed.total,
        )
        annotate(span, outcome)
        runner.log_outcome(outcome, source)
    log.info(
        "%s: run %s retries %s failed item(s) of run %s",
        job.name,
        new_id,
        resumed.retried,
        run.id,
        extra={"job": job.name, "run_id": new_id, "retry_of": run.id, "items": resumed.retried},
    )
    return Retried(
        job.name,
        new_id,
        run.id,
        run.attempt + 1,
        run.slot,
        run.key,
        resumed.retried,
        resumed.total,
    )


async def _check(conn: Conn, schema: str, run: ledger.Run, item: int | None) -> fanout.OfRun:
    """The run's fan-out, if its failed items (or `item`) may be retried now; else why not."""
    name = run.job
    if run.status == "running":
        raise RetryRefused(f"run {run.id} is still running: its failed items are retried after")
    later = await ledger.retried_by(conn, schema, run.id)
    if later is not None:
        raise RetryRefused(
            f"run {run.id} was retried already by run {later}: retry the items there"
        )
    if await pause.is_paused(conn, schema, name):
        raise RetryRefused(f"job {name!r} is paused: resume it first (its items would wait)")
    busy = await fanout.running(conn, schema, name, run.key)
    if busy is not None:
        raise RetryRefused(f"job {name!r} is running run {busy} now: retry after it ends")
    found = await fanout.of_run(conn, schema, run.id)
    if found is None:
        raise RetryRefused(
            f"run {run.id} has no items (its planning failed: "
            f"{(run.error or 'no reason recorded')[:200]}): trigger the job again"
        )
    if run.status != "failed" or found.state != "failed":
        raise RetryRefused(f"run {run.id} {run.status}: only a failed run's items are retried")
    if item is not None:
        status = await fanout.item_status(conn, schema, found.id, item)
        if status is None:
            raise RetryRefused(
                f"run {run.id} has no item {item} (its items are 0 to {found.total - 1})",
                missing=True,
            )
        if status != "failed":
            raise RetryRefused(
                f"item {item} of run {run.id} {status}: only a failed one is retried"
            )
    else:
        _, failed = await fanout.counts(conn, schema, found.id)
        if failed == 0:
            raise RetryRefused(f"run {run.id} has no failed items (it failed in `done`)")
    return found
