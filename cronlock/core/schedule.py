"""Five-field cron schedules in an IANA time zone, computed exactly and without dependencies.

Syntax: ``minute hour day-of-month month day-of-week`` with ``*``, numbers, ranges ``a-b``, lists
``a,b``, steps ``*/n``, ``a-b/n`` and ``a/n`` (``a`` up to the field's maximum), month names
``jan``..``dec`` and weekday names ``sun``..``sat`` (case-insensitive); day-of-week 7 is Sunday, and
``*`` or ``a/n`` there cover 0-6 so Sunday is never counted twice. Macros: ``@hourly``, ``@daily``,
``@midnight``, ``@weekly``, ``@monthly``, ``@yearly``, ``@annually``.

Day rule (Vixie cron): when both day-of-month and day-of-week are restricted (neither field starts
with ``*``), a day matches if EITHER matches; otherwise both must match. So ``0 0 13 * fri`` runs on
every 13th and every Friday, while ``0 0 */2 * fri`` runs on odd-numbered Fridays only.

Daylight saving follows classic cron. Ticks are matched on the zone's local wall clock and then
mapped to UTC instants:

* A job with a fixed hour (hour field not starting with ``*``) is meant to run once at a time of
  day. A local tick that does not exist (spring-forward gap, e.g. 02:30 in Europe/Berlin on the last
  Sunday of March) runs once right after the change, at the transition instant (03:00 local =
  01:00 UTC); several gap ticks collapse into that one instant. A local tick that occurs twice
  (fall-back) runs once, at its first occurrence (``fold=0``).
* A job with a wildcard hour (``*`` or ``*/n``) follows the real clock: a gap tick does not exist,
  and a repeated wall time yields both instants.

Ticks form a set of unique instants; ``prev_tick``, ``next_tick`` and ``is_tick`` all answer from
that same set. The search walks candidate local days rather than minutes, so even a yearly schedule
costs well under a millisecond. A day without an offset change maps its times with one offset;
only days around a change map each candidate on its own. That shortcut assumes two offset changes
never fall within one day of each other, which holds for all of tzdata since 1900 (the closest
pair is four days apart).
"""

from __future__ import annotations

import functools
from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

__all__ = ["EPOCH", "MACROS", "Fields", "Interval", "Schedule", "ScheduleError", "Slots"]

_DAY = timedelta(days=1)
# Python bounds every UTC offset by 24 h, so a local time's instants lie within a day of it when
# both are read as naive datetimes. The day walks below use this to know when to stop.
_MAX_SHIFT = _DAY
# A schedule that fires at all has a matching day at least every dozen years (Feb 29 skips 2100);
# the horizon only guards against looping forever.
_HORIZON = timedelta(days=50 * 366)
# The parse-time "can it ever fire" scan starts here: 2000-2027 alone holds every (month,
# day-of-month, weekday) combination, Feb 29 on each weekday included.
_FEASIBILITY_START = date(2000, 1, 1)

MACROS = {
    "@hourly": "0 * * * *",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@weekly": "0 0 * * 0",
    "@monthly": "0 0 1 * *",
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
}
_MONTHS = {
    name: number
    for number, name in enumerate(
        ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"),
        start=1,
    )
}
_WEEKDAYS = {
    name: number for number, name in enumerate(("sun", "mon", "tue", "wed", "thu", "fri", "sat"))
}


class ScheduleError(ValueError):
    """A cron expression or time zone that cannot be used."""


@dataclass(frozen=True)
class _FieldSpec:
    name: str
    low: int
    high: int  # what `*` and `a/n` extend to
    limit: int  # the largest value accepted when written out (7 for Sunday in day-of-week)
    names: dict[str, int]


_MINUTE = _FieldSpec("minute", 0, 59, 59, {})
_HOUR = _FieldSpec("hour", 0, 23, 23, {})
_DOM = _FieldSpec("day-of-month", 1, 31, 31, {})
_MONTH = _FieldSpec("month", 1, 12, 12, _MONTHS)
_DOW = _FieldSpec("day-of-week", 0, 6, 7, _WEEKDAYS)


def _parse_value(text: str, spec: _FieldSpec) -> int:
    lowered = text.lower()
    if lowered in spec.names:
        return spec.names[lowered]
    if not (text.isascii() and text.isdigit()):
        raise ScheduleError(f"{spec.name} field: {text!r} is not a number or known name")
    value = int(text)
    if not spec.low <= value <= spec.limit:
        raise ScheduleError(
            f"{spec.name} field: value {value} out of range {spec.low}-{spec.limit}"
        )
    return value


