"""A job's recent runs as a timeline, computed on the server for an inline SVG.

One mark per run at its start, as wide as its duration (at least a hairline) and as tall as
the log of its duration, coloured by outcome (a CSS class). The schedule's slots in the
window are drawn as ticks below the axis; a slot in the past with no run for it is a missed
slot, drawn as a hollow marker, so a gap in the marks above is a gap the schedule shows too.
Slots before the database first saw the job are not missed: its history starts there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from cronlock.core.jobs import Job
from cronlock.core.schedule import ScheduleError
from cronlock.ops.views import RunView

WIDTH = 900.0
HEIGHT = 140.0
TOP = 10.0
AXIS = 100.0  # the baseline of the run marks
MAX_SLOTS = 400  # more ticks than this in the window are not drawn (every minute, for days)


@dataclass(frozen=True)
class Mark:
    x: float
    y: float
    width: float
    height: float
    status: str
    title: str
    run_id: int


@dataclass(frozen=True)
class Tick:
    x: float
    missed: bool
    title: str


@dataclass(frozen=True)
class Label:
    x: float
    text: str


@dataclass
class Timeline:
    start: datetime
    end: datetime
    marks: list[Mark] = field(default_factory=list)
    slots: list[Tick] = field(default_factory=list)
    labels: list[Label] = field(default_factory=list)
    missed: int = 0
    slots_drawn: bool = True
    width: float = WIDTH
    height: float = HEIGHT
    axis: float = AXIS


def build(
    job: Job,
    runs: list[RunView],
    now: datetime,
    days: float,
    *,
    seen: datetime | None,
    complete: bool = True,
) -> Timeline:
    """`runs`: the job's runs in the window, newest first; `seen`: when the database first saw
    the job (None: never, so nothing is missed yet); `complete=False` when the runs are only
    the newest of them (a capped query): slots older than the oldest run given are then not
    called missed, since their runs may simply not have been fetched."""
    start = now - timedelta(days=days)
    span = (now - start).total_seconds()
    line = Timeline(start=start, end=now)

    def x(at: datetime) -> float:
        return round((at - start).total_seconds() / span * WIDTH, 2)

    shown = [r for r in runs if r.started_at >= start]
    longest = max((r.duration_ms or 0.0 for r in shown), default=0.0)
    scale = math.log10(1 + longest) or 1.0
    for r in shown:
        took = r.duration_ms or 0.0
        height = max(4.0, (AXIS - TOP) * math.log10(1 + took) / scale)
        width = took / 1000.0 / span * WIDTH
        when = r.started_at.strftime("%Y-%m-%d %H:%M:%S")
        took_text = f"{took:.0f} ms" if r.duration_ms is not None else "running"
        left = min(x(r.started_at), WIDTH - 3.0)  # a run that just started stays visible
        line.marks.append(
            Mark(
                x=left,
                y=round(AXIS - height, 2),
                width=round(max(3.0, min(width, WIDTH - left)), 2),
                height=round(height, 2),
                status=r.status,
                title=f"run {r.id}: {r.status}, {when}, {took_text}",
                run_id=r.id,
            )
        )
    day = start.replace(hour=0, minute=0, second=0, microsecond=0) + timedelta(days=1)
    while day < now:
        line.labels.append(Label(x=x(day), text=day.strftime("%b %d")))
        day += timedelta(days=1)
    if job.schedule is not None:
        covered = {r.slot for r in runs if r.slot is not None}
        ticks: list[datetime] = []
        try:
            at = job.schedule.next_tick(start)
            while at <= now and len(ticks) <= MAX_SLOTS:
                ticks.append(at)
                at = job.schedule.next_tick(at)
        except ScheduleError:
            ticks = []
        if len(ticks) > MAX_SLOTS:
            line.slots_drawn = False
        else:
            grace = timedelta(seconds=job.grace)
            known_from = start if complete or not runs else min(r.started_at for r in runs)
            for tick in ticks:
                missed = (
                    tick not in covered
                    and tick + grace < now
                    and tick >= known_from
                    and seen is not None
                    and tick >= seen
                )
                line.missed += missed
                label = tick.strftime("%Y-%m-%d %H:%M")
                line.slots.append(
                    Tick(
                        x=x(tick),
                        missed=missed,
                        title=f"slot {label}: missed" if missed else f"slot {label}",
                    )
                )
    return line
