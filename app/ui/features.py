"""The adapter between the dashboard and features it shows where this version has them.

Pause/resume and retries ("failing, retry n of m") come from the "on its own" work, which
keeps pause state in the database and answers `POST /cron/jobs/{name}/pause` and `/resume`.
Until it is merged, this module says they are absent: the pages render nothing for them
(templates/_pause.html and the `failing` badge) and the pause/resume forms answer 404. To
connect them, fill in the four functions below from that feature's ops; nothing else in the
dashboard needs to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from app.db import Conn
from app.jobs import Job, Registry
from app.ops import JobView
from app.settings import Settings


class FeatureAbsent(Exception):
    """This version of cronlock does not have the feature."""


@dataclass(frozen=True)
class Paused:
    by: str | None  # who paused it (the kind of token, or a name)
    until: datetime | None  # None: until resumed
    note: str | None


@dataclass(frozen=True)
class Failing:
    attempt: int  # the last attempt's number
    max_attempts: int  # what the job allows (its retries + 1)


# The lead sets this to True when pause/resume is merged (and connects the functions).
PAUSE = False


async def paused(conn: Conn, registry: Registry) -> dict[str, Paused]:
    """Every paused job's pause, by job name. Absent feature: nothing is paused."""
    return {}


async def pause(
    conn: Conn,
    settings: Settings,
    job: Job,
    *,
    by: str,
    note: str | None,
    until: datetime | None,
) -> None:
    raise FeatureAbsent("pause")


async def resume(conn: Conn, settings: Settings, job: Job, *, by: str) -> None:
    raise FeatureAbsent("resume")


def failing(job: Job, view: JobView) -> Failing | None:
    """The job is failing and retrying: its last run failed as attempt n of the m its retry
    policy allows. Absent feature (no retry policy on `Job`): never."""
    retries = getattr(job, "retries", None)
    last = view.last_run
    if not isinstance(retries, int) or retries <= 0 or last is None:
        return None
    attempt = getattr(last, "attempt", None)
    if last.status == "succeeded" or not isinstance(attempt, int):
        return None
    return Failing(attempt=attempt, max_attempts=retries + 1)
