"""Retries cronlock owns: `@job(..., retries=3, retry_delay=30)`.

A scheduler's own retry that lands while the first attempt is still running is answered
`200 already running`, so the scheduler believes it worked; if that attempt then fails, nobody
tries again. cronlock knows: a failed, timed-out or abandoned (its instance died) scheduled or
backfill run is tried again for the same slot, by any instance, `retry_delay` seconds after it
ended, doubling after each attempt, until one succeeds, the retries run out, or the retry
would start past the job's `max_lateness`. Manual runs (`force=true`) are never retried.

The ledger is the queue: each attempt is a row (`attempt` from 1, `retry_of` = the row it
retries), so nothing is lost when instances die, and every instance's retry loop
(`retry_loop`, every RETRY_POLL_INTERVAL seconds) sees the same due retries. A retry goes
through the runner like any trigger (the backfill path: its own slot, even after the next
tick), and under the job's lock the runner checks that nobody made this retry already
(`ledger.retried`), so two instances never make the same attempt twice.

A dynamic job's (cronlock/core/schedules.py) failed slot is retried for its key and slot, and only
while the key's schedule still has that slot (the runner's `_decide_retry`, under the key's lock).

Lease runs (cronlock/core/lease.py) end the same ways and are retried by the same path: `due` and
`run` take any `ledger.Run` whose status is final; the lease runner only has to accept `retry_of`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, PlainSerializer, ValidationError

from cronlock.core import ledger, pause
from cronlock.core.jobs import Job, Registry
from cronlock.db.pool import Conn
from cronlock.errors import DATABASE_ERRORS, InvalidTrigger, describe

if TYPE_CHECKING:
    from cronlock.core.outcome import Outcome
    from cronlock.core.runner import Runner

log = logging.getLogger("cronlock.retries")

Timestamp = Annotated[datetime, PlainSerializer(lambda d: d.isoformat(), return_type=str)]
RETRYABLE = ("failed", "timed_out", "abandoned")


def delay(job: Job, attempt: int) -> float:
    """Seconds after attempt number `attempt` ended before the next one: doubling."""
    return float(job.retry_delay * 2 ** (attempt - 1))


@dataclass(frozen=True)
class Verdict:
    """What happens after a failed attempt: a retry at `at`, or none (`why`)."""

    failed: ledger.Run
    at: datetime | None
    why: Literal["due", "waiting", "exhausted", "too late"]


def verdict(job: Job, failed: ledger.Run, now: datetime) -> Verdict:
    if failed.attempt > job.retries:
        return Verdict(failed, None, "exhausted")
    ended = failed.finished_at or failed.started_at
    at = ended + timedelta(seconds=delay(job, failed.attempt))
    slot, bound = failed.slot, job.max_lateness
    if slot is not None and at < slot:
        # An attempt started within the early tolerance, before its slot, and failed: its
        # retry is a backfill of that slot, which waits until the slot is past.
        at = slot
    if bound is not None and slot is not None and (max(at, now) - slot).total_seconds() > bound:
        return Verdict(failed, None, "too late")
    return Verdict(failed, at, "due" if at <= now else "waiting")


async def pending(
    conn: Conn, registry: Registry, now: datetime, window: float, job: str | None = None
) -> dict[str, list[Verdict]]:
    """Per job with retries (all of them, or `job` alone), its failed slots that will be
    retried (due or waiting)."""
    # Lease jobs too: an attempt whose holder died is taken over (its successor names it, so
    # it is not one to retry here); a failed or timed-out one is retried like any other, and
    # resumes from its checkpoint. Their takeovers are attempts as well, and count as such.
    jobs = {
        name: j
        for name, j in registry.items()
        if j.retries > 0 and (j.schedule is not None or j.dynamic) and job in (None, name)
    }
    if not jobs:
        return {}
    since = now - timedelta(seconds=window)
    found: dict[str, list[Verdict]] = {}
    for failed in await ledger.last_failed_attempts(conn, registry.schema, list(jobs), since):
        v = verdict(jobs[failed.job], failed, now)
        if v.at is not None:
            found.setdefault(failed.job, []).append(v)
    return found


class RetryView(BaseModel):
    """A job's pending retry, as /cron/jobs shows it: "failing, retry 2 of 3 at T"."""

    slot: Timestamp | None
    key: str | None
    retry: int  # the coming retry's number: the attempt that failed, retried once more
    of: int  # the job's retries
    at: Timestamp
    last_status: str
    last_run_id: int
    summary: str


