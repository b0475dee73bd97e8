"""When a scheduled job is due, and overdue.

A job is overdue when the newest tick whose grace period has passed (the *due slot*) has no
succeeded scheduled or backfill run, and no later tick has one either. Measuring against the
newest success (rather than only the current slot) keeps a job overdue from a missed tick
until a run succeeds, instead of clearing at the next tick and flapping. Catch-up runs what is
overdue, alerts report it, the views and metrics show it.

A job's history starts when the database first saw it (`ledger.first_seen`): a due slot before
that is not overdue (a job deployed a minute ago is not late for last night), and a job never
seen has no history to be late in.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from cronlock.core.jobs import Job
from cronlock.core.schedule import ScheduleError


def due_slot(job: Job, now: datetime) -> datetime | None:
    """The newest tick whose grace period has passed at `now`."""
    if job.schedule is None:
        return None
    try:
        return job.schedule.prev_tick(now - timedelta(seconds=job.grace))
    except ScheduleError:
        return None


def is_overdue(
    job: Job, now: datetime, last_success: datetime | None, seen: datetime | None
) -> bool:
    """`seen`: when the database first saw the job (None: never)."""
    due = due_slot(job, now)
    return (
        due is not None
        and seen is not None
        and due >= seen
        and (last_success is None or last_success < due)
    )
