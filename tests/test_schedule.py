"""Tests for app.schedule: parsing, day rules, tick search, slot_for and daylight saving."""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from cronlock.core.schedule import Interval, Schedule, ScheduleError, Slots, slot_window

MINUTE = timedelta(minutes=1)
BERLIN = ZoneInfo("Europe/Berlin")
NEW_YORK = ZoneInfo("America/New_York")


def utc(
    year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0
) -> datetime:
    return datetime(year, month, day, hour, minute, second, tzinfo=UTC)


def upcoming(expr: str, start: datetime, count: int, tz: str = "UTC") -> list[datetime]:
    schedule = Schedule.parse(expr, tz)
    ticks = []
    for _ in range(count):
        start = schedule.next_tick(start)
        ticks.append(start)
    return ticks


def ticks_between(schedule: Schedule, start: datetime, end: datetime) -> list[datetime]:
    """Ticks in [start, end), found with next_tick."""
    ticks = []
    tick = schedule.next_tick(start - timedelta(microseconds=1))
    while tick < end:
        ticks.append(tick)
        tick = schedule.next_tick(tick)
    return ticks


def walls(ticks: list[datetime], zone: ZoneInfo) -> list[str]:
    return [tick.astimezone(zone).strftime("%H:%M%z") for tick in ticks]


# --- parsing -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "start", "expected"),
    [
        ("*/15 * * * *", utc(2024, 1, 1), [utc(2024, 1, 1, 0, 15), utc(2024, 1, 1, 0, 30)]),
        ("5-10/2 * * * *", utc(2024, 1, 1), [utc(2024, 1, 1, 0, m) for m in (5, 7, 9)]),
        (
            "10/20 * * * *",
            utc(2024, 1, 1),
            [
                utc(2024, 1, 1, 0, 10),
                utc(2024, 1, 1, 0, 30),
                utc(2024, 1, 1, 0, 50),
                utc(2024, 1, 1, 1, 10),
            ],
        ),
        ("1,2,58 * * * *", utc(2024, 1, 1), [utc(2024, 1, 1, 0, m) for m in (1, 2, 58)]),
        (
            "0 9-17/4 * * *",
            utc(2024, 1, 1),
            [utc(2024, 1, 1, h) for h in (9, 13, 17)] + [utc(2024, 1, 2, 9)],
        ),
        ("0 0 1 FEB,mar *", utc(2024, 1, 1), [utc(2024, 2, 1), utc(2024, 3, 1), utc(2025, 2, 1)]),
        ("0 0 1 2-3 *", utc(2024, 1, 1), [utc(2024, 2, 1), utc(2024, 3, 1), utc(2025, 2, 1)]),
        # 2024-01-05 is a Friday.
        ("0 0 * * MON-fri", utc(2024, 1, 5, 12), [utc(2024, 1, d) for d in (8, 9, 10, 11, 12, 15)]),
        ("0 0 * * 7", utc(2024, 1, 1), [utc(2024, 1, 7), utc(2024, 1, 14)]),
        ("0 0 * * 0", utc(2024, 1, 1), [utc(2024, 1, 7), utc(2024, 1, 14)]),
        ("0 0 * * Sun", utc(2024, 1, 1), [utc(2024, 1, 7), utc(2024, 1, 14)]),
        ("0 0 * * 5-7", utc(2024, 1, 1), [utc(2024, 1, d) for d in (5, 6, 7, 12)]),
        # `a/n` in day-of-week stops at Saturday: Sunday (7) is not reached twice.
        ("0 0 * * 1/2", utc(2024, 1, 1), [utc(2024, 1, d) for d in (3, 5, 8, 10)]),
        ("0 0 * * sat/1", utc(2024, 1, 1), [utc(2024, 1, 6), utc(2024, 1, 13)]),
        (" 0\t0  * * * ", utc(2024, 1, 1), [utc(2024, 1, 2), utc(2024, 1, 3)]),
        ("07 08 * * *", utc(2024, 1, 1), [utc(2024, 1, 1, 8, 7), utc(2024, 1, 2, 8, 7)]),
    ],
)
def test_syntax_forms(expr: str, start: datetime, expected: list[datetime]) -> None:
    assert upcoming(expr, start, len(expected)) == expected