def _parse_field(text: str, spec: _FieldSpec) -> tuple[frozenset[int], str]:
    """The field's values, and its text with names written as numbers."""
    values: set[int] = set()
    items: list[str] = []
    for item in text.split(","):
        if not item:
            raise ScheduleError(f"{spec.name} field {text!r}: empty list item")
        base, slash, step_text = item.partition("/")
        step = 1
        if slash:
            if not (step_text.isascii() and step_text.isdigit()) or int(step_text) == 0:
                raise ScheduleError(f"{spec.name} field {text!r}: step must be a positive integer")
            step = int(step_text)
        if base == "*":
            first, last = spec.low, spec.high
            numeric = "*"
        elif "-" in base:
            start, _, end = base.partition("-")
            first, last = _parse_value(start, spec), _parse_value(end, spec)
            if first > last:
                raise ScheduleError(f"{spec.name} field {text!r}: range {base!r} is backwards")
            numeric = f"{first}-{last}"
        else:
            first = _parse_value(base, spec)
            last = max(first, spec.high) if slash else first
            numeric = str(first)
        values.update(range(first, last + 1, step))
        items.append(f"{numeric}/{step}" if slash else numeric)
    return frozenset(values), ",".join(items)


def _utcoffset(moment: datetime) -> timedelta:
    offset = moment.utcoffset()
    if offset is None:  # only naive datetimes lack an offset, and callers pass aware ones
        raise ValueError(f"{moment!r} has no UTC offset")
    return offset


def _require_aware(at: datetime) -> None:
    if at.tzinfo is None or at.utcoffset() is None:
        raise ValueError(f"expected a timezone-aware datetime, got {at!r}")


def _naive_utc(at: datetime) -> datetime:
    _require_aware(at)
    return at.astimezone(UTC).replace(tzinfo=None)


@dataclass(frozen=True)
class Fields:
    """A parsed expression: each field's values, and its text with macros expanded and month
    and weekday names written as numbers (what schedulers that take numbers only accept)."""

    minutes: frozenset[int]
    hours: frozenset[int]
    doms: frozenset[int]
    months: frozenset[int]
    dows: frozenset[int]  # 0 = Sunday (a written 7 is folded into 0)
    text: tuple[str, str, str, str, str]
    either_day: bool  # both day fields restricted (neither starts with `*`): Vixie's OR rule
    follows_clock: bool  # wildcard hour: gap ticks vanish and repeated ticks run twice

    @property
    def times(self) -> tuple[int, ...]:
        """Matching local times of day as minutes since midnight, ascending."""
        return tuple(sorted(h * 60 + m for h in self.hours for m in self.minutes))


