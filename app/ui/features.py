"""The adapter between the dashboard and the features it shows where this version has them.

Pause/resume and retries ("failing, retry n of m") come from the "on its own" work: pause
state in `<schema>.pauses` through `app/pause.py` (`active`, `pause`, `resume`), and the pending
retry of a job in `/cron/jobs`'s view (`JobView.retry`, an `app.retries.RetryView` with `retry`
and `of`). Where `app/pause.py` does not exist, this module says the features are absent: the
pages render nothing for them (templates/_pause.html, the `paused` and `failing` badges) and
the pause and resume forms answer 404. This is the one place that knows their shapes.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from datetime import datetime
from types import ModuleType
from typing import Any

from app.db import Conn
from app.jobs import Job
from app.ops import JobView
from app.settings import Settings


def _module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:  # the module exists but something it imports is missing
            raise
        return None


_pause = _module("app.pause")

# Whether this version can pause jobs: the pages offer pause and resume only then.
PAUSE = _pause is not None


class FeatureAbsent(Exception):
    """This version of cronlock does not have the feature."""


@dataclass(frozen=True)
class Failing:
    retry: int  # the coming retry's number
    of: int  # the retries the job allows


def paused(view: JobView) -> Any | None:
    """The job's pause (`by`, `at`, `note`, `until`) where this version pauses jobs."""
    return getattr(view, "paused", None)


async def pause(
    conn: Conn,
    settings: Settings,
    job: Job,
    *,
    by: str,
    note: str | None,
    until: datetime | None,
) -> None:
    """Pause `job` on every instance (InvalidTrigger for an `until` not in the future)."""
    if _pause is None:
        raise FeatureAbsent("pause")
    await _pause.pause(conn, settings.db_schema, job.name, by=by, note=note, until=until)


async def resume(conn: Conn, settings: Settings, job: Job) -> None:
    if _pause is None:
        raise FeatureAbsent("resume")
    await _pause.resume(conn, settings.db_schema, job.name)


def failing(view: JobView) -> Failing | None:
    """The job's failed slot waiting for its retry n of m, where this version retries."""
    retry = getattr(view, "retry", None)
    if retry is None:
        return None
    return Failing(retry=int(retry.retry), of=int(retry.of))