@pytest.mark.parametrize(
    ("macro", "expansion"),
    [
        ("@hourly", "0 * * * *"),
        ("@daily", "0 0 * * *"),
        ("@midnight", "0 0 * * *"),
        ("@weekly", "0 0 * * 0"),
        ("@monthly", "0 0 1 * *"),
        ("@yearly", "0 0 1 1 *"),
        ("@ANNUALLY", "0 0 1 1 *"),
    ],
)
def test_macros(macro: str, expansion: str) -> None:
    start = utc(2024, 2, 27, 13, 7)
    assert upcoming(macro, start, 5, "Europe/Berlin") == upcoming(
        expansion, start, 5, "Europe/Berlin"
    )


@pytest.mark.parametrize(
    ("expr", "tz", "message"),
    [
        ("* * * * * *", "UTC", "expected 5 fields"),
        ("* * * *", "UTC", "expected 5 fields"),
        ("", "UTC", "expected 5 fields"),
        ("60 * * * *", "UTC", "invalid cron expression '60 * * * *': minute field: value 60 out"),
        ("* 24 * * *", "UTC", "hour field: value 24 out of range 0-23"),
        ("* * 0 * *", "UTC", "day-of-month field: value 0 out of range 1-31"),
        ("* * 32 * *", "UTC", "day-of-month field: value 32 out of range 1-31"),
        ("* * * 13 *", "UTC", "month field: value 13 out of range 1-12"),
        ("* * * * 8", "UTC", "day-of-week field: value 8 out of range 0-7"),
        ("1,,2 * * * *", "UTC", "empty list item"),
        ("1, * * * *", "UTC", "empty list item"),
        ("*/0 * * * *", "UTC", "step must be a positive integer"),
        ("*/ * * * *", "UTC", "step must be a positive integer"),
        ("*/x * * * *", "UTC", "step must be a positive integer"),
        ("5-1 * * * *", "UTC", "range '5-1' is backwards"),
        ("-5 * * * *", "UTC", "'' is not a number"),
        ("jan * * * *", "UTC", "minute field: 'jan' is not a number or known name"),
        ("* * * foo *", "UTC", "month field: 'foo'"),
        ("* * * * mon-sun", "UTC", "backwards"),
        ("@reboot", "UTC", "unknown macro '@reboot'"),
        ("0 0 30 2 *", "UTC", "never fires"),
        ("0 0 31 4,6,9,11 *", "UTC", "never fires"),
        ("* * * * *", "Mars/Olympus", "unknown time zone 'Mars/Olympus'"),
        ("* * * * *", "", "unknown time zone"),
        ("* * * * *", "../etc/passwd", "unknown time zone"),
    ],
)
def test_parse_errors(expr: str, tz: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message.replace("*", r"\*")):
        Schedule.parse(expr, tz)


def test_schedule_error_is_value_error_and_constructor_validates() -> None:
    assert issubclass(ScheduleError, ValueError)
    with pytest.raises(ScheduleError):
        Schedule("0 0 30 2 *")


def test_feb_29_only_schedule_is_valid() -> None:
    assert Schedule.parse("0 0 29 2 *").next_tick(utc(2024, 3, 1)) == utc(2028, 2, 29)


def test_equality_hash_and_frozen() -> None:
    first, second = Schedule.parse("*/5 * * * *"), Schedule("*/5 * * * *", "UTC")
    first.slot_for(utc(2024, 1, 1, 0, 2), 10)  # fills the cache on one of them only
    assert first == second
    assert hash(first) == hash(second)
    assert len({first, second}) == 1
    assert first != Schedule("*/5 * * * *", "Europe/Berlin")
    assert repr(first) == "Schedule(expr='*/5 * * * *', tz='UTC')"
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.expr = "* * * * *"  # type: ignore[misc]