@dataclass(frozen=True)
class _Compiled:
    zone: ZoneInfo
    times: tuple[int, ...]  # matching local times of day as minutes since midnight, ascending
    doms: frozenset[int]
    months: frozenset[int]
    dows: frozenset[int]  # 0 = Sunday
    either_day: bool  # both day fields restricted: Vixie's OR rule
    follows_clock: bool  # wildcard hour: gap ticks vanish and repeated ticks run twice
    fields: Fields

    def day_matches(self, day: date) -> bool:
        dom = day.day in self.doms
        dow = day.isoweekday() % 7 in self.dows
        return (dom or dow) if self.either_day else (dom and dow)

    def days(self, start: date, step: int) -> Iterator[date]:
        """Matching days from `start` on, forward (step 1) or backward (step -1)."""
        end = start + step * _HORIZON
        day = start
        while (day <= end) if step > 0 else (day >= end):
            if day.month not in self.months:
                # Whole months are skipped at once so yearly schedules stay cheap.
                if step > 0:
                    day = (day.replace(day=1) + 32 * _DAY).replace(day=1)
                else:
                    day = day.replace(day=1) - _DAY
                continue
            if self.day_matches(day):
                yield day
            day += step * _DAY

    def steady_offset(self, day: date) -> timedelta | None:
        """The day's single UTC offset, or None when an offset change touches the day."""
        midnight = datetime.combine(day, time(), self.zone)
        edges = (midnight, midnight + _DAY)  # wall-clock arithmetic: the next local midnight
        offsets = {_utcoffset(edge.replace(fold=fold)) for edge in edges for fold in (0, 1)}
        return offsets.pop() if len(offsets) == 1 else None

    def instants(self, local: datetime) -> list[datetime]:
        """The naive UTC instants a naive local tick maps to under the DST rules."""
        first = local.replace(tzinfo=self.zone)
        before, after = _utcoffset(first), _utcoffset(first.replace(fold=1))
        if before == after:
            return [local - before]
        if before > after:  # the clock fell back: the wall time occurs twice
            return [local - before, local - after] if self.follows_clock else [local - before]
        if self.follows_clock:
            return []
        return [self.transition(local - after, local - before)]

    def transition(self, low: datetime, high: datetime) -> datetime:
        """The instant in (low, high] where the offset changes; `low` lies before the change."""
        old = self.offset_at(low)
        low_s, high_s = 0, int((high - low).total_seconds())
        # tzdata stores transitions in whole seconds, so this search lands on them exactly.
        while high_s - low_s > 1:
            mid = (low_s + high_s) // 2
            if self.offset_at(low + timedelta(seconds=mid)) == old:
                low_s = mid
            else:
                high_s = mid
        return low + timedelta(seconds=high_s)

    def offset_at(self, instant: datetime) -> timedelta:
        return _utcoffset(instant.replace(tzinfo=UTC).astimezone(self.zone))

    def first_after(self, day: date, at: datetime) -> datetime | None:
        """The day's earliest tick strictly after the naive UTC instant `at`."""
        offset = self.steady_offset(day)
        if offset is None:
            ticks = _changeover_ticks(self, day)
            index = bisect_right(ticks, at)
            return ticks[index] if index < len(ticks) else None
        wall = at + offset
        if wall.date() > day:
            return None
        # Ticks are whole minutes, so "after wall" means after wall's minute.
        index = 0 if wall.date() < day else bisect_right(self.times, wall.hour * 60 + wall.minute)
        if index == len(self.times):
            return None
        return datetime.combine(day, time()) + timedelta(minutes=self.times[index]) - offset

    def last_until(self, day: date, at: datetime) -> datetime | None:
        """The day's latest tick at or before the naive UTC instant `at`."""
        offset = self.steady_offset(day)
        if offset is None:
            ticks = _changeover_ticks(self, day)
            index = bisect_right(ticks, at)
            return ticks[index - 1] if index else None
        wall = at + offset
        if wall.date() < day:
            return None
        index = (
            len(self.times)
            if wall.date() > day
            else bisect_right(self.times, wall.hour * 60 + wall.minute)
        )
        if index == 0:
            return None
        return datetime.combine(day, time()) + timedelta(minutes=self.times[index - 1]) - offset


# Cached because such a day costs a zone lookup per candidate time, and the searches around a
# change (prev, next, is_tick, slot_for from several instances) keep coming back to it.
@functools.lru_cache(maxsize=64)
def _changeover_ticks(compiled: _Compiled, day: date) -> tuple[datetime, ...]:
    """All naive UTC ticks of a local day touched by an offset change, ascending and unique."""
    midnight = datetime.combine(day, time())
    ticks = {
        instant
        for minute in compiled.times
        for instant in compiled.instants(midnight + timedelta(minutes=minute))
    }
    return tuple(sorted(ticks))


def _compile(expr: str, tz: str) -> _Compiled:
    if not isinstance(expr, str):
        raise ScheduleError(f"cron expression must be a string, got {type(expr).__name__}")
    text = expr.strip()
    if text.startswith("@"):
        if text.lower() not in MACROS:
            known = ", ".join(MACROS)
            raise ScheduleError(f"unknown macro {text!r} (known: {known})")
        text = MACROS[text.lower()]
    fields = text.split()
    if len(fields) != 5:
        raise ScheduleError(
            "expected 5 fields (minute hour day-of-month month day-of-week), "
            f"got {len(fields)}: {expr!r}"
        )
    try:
        parsed = [
            _parse_field(text, spec)
            for text, spec in zip(fields, (_MINUTE, _HOUR, _DOM, _MONTH, _DOW), strict=True)
        ]
    except ScheduleError as exc:
        raise ScheduleError(f"invalid cron expression {expr!r}: {exc}") from None
    try:
        zone = ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError, OSError, TypeError):
        raise ScheduleError(f"unknown time zone {tz!r}") from None
    (minutes, minute), (hours, hour), (doms, dom), (months, month), (dows, dow) = parsed
    parsed_fields = Fields(
        minutes=minutes,
        hours=hours,
        doms=doms,
        months=months,
        dows=frozenset(value % 7 for value in dows),
        text=(minute, hour, dom, month, dow),
        either_day=not dom.startswith("*") and not dow.startswith("*"),
        follows_clock=hour.startswith("*"),
    )
    compiled = _Compiled(
        zone=zone,
        times=parsed_fields.times,
        doms=parsed_fields.doms,
        months=parsed_fields.months,
        dows=parsed_fields.dows,
        either_day=parsed_fields.either_day,
        follows_clock=parsed_fields.follows_clock,
        fields=parsed_fields,
    )
    first_day = next(compiled.days(_FEASIBILITY_START, 1), None)
    if first_day is None:
        raise ScheduleError(f"cron expression {expr!r} never fires (no matching day)")
    return compiled