def view(v: Verdict, job: Job) -> RetryView:
    assert v.at is not None
    return RetryView(
        slot=v.failed.slot,
        key=v.failed.key,
        retry=v.failed.attempt,
        of=job.retries,
        at=v.at,
        last_status=v.failed.status,
        last_run_id=v.failed.id,
        summary=f"failing, retry {v.failed.attempt} of {job.retries} at {v.at.isoformat()}",
    )


async def retry_once(runner: Runner, refused: set[int] | None = None) -> list[Outcome]:
    """Run every due retry once (from this instance); what `retry_loop` does each pass.

    `refused` (kept by the loop across passes): failed runs whose retry cannot be made (its
    params no longer validate, its slot is no tick of the schedule any more), said once, not
    at every pass for as long as the backfill window lasts. A paused job's retries wait,
    silently: the pause is checked again under the lock when they are made."""
    settings, registry = runner.settings, runner.registry
    refused = set() if refused is None else refused
    await runner.db.ensure_ready()
    async with runner.db.connection() as conn:
        # Rows of instances that died are `running` until swept: then they can be retried.
        with contextlib.suppress(*DATABASE_ERRORS):
            await ledger.close_abandoned(conn, settings.db_schema, settings.lock_namespace)
        now: datetime = await conn.fetchval("SELECT now()")
        found = await pending(conn, registry, now, settings.backfill_window)
        paused = await pause.active(conn, settings.db_schema) if found else {}
    outcomes: list[Outcome] = []
    for name, verdicts in found.items():
        job = registry[name]
        if name in paused:
            continue
        for v in verdicts:
            if v.why != "due" or v.failed.id in refused:
                continue
            outcome = await run(runner, job, v.failed)
            if outcome is None:
                refused.add(v.failed.id)
            else:
                outcomes.append(outcome)
    return outcomes


async def run(runner: Runner, job: Job, failed: ledger.Run) -> Outcome | None:
    """The next attempt at `failed`, for its slot, through the runner."""
    params = None
    if job.params is not None:
        try:
            params = job.params.model_validate(failed.params or {})
        except ValidationError as exc:  # the job's params model changed since
            log.warning("cannot retry run %s of %s: %s", failed.id, job.name, exc)
            return None
    log.info(
        "retrying %s",
        job.name,
        extra={
            "job": job.name,
            "run_id": failed.id,
            "attempt": failed.attempt + 1,
            "slot": failed.slot.isoformat() if failed.slot else None,
        },
    )
    try:
        return await runner.trigger(
            job, slot=failed.slot, params=params, source="retry", retry_of=failed
        )
    except InvalidTrigger as exc:  # e.g. the slot left the backfill window
        log.warning("cannot retry run %s of %s: %s", failed.id, job.name, exc.args[0])
        return None


async def retry_loop(runner: Runner, stop: asyncio.Event) -> None:
    """`retry_once` in the background of a service instance, every RETRY_POLL_INTERVAL s."""
    interval = runner.settings.retry_poll_interval
    refused: set[int] = set()
    while not stop.is_set():
        if runner.db.migrated:
            try:
                await retry_once(runner, refused)
            except DATABASE_ERRORS as exc:
                log.warning("retries skipped: %s", describe(exc))
            except Exception:
                log.exception("retry pass failed")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)