def test_naive_datetimes_are_rejected() -> None:
    schedule = Schedule.parse("* * * * *")
    for method in (schedule.prev_tick, schedule.next_tick, schedule.is_tick):
        with pytest.raises(ValueError, match="timezone-aware"):
            method(datetime(2024, 1, 1))
    with pytest.raises(ValueError, match="timezone-aware"):
        schedule.slot_for(datetime(2024, 1, 1), 1.0)


# --- day rules -----------------------------------------------------------------------------------


def midnights(predicate: Callable[[date], bool], start: date, days: int) -> list[datetime]:
    matching = (start + timedelta(days=n) for n in range(1, days))
    return [utc(d.year, d.month, d.day) for d in matching if predicate(d)]


def test_dom_and_dow_both_restricted_match_either() -> None:
    expected = midnights(lambda d: d.day == 13 or d.weekday() == 4, date(2024, 9, 1), 61)
    assert upcoming("0 0 13 * fri", utc(2024, 9, 1), len(expected)) == expected
    assert utc(2024, 9, 13) in expected  # Friday the 13th runs once
    assert utc(2024, 10, 13) in expected  # a Sunday, via day-of-month


def test_star_prefixed_day_field_means_both_must_match() -> None:
    # `*/13` is 1, 14, 27; it starts with `*`, so Vixie cron requires the weekday as well.
    expected = midnights(lambda d: d.day in (1, 14, 27) and d.weekday() == 4, date(2024, 1, 1), 800)
    assert upcoming("0 0 */13 * fri", utc(2024, 1, 1), len(expected)) == expected
    assert upcoming("0 0 13 * *", utc(2024, 9, 1), 2) == [utc(2024, 9, 13), utc(2024, 10, 13)]
    assert upcoming("0 0 * * fri", utc(2024, 9, 1), 2) == [utc(2024, 9, 6), utc(2024, 9, 13)]


# --- prev / next / is_tick -----------------------------------------------------------------------


def test_month_and_year_ends_and_leap_days() -> None:
    leap = Schedule.parse("0 0 29 2 *")
    assert leap.next_tick(utc(2024, 2, 29)) == utc(2028, 2, 29)
    assert leap.prev_tick(utc(2024, 3, 1)) == utc(2024, 2, 29)
    assert leap.prev_tick(utc(2024, 2, 29)) == utc(2024, 2, 29)
    assert leap.prev_tick(utc(2024, 2, 28, 23, 59)) == utc(2020, 2, 29)
    assert leap.next_tick(utc(2096, 3, 1)) == utc(2104, 2, 29)  # 2100 is not a leap year

    new_year = Schedule.parse("59 23 31 12 *")
    assert new_year.next_tick(utc(2024, 6, 1)) == utc(2024, 12, 31, 23, 59)
    assert new_year.next_tick(utc(2024, 12, 31, 23, 59)) == utc(2025, 12, 31, 23, 59)
    assert new_year.prev_tick(utc(2025, 1, 1)) == utc(2024, 12, 31, 23, 59)

    assert upcoming("0 0 31 * *", utc(2024, 1, 31), 3) == [
        utc(2024, 3, 31),
        utc(2024, 5, 31),
        utc(2024, 7, 31),
    ]
    monthly = Schedule.parse("0 12 1 * *", "Europe/Berlin")
    assert monthly.prev_tick(utc(2025, 1, 1, 10)) == utc(2024, 12, 1, 11)
    assert monthly.next_tick(utc(2025, 1, 1, 10)) == utc(2025, 1, 1, 11)
    assert monthly.next_tick(utc(2024, 12, 31, 12)).tzinfo is UTC


def test_is_tick() -> None:
    schedule = Schedule.parse("*/15 * * * *")
    assert schedule.is_tick(utc(2024, 5, 5, 12, 15))
    assert schedule.is_tick(utc(2024, 5, 5, 12, 15).astimezone(NEW_YORK))
    assert not schedule.is_tick(utc(2024, 5, 5, 12, 15) + timedelta(microseconds=1))
    assert not schedule.is_tick(utc(2024, 5, 5, 12, 16))