@dataclass(frozen=True)
class Schedule:
    """A cron schedule in a time zone; equal and hashed by `expr` and `tz` alone."""

    expr: str
    tz: str = "UTC"
    _compiled: _Compiled = field(init=False, repr=False, compare=False)
    # The last [prev, next) window slot_for computed: a trigger inside it needs no search. One
    # tuple replaced whole, so concurrent readers see either the old window or the new one.
    _window: tuple[datetime, datetime] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compiled", _compile(self.expr, self.tz))

    @classmethod
    def parse(cls, expr: str, tz: str = "UTC") -> Schedule:
        """Validate and compile `expr` in zone `tz`; raises ScheduleError."""
        return cls(expr, tz)

    @property
    def fields(self) -> Fields:
        """The parsed fields (for writing the schedule out in another scheduler's syntax)."""
        return self._compiled.fields

    @property
    def zone(self) -> ZoneInfo:
        return self._compiled.zone

    def prev_tick(self, at: datetime) -> datetime:
        """The latest tick at or before `at`, in UTC."""
        moment = _naive_utc(at)
        best: datetime | None = None
        for day in self._compiled.days((moment + _MAX_SHIFT).date(), -1):
            if best is not None and datetime.combine(day, time()) + _DAY + _MAX_SHIFT <= best:
                break  # everything this day or earlier maps before `best`
            tick = self._compiled.last_until(day, moment)
            if tick is not None and (best is None or tick > best):
                best = tick
        if best is None:
            raise ScheduleError(f"{self.expr!r} has no tick within 50 years before {at}")
        return best.replace(tzinfo=UTC)

    def next_tick(self, at: datetime) -> datetime:
        """The earliest tick strictly after `at`, in UTC."""
        moment = _naive_utc(at)
        best: datetime | None = None
        for day in self._compiled.days((moment - _MAX_SHIFT).date(), 1):
            if best is not None and datetime.combine(day, time()) - _MAX_SHIFT >= best:
                break  # everything this day or later maps after `best`
            tick = self._compiled.first_after(day, moment)
            if tick is not None and (best is None or tick < best):
                best = tick
        if best is None:
            raise ScheduleError(f"{self.expr!r} has no tick within 50 years after {at}")
        return best.replace(tzinfo=UTC)

    def is_tick(self, at: datetime) -> bool:
        """Whether `at` is exactly one of the ticks."""
        return self.prev_tick(at) == at

    def slot_for(self, now: datetime, early_tolerance: float) -> datetime:
        """The tick a trigger at `now` (the database's clock) belongs to.

        That is prev_tick(now), unless next_tick(now) is at most `early_tolerance` seconds away:
        a trigger that fires slightly early because of clock skew counts for the coming tick. The
        tolerance is capped at half the gap between the two ticks, so a trigger never lands in a
        slot further away than the other one; a trigger later than the tolerance before the next
        tick (half an interval, at most) counts for that next tick.
        """
        _require_aware(now)
        window = self._window
        if window is None or not window[0] <= now < window[1]:
            window = (self.prev_tick(now), self.next_tick(now))
            object.__setattr__(self, "_window", window)
        prev, upcoming = window
        tolerance = min(max(early_tolerance, 0.0), (upcoming - prev).total_seconds() / 2)
        return upcoming if (upcoming - now).total_seconds() <= tolerance else prev


# Every instance must compute the same slots from nothing but the interval: they are counted
# from one fixed instant, the Unix epoch, so `every=300` ticks at :00, :05, :10... of each hour
# (a day is a whole number of seconds in UTC: POSIX time has no leap seconds).
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = 1_000_000


