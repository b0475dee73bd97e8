"""The cron side of `schedule export`: a job's schedule as UTC cron lines (for schedulers
without time zones), the zone's offsets in the coming year, and what every format shares: the
trigger's URL, which jobs are exported, the notes for what has no cron form."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

from cronlock.core.jobs import Job, Registry
from cronlock.core.schedule import Fields, Interval, Schedule

# A trigger waits for the job's answer; a bit longer than the job's own timeout, so the
# service's clean 504 arrives before the client gives up.
CURL_MARGIN = 30


class ExportError(ValueError):
    """The registry cannot be expressed in the chosen format."""


# --- cron lines in UTC ----------------------------------------------------------------------


def render(values: Iterable[int]) -> str:
    """A set of numbers as cron text: runs of three or more become ranges."""
    ordered = sorted(set(values))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{ordered[i]}-{ordered[j]}")
        else:
            parts.extend(str(v) for v in ordered[i : j + 1])
        i = j + 1
    return ",".join(parts)


@dataclass(frozen=True)
class CronLine:
    """One crontab-style entry in UTC. A day field of None is `*`; text fields are kept as the
    job wrote them (numbers only), sets are rendered."""

    minutes: frozenset[int]
    hours: frozenset[int]
    dom: frozenset[int] | str | None
    month: frozenset[int] | str | None
    dow: frozenset[int] | str | None

    def fields(self) -> list[str]:
        def day(value: frozenset[int] | str | None) -> str:
            if value is None:
                return "*"
            return value if isinstance(value, str) else render(value)

        return [
            render(self.minutes),
            render(self.hours),
            day(self.dom),
            day(self.month),
            day(self.dow),
        ]

    def __str__(self) -> str:
        return " ".join(self.fields())

    def split_days(self) -> list[CronLine]:
        """For schedulers that refuse both day fields restricted (Vercel): cron's rule makes
        such a line fire when EITHER matches, which is exactly these two lines."""
        if self.dom is None or self.dow is None:
            return [self]
        return [replace(self, dow=None), replace(self, dom=None)]


def zone_offsets(schedule: Schedule, start: datetime, days: int = 366) -> list[timedelta]:
    """The UTC offsets `schedule`'s zone has from `start` on, ascending (so that what is
    written does not depend on the season it is written in)."""
    seen: set[timedelta] = set()
    for hour in range(days * 24 + 1):
        offset = (start + timedelta(hours=hour)).astimezone(schedule.zone).utcoffset()
        if offset is not None:
            seen.add(offset)
    return sorted(seen)


def utc_lines(schedule: Schedule, start: datetime | None = None) -> list[CronLine]:
    """Cron lines in UTC that fire at every tick of `schedule` (in its zone) in the coming
    year, for each UTC offset the zone has then.

    A tick whose local day maps to another UTC day moves its day fields by a day. Days that
    cannot be shifted exactly in cron syntax (the 1st of a month becomes "the last day of the
    previous month") are over-approximated (28-31): the lines may fire more often than the
    schedule, never less, and the service's slot check drops the extras.
    """
    fields = schedule.fields
    start = start or datetime.now(UTC)
    lines: list[CronLine] = []
    for offset in zone_offsets(schedule, start):
        shift_minutes = int(offset.total_seconds() // 60)
        by_day: dict[int, dict[int, set[int]]] = defaultdict(lambda: defaultdict(set))
        for local in fields.times:
            utc_minute = local - shift_minutes
            day, of_day = divmod(utc_minute, 1440)
            by_day[day][of_day // 60].add(of_day % 60)
        for day, hours in sorted(by_day.items()):
            days = _shifted_days(day, fields)
            # Hours that share their minutes share a line.
            grouped: dict[frozenset[int], set[int]] = defaultdict(set)
            for hour, of_hour in hours.items():
                grouped[frozenset(of_hour)].add(hour)
            for minutes, hour_set in grouped.items():
                for dom, month, dow in days:
                    lines.append(CronLine(minutes, frozenset(hour_set), dom, month, dow))
    return _merge(lines)


DayFields = tuple[
    frozenset[int] | str | None, frozenset[int] | str | None, frozenset[int] | str | None
]


def _text_fields(fields: Fields) -> DayFields:
    """The day fields as the job wrote them (names as numbers), None for `*`."""
    dom, month, dow = (None if text == "*" else text for text in fields.text[2:])
    return dom, month, dow


def _shifted_days(shift: int, fields: Fields) -> list[DayFields]:
    """The day fields for ticks whose UTC day is `shift` days from their local day."""
    if shift == 0:
        return [_text_fields(fields)]
    if shift not in (-1, 1):
        raise ExportError("a UTC offset beyond a day cannot occur")  # Python caps offsets at 24 h
    _, _, dom_text, month_text, dow_text = fields.text
    dows = None if dow_text == "*" else frozenset((d + shift) % 7 for d in fields.dows)
    months = None if month_text == "*" else fields.months
    doms = None if dom_text == "*" else fields.doms
    if doms is None and months is None:
        return [(None, None, dows)]

    def wrap(month: int) -> int:
        return (month - 1) % 12 + 1

    all_months = frozenset(range(1, 13))
    if shift < 0:
        # Local day d is UTC day d-1; local day 1 is the last day (28-31) of the month before.
        same = None if doms is None else frozenset(d - 1 for d in doms if d > 1)
        spills = doms is None or 1 in doms
        spill: DayFields = (
            frozenset(range(28, 32)),
            frozenset(wrap(m - 1) for m in (months or all_months)) if months else None,
            dows,
        )
    else:
        # Local day d is UTC day d+1; a local last day (28-31) is the 1st of the next month.
        same = None if doms is None else frozenset(d + 1 for d in doms if d < 31)
        spills = doms is None or any(d >= 28 for d in doms)
        spill = (
            frozenset({1}),
            frozenset(wrap(m + 1) for m in (months or all_months)) if months else None,
            dows,
        )
    found: list[DayFields] = []
    if same is None or same:
        found.append((same, months, dows))
    if spills:
        found.append(spill)
    return found


def _merge(lines: list[CronLine]) -> list[CronLine]:
    """Drop duplicates, then join lines that differ only in their hours."""
    unique = list(dict.fromkeys(lines))
    joined: dict[tuple[object, ...], CronLine] = {}
    for line in unique:
        key = (line.minutes, line.dom, line.month, line.dow)
        if key in joined:
            joined[key] = replace(joined[key], hours=joined[key].hours | line.hours)
        else:
            joined[key] = line
    return list(joined.values())


def _is_utc(job: Job, start: datetime) -> bool:
    assert isinstance(job.schedule, Schedule)  # intervals are written as cron (`as_cron`)
    return zone_offsets(job.schedule, start) == [timedelta(0)]


def _offset_label(offset: timedelta) -> str:
    minutes = int(offset.total_seconds() // 60)
    sign = "+" if minutes >= 0 else "-"
    return f"UTC{sign}{abs(minutes) // 60:02}:{abs(minutes) % 60:02}"


def job_lines(job: Job, start: datetime, *, split_days: bool = False) -> list[str]:
    """The UTC cron expressions that trigger `job`."""
    assert isinstance(job.schedule, Schedule)  # intervals are written as cron (`as_cron`)
    if _is_utc(job, start):
        fields = job.schedule.fields
        line = CronLine(frozenset(), frozenset(), *_text_fields(fields))
        days = line.split_days() if split_days else [line]
        return [" ".join(fields.text[:2] + tuple(d.fields()[2:])) for d in days]
    found = utc_lines(job.schedule, start)
    if split_days:
        found = [part for line in found for part in line.split_days()]
    return [str(line) for line in dict.fromkeys(found)]


def trigger_url(base: str, job: Job) -> str:
    return f"{base.rstrip('/')}/cron/{job.name}"


def scheduled_jobs(registry: Registry) -> list[Job]:
    # A keyed job's trigger carries its key, which only its operator knows: an entry without
    # one would be a 422 at every tick. One entry per key is theirs to write (docs/keyed-jobs.md).
    return [j for j in registry.values() if j.schedule is not None and j.key is None]


def describe(job: Job, start: datetime) -> str:
    assert isinstance(job.schedule, Schedule)  # intervals are written as cron (`as_cron`)
    offsets = zone_offsets(job.schedule, start)
    zone = f"{job.schedule.tz} ({' / '.join(_offset_label(o) for o in offsets)})"
    return f"{job.name}: `{job.schedule.expr}` in {zone}, timeout {job.timeout:g} s"


def lateness_note(job: Job, start: datetime) -> str | None:
    """A warning for a zoned job whose extra entries could run a missed slot late."""
    assert isinstance(job.schedule, Schedule)  # intervals are written as cron (`as_cron`)
    offsets = zone_offsets(job.schedule, start)
    if len(offsets) < 2:
        return None
    spread = max(offsets) - min(offsets)
    if job.max_lateness is not None and job.max_lateness < spread.total_seconds():
        return None
    return (
        f"note: {job.name} has no max_lateness below {spread.total_seconds():g} s, so when its "
        "real trigger fails, the other offset's entry runs that slot once, late"
    )


def as_cron(registry: Registry) -> tuple[Registry, list[str]]:
    """The registry with each interval job written as its exact cron expression, and those
    without one left out; with a note for each."""
    jobs: dict[str, Job] = {}
    notes: list[str] = []
    for name, job in registry.items():
        if isinstance(job.schedule, Interval):
            cron = job.schedule.cron
            if cron is None:
                notes.append(
                    f"{name}: every {job.schedule.every} s has no cron form (cron counts whole "
                    "minutes dividing an hour, or hours dividing a day): not exported; the "
                    "built-in scheduler runs it (SCHEDULER_ENABLED=true, docs/triggering.md)"
                )
                continue
            notes.append(
                f"{name}: every {job.schedule.every} s exported as `{cron}` (the same ticks)"
            )
            job = replace(job, schedule=Schedule(cron, "UTC"))
        jobs[name] = job
    return Registry(jobs, registry.namespace, registry.schema), notes