def test_yearly_schedule_is_fast() -> None:
    schedule = Schedule.parse("0 0 1 1 *", "Europe/Berlin")
    at = utc(2024, 1, 2)
    started = time.perf_counter()
    for day in range(0, 365 * 4, 15):
        moment = at + timedelta(days=day)
        schedule.prev_tick(moment)
        schedule.next_tick(moment)
    average = (time.perf_counter() - started) / (2 * len(range(0, 365 * 4, 15)))
    assert average < 0.002


# --- slot_for ------------------------------------------------------------------------------------


def test_slot_for_early_tolerance() -> None:
    schedule = Schedule.parse("*/5 * * * *")
    assert schedule.slot_for(utc(2024, 1, 1, 12, 4, 55), 10) == utc(2024, 1, 1, 12, 5)
    assert schedule.slot_for(utc(2024, 1, 1, 12, 4, 50), 10) == utc(2024, 1, 1, 12, 5)
    assert schedule.slot_for(utc(2024, 1, 1, 12, 4, 45), 10) == utc(2024, 1, 1, 12)
    assert schedule.slot_for(utc(2024, 1, 1, 12, 5), 10) == utc(2024, 1, 1, 12, 5)
    assert schedule.slot_for(utc(2024, 1, 1, 12, 5, 3), 10) == utc(2024, 1, 1, 12, 5)
    assert schedule.slot_for(utc(2024, 1, 1, 12, 4, 59), 0) == utc(2024, 1, 1, 12)
    assert schedule.slot_for(utc(2024, 1, 1, 12, 4, 59), -5) == utc(2024, 1, 1, 12)
    in_berlin = utc(2024, 1, 1, 12, 4, 58).astimezone(BERLIN)
    assert schedule.slot_for(in_berlin, 10) == utc(2024, 1, 1, 12, 5)


def test_slot_for_tolerance_is_capped_at_half_the_interval() -> None:
    schedule = Schedule.parse("* * * * *")
    # 45 s behaves as 30 s: 29 s early is too early to count for the coming minute.
    assert schedule.slot_for(utc(2024, 1, 1, 12, 0, 31), 45) == utc(2024, 1, 1, 12, 1)
    assert schedule.slot_for(utc(2024, 1, 1, 12, 0, 30), 45) == utc(2024, 1, 1, 12, 1)
    assert schedule.slot_for(utc(2024, 1, 1, 12, 0, 29), 45) == utc(2024, 1, 1, 12)
    assert schedule.slot_for(utc(2024, 1, 1, 12, 0, 20), 1e9) == utc(2024, 1, 1, 12)


@pytest.mark.parametrize(
    "schedule",
    [
        Schedule.parse("*/5 * * * *"),
        Schedule.parse("0 7 * * 1-5", "Europe/Berlin"),
        Schedule.parse("30 2 * * *", "Europe/Berlin"),  # the spring gap and the autumn repeat
        Schedule.parse("15,17 * * * *"),  # uneven gaps: the tolerance capped on one side only
        Interval(90),
    ],
    ids=str,
)
@pytest.mark.parametrize("tolerance", [0.0, 10.0, 1e9, math.inf])
def test_slot_window_is_where_slot_for_gives_the_slot(schedule: Slots, tolerance: float) -> None:
    """Inside the window slot_for gives the slot; a little outside it gives another: the
    trigger's one-round-trip probe (cronlock/core/runner.py) relies on both."""
    rnd = random.Random(11)
    edge = timedelta(milliseconds=2)
    for start in [utc(2027, 3, 27), utc(2027, 10, 30), utc(2026, 12, 4, 13)]:
        slot = schedule.next_tick(start)
        for _ in range(40):
            low, high = slot_window(schedule, slot, tolerance)
            assert low <= slot + timedelta(milliseconds=1)
            assert slot < high
            span = (high - low).total_seconds()
            inside = [low, high - timedelta(microseconds=1)]
            inside += [low + timedelta(seconds=rnd.uniform(0, span)) for _ in range(5)]
            for at in inside:
                assert schedule.slot_for(at, tolerance) == slot, (slot, at)
            for at in (low - edge, high + edge):
                assert schedule.slot_for(at, tolerance) != slot, (slot, at)
            slot = schedule.next_tick(slot + timedelta(seconds=rnd.uniform(0, 4000)))