def _micros(at: datetime) -> int:
    """Microseconds from EPOCH to `at`, exactly (no float on the way)."""
    _require_aware(at)
    delta = at - EPOCH
    return (delta.days * 86400 + delta.seconds) * _US + delta.microseconds


MAX_EVERY = 366 * 86400


@dataclass(frozen=True)
class Interval:
    """Ticks every `every` seconds (a whole number, at least 1), at the multiples of `every`
    from EPOCH; equal and hashed by `every` alone. Always in UTC: an interval has no wall
    clock, so daylight saving never moves it."""

    every: int
    tz: str = field(default="UTC", init=False)

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ScheduleError(
                f"every= must be a whole number of seconds, at least 1: {self.every!r}"
            )
        if self.every > MAX_EVERY:
            # Beyond it the ticks leave the calendar datetime can hold (years 1-9999).
            raise ScheduleError(f"every= is at most {MAX_EVERY} s (a year): {self.every!r}")

    @classmethod
    def parse(cls, every: float) -> Interval:
        """Validate `every` (an int, or a float with no fraction); raises ScheduleError."""
        if isinstance(every, float) and every.is_integer():
            every = int(every)
        if isinstance(every, bool) or not isinstance(every, int):
            raise ScheduleError(f"every= must be a whole number of seconds, at least 1: {every!r}")
        return cls(every)

    @property
    def expr(self) -> str:
        """How the schedule is shown (/cron/jobs, the CLI, the OpenAPI document)."""
        return f"every {self.every}s"

    @property
    def cron(self) -> str | None:
        """The cron expression with exactly these ticks, when there is one (a whole number of
        minutes dividing an hour, or of hours dividing a day); None otherwise."""
        if self.every % 60:
            return None
        minutes = self.every // 60
        if minutes < 60 and 60 % minutes == 0:
            return "* * * * *" if minutes == 1 else f"*/{minutes} * * * *"
        if minutes % 60 == 0 and 24 % (minutes // 60) == 0:
            hours = minutes // 60
            return {1: "0 * * * *", 24: "0 0 * * *"}.get(hours, f"0 */{hours} * * *")
        return None

    def _at(self, index: int) -> datetime:
        return EPOCH + timedelta(microseconds=index * self.every * _US)

    def prev_tick(self, at: datetime) -> datetime:
        """The latest tick at or before `at`, in UTC."""
        return self._at(_micros(at) // (self.every * _US))

    def next_tick(self, at: datetime) -> datetime:
        """The earliest tick strictly after `at`, in UTC."""
        return self._at(_micros(at) // (self.every * _US) + 1)

    def is_tick(self, at: datetime) -> bool:
        """Whether `at` is exactly one of the ticks."""
        return _micros(at) % (self.every * _US) == 0

    def slot_for(self, now: datetime, early_tolerance: float) -> datetime:
        """As `Schedule.slot_for`: the previous tick, or the next one when it is at most
        `early_tolerance` seconds away (capped at half the interval)."""
        prev, upcoming = self.prev_tick(now), self.next_tick(now)
        tolerance = min(max(early_tolerance, 0.0), self.every / 2)
        return upcoming if (upcoming - now).total_seconds() <= tolerance else prev


# What a job's `schedule` is: a cron expression in a zone, or an interval.
Slots = Schedule | Interval

# How far inside its edges `slot_window` keeps: slot_for compares float seconds, this module's
# arithmetic is in microseconds, and at an edge the two could disagree by one.
_EDGE = timedelta(milliseconds=1)


def slot_window(
    schedule: Slots, slot: datetime, early_tolerance: float
) -> tuple[datetime, datetime]:
    """[start, end): instants `now` for which `schedule.slot_for(now, early_tolerance)` is
    `slot` (one of its ticks), a millisecond short of each edge: whoever checks a clock against
    it (the trigger's one-round-trip probe, cronlock/core/runner.py) leaves the edges to
    slot_for."""
    before = schedule.prev_tick(slot - timedelta(microseconds=1))
    after = schedule.next_tick(slot)
    tolerance = max(early_tolerance, 0.0)  # capped in seconds first: it may be infinite
    start = slot - timedelta(seconds=min(tolerance, (slot - before).total_seconds() / 2))
    end = after - timedelta(seconds=min(tolerance, (after - slot).total_seconds() / 2))
    return start + _EDGE, end - _EDGE
