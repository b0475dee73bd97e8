"""Catching up: missed slots (no scheduled or backfill run was even attempted for them) of a
job with a missed-slot policy run as backfills, from any instance; a background loop of each
service instance looks every CATCH_UP_INTERVAL seconds, and `python -m cronlock catch-up` does it
once.

Policies (`@job(missed=...)`): `latest` (what `catch_up=True` is, and always was) runs the due
slot once when it was missed; `all` runs every missed slot, oldest first, within the backfill
window and `max_lateness`, never before the database first saw the job (a job deployed
today missed nothing yesterday: cronlock/core/due.py), looking at most MAX_ALL_TICKS
ticks back (older missed slots are not run: a warning names where the look stopped); `none`
(the default) leaves them overdue for a person.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import datetime, timedelta

from cronlock.core import ledger
from cronlock.core.due import due_slot, is_overdue
from cronlock.core.jobs import Job
from cronlock.core.outcome import Outcome
from cronlock.core.runner import Runner
from cronlock.db.lock import internal_lock
from cronlock.db.pool import Conn
from cronlock.errors import DRIVER_ERRORS, DatabaseUnavailable, InvalidTrigger, translate
from cronlock.settings import Settings

log = logging.getLogger("cronlock.catchup")

# Serialises catch-up decisions across the instances of one deployment (see `catch_up`): the
# lock's name (`locks` shows it as "(catch-up)") and the statement that tries it.
CATCH_UP = "catch-up"
CATCH_UP_LOCK_SQL = """
SELECT set_config('idle_in_transaction_session_timeout', $3, true),
       pg_try_advisory_xact_lock(hashtextextended($1, $2)) AS locked,
       now() AS db_now
"""


# How far back (in ticks) one pass of the `all` policy looks: an every=1 job with a week's
# window would otherwise walk 604,800 ticks at each pass (some 50 us each, on the event loop).
MAX_ALL_TICKS = 1000
_TINY = timedelta(microseconds=1)


def recent_ticks(
    job: Job, now: datetime, seen: datetime | None, backfill_window: float
) -> tuple[list[datetime], bool]:
    """The ticks the `all` policy considers, oldest first: from the due slot back, within the
    backfill window and `max_lateness`, not before `seen` (when the database first saw the
    job; None: never, so none), at most MAX_ALL_TICKS of them; and whether older ones in that
    range were left out."""
    due = due_slot(job, now)
    if due is None or job.schedule is None or seen is None:
        return [], False
    reach = backfill_window if job.max_lateness is None else min(backfill_window, job.max_lateness)
    oldest = max(now - timedelta(seconds=reach), seen)
    ticks: list[datetime] = []
    tick = due
    while tick >= oldest and len(ticks) < MAX_ALL_TICKS:
        ticks.append(tick)
        tick = job.schedule.prev_tick(tick - _TINY)
    return ticks[::-1], tick >= oldest


async def _missed(
    conn: Conn,
    job: Job,
    now: datetime,
    last_success: datetime | None,
    seen: datetime | None,
    settings: Settings,
) -> list[datetime]:
    """The slots `job`'s policy runs now, oldest first."""
    schema = settings.db_schema
    if job.missed_policy == "all":
        ticks, cut = recent_ticks(job, now, seen, settings.backfill_window)
        if not ticks:
            return []
        done = await ledger.attempted_slots(conn, schema, job.name, ticks[0])
        missed = [t for t in ticks if t not in done]
        if cut and missed and missed[0] == ticks[0]:
            # The oldest tick looked at was missed too: older ones may have been, unseen, and
            # the next pass (these now attempted) will not look further back either.
            log.warning(
                "catch-up of %s looks %d ticks back, to %s; missed slots before it are not"
                " run (backfill them with ?slot=)",
                job.name,
                MAX_ALL_TICKS,
                ticks[0].isoformat(),
                extra={"job": job.name, "slot": ticks[0].isoformat()},
            )
        return missed
    slot = missed_slot(job, now, last_success, seen, settings.backfill_window)
    if slot is None or await ledger.slot_attempted(conn, schema, job.name, slot):
        return []
    return [slot]


def missed_slot(
    job: Job,
    now: datetime,
    last_success: datetime | None,
    seen: datetime | None,
    backfill_window: float,
) -> datetime | None:
    """The slot a `catch_up` job should still run: overdue (which needs `seen`, when the
    database first saw the job, before it), young enough to backfill, and not later than the
    job's own `max_lateness` allows."""
    if job.missed_policy == "none" or not is_overdue(job, now, last_success, seen):
        return None
    slot = due_slot(job, now)
    assert slot is not None
    late = (now - slot).total_seconds()
    if late > backfill_window or (job.max_lateness is not None and late > job.max_lateness):
        return None
    return slot


async def catch_up(runner: Runner) -> list[Outcome]:
    """Run the missed slots of each job with a policy (`missed=`, `catch_up=True`), at most once
    per slot.

    "Missed" means no scheduled or backfill run was even attempted for the due slot; a slot
    whose run failed stays overdue for a person to look at. The slot runs as a backfill, so
    its success counts like the scheduled run would have. Decisions are taken under a lock of
    their own and the attempt's ledger row is committed before that lock is released, so two
    instances never both attempt one slot.
    """
    chosen = [j for j in runner.registry.values() if j.catch_up and j.schedule is not None]
    if not chosen:
        return []
    settings, db = runner.settings, runner.db
    await db.ensure_ready()
    outcomes: list[Outcome] = []
    longest = max(j.timeout for j in chosen) + settings.db_timeout_margin
    try:
        async with db.connection(bounded=False) as conn, conn.transaction():
            row = await conn.fetchrow(
                CATCH_UP_LOCK_SQL,
                internal_lock(settings.db_schema, CATCH_UP),
                settings.lock_namespace,
                f"{int(longest * 1000)}ms",
            )
            assert row is not None
            if not row["locked"]:
                return []
            now: datetime = row["db_now"]
            names = [j.name for j in chosen]
            succeeded = await ledger.last_succeeded_slots(conn, settings.db_schema, names)
            seen = await ledger.first_seen(conn, settings.db_schema, names)
            for job in chosen:
                last, since = succeeded.get(job.name), seen.get(job.name)
                for slot in await _missed(conn, job, now, last, since, settings):
                    log.info(
                        "catching up %s",
                        job.name,
                        extra={"job": job.name, "slot": slot.isoformat()},
                    )
                    try:
                        outcome = await runner.trigger(
                            job, slot=slot, source="catch-up", first_attempt=True
                        )
                    except InvalidTrigger as exc:
                        log.warning("cannot catch up %s: %s", job.name, exc.args[0])
                        continue
                    outcomes.append(outcome)
                    if outcome.kind == "skipped" and outcome.reason in (
                        "paused",
                        "already running",
                    ):
                        break  # the job's other slots wait for the next pass
    except DRIVER_ERRORS as exc:
        raise translate(exc) from exc
    return outcomes


async def catch_up_loop(runner: Runner, stop: asyncio.Event) -> None:
    """`catch_up` in the background of a service instance: as soon as the database is ready,
    then every CATCH_UP_INTERVAL seconds."""
    interval = runner.settings.catch_up_interval
    while not stop.is_set():
        if runner.db.migrated:
            try:
                await catch_up(runner)
            except DatabaseUnavailable as exc:
                log.warning("catch-up skipped: %s", exc.reason)
            except Exception:
                log.exception("catch-up failed")
            wait = interval
        else:
            wait = min(interval, 1.0)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), wait)