def test_slot_for_reuses_the_last_window(monkeypatch: pytest.MonkeyPatch) -> None:
    searches: list[datetime] = []
    original = Schedule.prev_tick

    def counting_prev_tick(self: Schedule, at: datetime) -> datetime:
        searches.append(at)
        return original(self, at)

    monkeypatch.setattr(Schedule, "prev_tick", counting_prev_tick)
    schedule = Schedule.parse("*/5 * * * *")
    for second in range(0, 300, 7):
        schedule.slot_for(utc(2024, 1, 1, 12) + timedelta(seconds=second), 10)
    assert len(searches) == 1
    assert schedule.slot_for(utc(2024, 1, 1, 12, 5), 10) == utc(2024, 1, 1, 12, 5)
    assert len(searches) == 2
    assert schedule.slot_for(utc(2024, 1, 1, 11, 59), 10) == utc(2024, 1, 1, 11, 55)
    assert len(searches) == 3


# --- daylight saving -----------------------------------------------------------------------------


def test_fixed_hour_job_in_berlin() -> None:
    schedule = Schedule.parse("30 2 * * *", "Europe/Berlin")
    # 2024-03-31: 02:00 CET jumps to 03:00 CEST at 01:00 UTC; 02:30 runs once, at the change.
    spring = ticks_between(schedule, utc(2024, 3, 30), utc(2024, 4, 2))
    assert spring == [utc(2024, 3, 30, 1, 30), utc(2024, 3, 31, 1), utc(2024, 4, 1, 0, 30)]
    assert schedule.is_tick(utc(2024, 3, 31, 1))
    assert not schedule.is_tick(utc(2024, 3, 31, 1, 30))
    # 2024-10-27: 03:00 CEST falls back to 02:00 CET at 01:00 UTC; 02:30 runs the first time only.
    autumn = ticks_between(schedule, utc(2024, 10, 26), utc(2024, 10, 29))
    assert autumn == [utc(2024, 10, 26, 0, 30), utc(2024, 10, 27, 0, 30), utc(2024, 10, 28, 1, 30)]
    assert not schedule.is_tick(utc(2024, 10, 27, 1, 30))


def test_gap_ticks_collapse_into_the_transition_instant() -> None:
    schedule = Schedule.parse("*/20 2 * * *", "Europe/Berlin")
    ticks = ticks_between(schedule, utc(2024, 3, 30, 12), utc(2024, 4, 1, 12))
    assert ticks == [utc(2024, 3, 31, 1)] + [utc(2024, 4, 1, 0, m) for m in (0, 20, 40)]
    # 02:00, 02:30 and the real 03:00 are one instant: ticks are a set.
    merged = Schedule.parse("0,30 2,3 * * *", "Europe/Berlin")
    ticks = ticks_between(merged, utc(2024, 3, 31), utc(2024, 3, 31, 3))
    assert walls(ticks, BERLIN) == ["03:00+0200", "03:30+0200"]


def test_fixed_hour_job_in_new_york() -> None:
    schedule = Schedule.parse("30 2 * * *", "America/New_York")
    # 2024-03-10: 02:00 EST jumps to 03:00 EDT at 07:00 UTC.
    spring = ticks_between(schedule, utc(2024, 3, 9), utc(2024, 3, 12))
    assert spring == [utc(2024, 3, 9, 7, 30), utc(2024, 3, 10, 7), utc(2024, 3, 11, 6, 30)]
    # 2024-11-03: 02:00 EDT falls back to 01:00 EST at 06:00 UTC, so 01:xx happens twice.
    autumn = ticks_between(schedule, utc(2024, 11, 2), utc(2024, 11, 5))
    assert autumn == [utc(2024, 11, 2, 6, 30), utc(2024, 11, 3, 7, 30), utc(2024, 11, 4, 7, 30)]
    repeated = Schedule.parse("30 1 * * *", "America/New_York")
    autumn = ticks_between(repeated, utc(2024, 11, 2), utc(2024, 11, 5))
    assert autumn == [utc(2024, 11, 2, 5, 30), utc(2024, 11, 3, 5, 30), utc(2024, 11, 4, 6, 30)]
    assert not repeated.is_tick(utc(2024, 11, 3, 6, 30))


@pytest.mark.parametrize(
    ("zone", "gap_day", "fold_day", "fold_hour"),
    [
        (BERLIN, date(2024, 3, 31), date(2024, 10, 27), 2),
        (NEW_YORK, date(2024, 3, 10), date(2024, 11, 3), 1),
    ],
)
def test_wildcard_hour_job_follows_the_clock(
    zone: ZoneInfo, gap_day: date, fold_day: date, fold_hour: int
) -> None:
    schedule = Schedule.parse("*/15 * * * *", zone.key)

    def local_ticks(day: date, first_hour: int, last_hour: int) -> list[str]:
        start = datetime(day.year, day.month, day.day, first_hour, tzinfo=zone)
        end = datetime(day.year, day.month, day.day, last_hour, tzinfo=zone)
        return [t.astimezone(zone).strftime("%H:%M") for t in ticks_between(schedule, start, end)]

    spring = local_ticks(gap_day, 1, 4)
    assert spring == ["01:00", "01:15", "01:30", "01:45", "03:00", "03:15", "03:30", "03:45"]
    autumn = local_ticks(fold_day, fold_hour - 1, fold_hour + 2)
    hours = [f"{h:02}:{m:02}" for h in range(fold_hour - 1, fold_hour + 2) for m in (0, 15, 30, 45)]
    assert autumn == hours[:8] + hours[4:]  # the repeated hour ticks twice


Predicate = Callable[[datetime], bool]

BRUTE_FORCE_SCHEDULES: list[tuple[str, Predicate]] = [
    ("*/15 * * * *", lambda wall: wall.minute % 15 == 0),
    ("10 */2 * * *", lambda wall: wall.minute == 10 and wall.hour % 2 == 0),
    ("30 2 * * *", lambda wall: (wall.hour, wall.minute) == (2, 30)),
    ("*/20 0-3,23 * * *", lambda wall: wall.minute % 20 == 0 and wall.hour in (0, 1, 2, 3, 23)),
    ("15,45 1 * * *", lambda wall: wall.minute in (15, 45) and wall.hour == 1),
]


def brute_force_ticks(
    predicate: Predicate, zone: ZoneInfo, follows_clock: bool, start: datetime, end: datetime
) -> list[datetime]:
    """The tick set straight from the definitions, walking UTC minute by minute.

    Following the clock, a minute ticks when its wall time matches. Otherwise a matching wall time
    ticks at the first instant the clock reads it or later: once for a repeated time, and at the
    change for a skipped one.
    """
    ticks = []
    highest = (start - MINUTE).astimezone(zone).replace(tzinfo=None)
    moment = start
    while moment < end:
        wall = moment.astimezone(zone).replace(tzinfo=None)
        if follows_clock:
            hit = predicate(wall)
        else:
            newly_reached = (highest + MINUTE * n for n in range(1, (wall - highest) // MINUTE + 1))
            hit = any(predicate(reached) for reached in newly_reached)
            highest = max(highest, wall)
        if hit:
            ticks.append(moment)
        moment += MINUTE
    return ticks


@pytest.mark.parametrize(
    ("zone", "day"),
    [
        (BERLIN, date(2024, 3, 31)),
        (BERLIN, date(2024, 10, 27)),
        (NEW_YORK, date(2024, 3, 10)),
        (NEW_YORK, date(2024, 11, 3)),
        # Changes at midnight: the repeated hour belongs to the previous day.
        (ZoneInfo("America/Santiago"), date(2024, 4, 7)),
        (ZoneInfo("America/Santiago"), date(2024, 9, 8)),
        # Half-hour daylight saving.
        (ZoneInfo("Australia/Lord_Howe"), date(2024, 4, 7)),
        (ZoneInfo("Australia/Lord_Howe"), date(2024, 10, 6)),
    ],
)
def test_matches_brute_force_around_changes(zone: ZoneInfo, day: date) -> None:
    start = utc(day.year, day.month, day.day) - timedelta(days=1, hours=12)
    end = start + timedelta(days=3)
    for expr, predicate in BRUTE_FORCE_SCHEDULES:
        schedule = Schedule.parse(expr, zone.key)
        expected = brute_force_ticks(predicate, zone, expr.split()[1].startswith("*"), start, end)
        assert ticks_between(schedule, start, end) == expected, expr
        backwards = []
        tick = schedule.prev_tick(end - timedelta(microseconds=1))
        while tick >= start:
            backwards.append(tick)
            tick = schedule.prev_tick(tick - timedelta(microseconds=1))
        assert backwards[::-1] == expected, expr


# --- properties ----------------------------------------------------------------------------------

PROPERTY_SCHEDULES = [
    ("*/7 * * * *", "UTC"),
    ("30 2 * * *", "Europe/Berlin"),
    ("*/15 * * * *", "America/New_York"),
    ("15 1 * * sun", "America/New_York"),
    ("0 0 13 * fri", "Australia/Lord_Howe"),
    ("45 */2 * * 1-5", "America/Santiago"),
    ("0 0 29 2 *", "Europe/Berlin"),
    ("@monthly", "Asia/Kolkata"),
]


@pytest.mark.parametrize(("expr", "tz"), PROPERTY_SCHEDULES)
def test_prev_and_next_bracket_every_instant(expr: str, tz: str) -> None:
    schedule = Schedule.parse(expr, tz)
    rng = random.Random(f"{expr}|{tz}")
    span = int((utc(2026, 1, 1) - utc(2023, 1, 1)).total_seconds())
    # Plain random instants rarely land next to a change, so half of them are drawn from the
    # hours around the 2024 changes.
    changes = [utc(2024, 3, 31, 1), utc(2024, 10, 27, 1), utc(2024, 3, 10, 7), utc(2024, 11, 3, 6)]
    changes += [utc(2024, 4, 7, 3), utc(2024, 9, 8, 4), utc(2024, 4, 6, 15), utc(2024, 10, 5, 15)]
    for n in range(120):
        if n % 2:
            at = utc(2023, 1, 1) + timedelta(seconds=rng.randrange(span))
        else:
            at = rng.choice(changes) + timedelta(seconds=rng.randrange(-3 * 3600, 3 * 3600, 60))
        prev, upcoming_tick = schedule.prev_tick(at), schedule.next_tick(at)
        assert prev <= at < upcoming_tick
        assert schedule.is_tick(prev)
        assert schedule.is_tick(upcoming_tick)
        assert schedule.next_tick(prev) == upcoming_tick  # nothing lies strictly between
        assert schedule.prev_tick(upcoming_tick) == upcoming_tick
        assert schedule.prev_tick(upcoming_tick - timedelta(microseconds=1)) == prev
        assert schedule.is_tick(at) == (prev == at)
        assert prev.tzinfo is UTC
        assert upcoming_tick.tzinfo is UTC


# --- interval schedules (every=) ---------------------------------------------------------------


def test_interval_ticks_are_multiples_from_the_unix_epoch() -> None:
    """Every instance computes the same slots: multiples of the interval from 1970-01-01 UTC."""
    from cronlock.core.schedule import EPOCH, Interval

    every = Interval.parse(30)
    at = utc(2026, 3, 29, 1, 0, 17)  # Berlin's spring-forward hour: no effect on intervals
    assert every.prev_tick(at) == utc(2026, 3, 29, 1, 0, 0)
    assert every.next_tick(at) == utc(2026, 3, 29, 1, 0, 30)
    assert every.prev_tick(utc(2026, 1, 1, 0, 0, 30)) == utc(2026, 1, 1, 0, 0, 30)  # at a tick
    assert every.next_tick(utc(2026, 1, 1, 0, 0, 30)) == utc(2026, 1, 1, 0, 1, 0)
    assert every.is_tick(utc(2026, 1, 1, 0, 0, 30))
    assert not every.is_tick(at)
    assert Interval.parse(7).prev_tick(EPOCH + timedelta(seconds=20)) == EPOCH + timedelta(
        seconds=14
    )
    # Sub-second instants: exact integer arithmetic, no float rounding at the edge.
    edge = utc(2026, 1, 1, 0, 0, 30) - timedelta(microseconds=1)
    assert every.prev_tick(edge) == utc(2026, 1, 1)
    assert Interval.parse(30.0) == every
    assert every.expr == "every 30s"
    assert every.tz == "UTC"
    # At most a year: beyond, ticks leave what datetime holds (an OverflowError at the first
    # tick, in the scheduler's loop, rather than a refused declaration).
    year = Interval.parse(366 * 86400)
    assert year.next_tick(utc(2026, 6, 1)) > utc(2026, 6, 1)
    with pytest.raises(ScheduleError, match="at most"):
        Interval.parse(10**12)


def test_interval_slot_for_caps_the_early_tolerance_at_half_the_interval() -> None:
    from cronlock.core.schedule import Interval

    every = Interval.parse(10)
    tick = utc(2026, 1, 1, 0, 0, 10)
    assert every.slot_for(tick - timedelta(seconds=4), 5.0) == tick  # early, within tolerance
    assert every.slot_for(tick - timedelta(seconds=6), 5.0) == tick - timedelta(seconds=10)
    assert every.slot_for(tick + timedelta(seconds=4), 60.0) == tick  # capped at 5 s


@pytest.mark.parametrize(
    ("every", "cron"),
    [
        (60, "* * * * *"),
        (300, "*/5 * * * *"),
        (3600, "0 * * * *"),
        (7200, "0 */2 * * *"),
        (30, None),
        (420, None),
        (5 * 3600, None),
        (86400, "0 0 * * *"),
        (2 * 86400, None),
    ],
)
def test_interval_cron_form_only_when_exact(every: int, cron: str | None) -> None:
    from cronlock.core.schedule import Interval

    interval = Interval.parse(every)
    assert interval.cron == cron
    if cron is not None:  # the same ticks over a day
        schedule, at = Schedule.parse(cron), utc(2026, 5, 1)
        for _ in range(50):
            assert schedule.next_tick(at) == interval.next_tick(at)
            at = interval.next_tick(at)


@pytest.mark.parametrize("every", [0, -5, 1.5, True, "30"])
def test_interval_refuses_what_is_not_whole_seconds(every: object) -> None:
    from cronlock.core.schedule import Interval

    with pytest.raises(ScheduleError, match="whole number of seconds"):
        Interval.parse(every)  # type: ignore[arg-type]


def test_job_every_declaration() -> None:
    from cronlock.core.jobs import JobContext, job
    from cronlock.errors import JobDefinitionError

    async def noop(ctx: JobContext) -> None:
        return None

    with pytest.raises(JobDefinitionError, match="not both"):
        job("both-kinds", schedule="* * * * *", every=30)(noop)
    with pytest.raises(JobDefinitionError, match="drop tz"):
        job("zoned-interval", every=30, tz="Europe/Berlin")(noop)
    with pytest.raises(JobDefinitionError, match="whole number"):
        job("half-second", every=0.5)(noop)
    for tolerance in (-1.0, float("nan")):  # NaN would pass `< 0`
        with pytest.raises(JobDefinitionError, match="tolerances must be positive"):
            job("odd-tolerance", schedule="* * * * *", early_tolerance=tolerance)(noop)
