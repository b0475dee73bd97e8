"""cronlock.core.schedule against cronsim (Healthchecks.io's cron parser, Debian cron's semantics):
seeded random expressions in random time zones, the next fire times compared one by one.

A difference fails the test unless it is one of these, each recognised precisely (the reasons
are in docs/schedules.md too):

- `RANGE_STEP`, cronsim is wrong: it reads a one-element range with a step (`2-2/3`) as a start
  value (`2/3`: 2, 5, 8...). Debian's cron and cronlock read it as the range: 2 alone.
- `SUB_HOUR_SHIFT`, cronsim is wrong: where the clock moves by half an hour (Australia/Lord_Howe),
  a job with a `*` in its minute or hour field misses the top of the first matching hour after the
  change (`0 */2 * * *` skips 02:00+10:30): cronsim steps hours by 3600 s of real time, which
  lands on :30 there.
- `MIDNIGHT_LOOP`, cronsim is wrong: where the clock goes back over local midnight (America/
  St_Johns until 2011, which changed at 00:01), a job with a `*` in its minute or hour field never
  gets its next time: cronsim loops for ever between the two days. Such windows are not handed
  to it at all.
- `WEEKDAY_START_STEP`, an extension the two define differently: `a/n` in the day-of-week field
  (`3/1`) is not in Debian's crontab(5) (steps follow a range or `*`). cronsim runs it up to 7
  (Sunday, again); cronlock up to 6, so Sunday is never counted twice.
- `FIXED_HOUR`, cronlock's documented rule: a job whose hour field does not start with `*` runs
  once at each of its times of day, however the clock moves (a tick in the skipped hour runs at
  the change, a repeated one once). Debian's cron (and cronsim) make that exception only when the
  minute field does not start with `*` either, so `*/15 2 * * *` differs around a change.
"""

from __future__ import annotations

import functools
import random
import subprocess
import sys
import time
from collections import Counter
from datetime import UTC, date, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from cronsim import CronSim

from cronlock.core.schedule import Schedule, ScheduleError

# A differential test: tests/test_schedule.py covers every line it reaches, and measuring
# 32,000 next-time computations would double its time.
pytestmark = pytest.mark.no_cover

SEED = 20261202
EXPRESSIONS = 4000
TICKS = 8
ZONES = [
    "UTC",
    "Europe/Berlin",
    "Europe/London",
    "Europe/Dublin",  # negative DST in tzdata: winter is the "summer" offset
    "America/New_York",
    "America/St_Johns",  # half-hour offset, whole-hour DST
    "America/Santiago",  # changes at midnight
    "America/Havana",  # changes at midnight and 01:00
    "America/Sao_Paulo",  # DST until 2019
    "Australia/Adelaide",
    "Australia/Lord_Howe",  # a DST shift of 30 minutes
    "Pacific/Chatham",  # +12:45 / +13:45
    "Pacific/Apia",  # skipped a whole day in 2011
    "Asia/Kolkata",
    "Asia/Kathmandu",
    "Asia/Tehran",
    "Asia/Gaza",
    "Africa/Casablanca",  # DST suspended every Ramadan
]
MONTHS = ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"]
WEEKDAYS = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"]
# (first, last, names) of minute, hour, day-of-month, month, day-of-week.
FIELDS = [(0, 59, []), (0, 23, []), (1, 31, []), (1, 12, MONTHS), (0, 7, WEEKDAYS)]

RANGE_STEP = "cronsim reads a one-element range with a step (2-2/3) as 2/3"
SUB_HOUR_SHIFT = "cronsim steps hours by 3600 s, which lands on :30 after a half-hour shift"
WEEKDAY_START_STEP = "a/n in day-of-week: cronsim runs it up to 7 (Sunday), cronlock up to 6"
MIDNIGHT_LOOP = "cronsim loops for ever where the clock goes back over local midnight"
FIXED_HOUR = "cronlock runs a fixed-hour job once per time of day even with a * minute field"


def _value(rng: random.Random, low: int, high: int, names: list[str]) -> tuple[int, str]:
    number = rng.randint(low, high)
    if names and number - low < len(names) and rng.random() < 0.3:
        name = names[number - low]
        return number, rng.choice([name, name.upper(), name.title()])
    return number, str(number)


def _item(rng: random.Random, low: int, high: int, names: list[str]) -> str:
    kind = rng.random()
    step = rng.randint(1, high - low + 1)
    if kind < 0.2:
        return "*"
    if kind < 0.35:
        return f"*/{step}"
    first, first_text = _value(rng, low, high, names)
    if kind < 0.6:
        return first_text
    if kind < 0.9:
        _, last_text = _value(rng, first, high, names)
        return f"{first_text}-{last_text}" + (f"/{step}" if kind >= 0.8 else "")
    return f"{first_text}/{step}"


def random_expression(rng: random.Random) -> str:
    fields = []
    for index, (low, high, names) in enumerate(FIELDS):
        if index < 2 and rng.random() < 0.5:
            fields.append(str(rng.randint(low, high)))  # a time of day, as most jobs have
        elif index >= 2 and rng.random() < 0.5:
            fields.append("*")
        else:
            count = rng.choice([1, 1, 1, 2, 3])
            fields.append(",".join(_item(rng, low, high, names) for _ in range(count)))
    return " ".join(fields)


def ours(schedule: Schedule, start: datetime) -> list[datetime]:
    ticks, at = [], start
    for _ in range(TICKS):
        at = schedule.next_tick(at)
        ticks.append(at)
    return ticks


def theirs(expr: str, tz: str, start: datetime) -> list[datetime]:
    found = CronSim(expr, start.astimezone(ZoneInfo(tz)))
    return [next(found).astimezone(UTC) for _ in range(TICKS)]


def parsed_alike(expr: str, schedule: Schedule) -> bool:
    """Whether cronsim reads every field as the same set of values."""
    sim = CronSim(expr, datetime(2026, 1, 1, tzinfo=UTC))
    fields = schedule.fields
    weekdays = {day % 7 for day in sim.weekdays if isinstance(day, int)}
    theirs = [sim.minutes, sim.hours, sim.days, sim.months, weekdays]
    mine = [fields.minutes, fields.hours, fields.doms, fields.months, fields.dows]
    return all(set(a) == set(b) for a, b in zip(theirs, mine, strict=True))


def parse_reason(schedule: Schedule) -> str | None:
    items = [field.split(",") for field in schedule.fields.text]
    for field in items:
        for item in field:
            span, _, step = item.partition("/")
            first, dash, last = span.partition("-")
            if step and dash and first == last:
                return RANGE_STEP
    if any("/" in item and not item.startswith("*") and "-" not in item for item in items[4]):
        return WEEKDAY_START_STEP
    return None


def dst_reason(schedule: Schedule, at: datetime) -> str | None:
    """Why the two differ at `at`, when a change of the zone's offset is next to it."""
    zone = schedule.zone
    before = (at - timedelta(days=1)).astimezone(zone).utcoffset()
    after = (at + timedelta(days=1)).astimezone(zone).utcoffset()
    if before is None or after is None or before == after:
        return None
    minute, hour = schedule.fields.text[:2]
    if minute.startswith("*") and not hour.startswith("*"):
        return FIXED_HOUR
    real_clock = minute.startswith("*") or hour.startswith("*")  # how cronsim tells
    if (after - before).total_seconds() % 3600 and real_clock:
        return SUB_HOUR_SHIFT
    return None


@functools.cache
def repeated_midnights(tz: str) -> tuple[date, ...]:
    """The days of 1999-2045 whose local midnight happens twice in `tz`."""
    zone = ZoneInfo(tz)
    found = []
    week = date(1999, 1, 1)
    while week < date(2046, 1, 1):
        # Offsets change at most once a week (tzdata's closest pair is four days apart, around
        # no midnight): only weeks with a change are looked at day by day.
        if _midnight_offset(zone, week) != _midnight_offset(zone, week + timedelta(days=7)):
            for day in (week + timedelta(days=n) for n in range(8)):
                midnight = datetime(day.year, day.month, day.day, tzinfo=zone)
                if _offset(midnight) > _offset(midnight.replace(fold=1)):
                    found.append(day)
        week += timedelta(days=7)
    return tuple(found)


def _midnight_offset(zone: ZoneInfo, day: date) -> timedelta:
    return _offset(datetime(day.year, day.month, day.day, tzinfo=zone))


def _offset(moment: datetime) -> timedelta:
    offset = moment.utcoffset()
    assert offset is not None
    return offset


def loops_in_cronsim(schedule: Schedule, start: datetime, end: datetime) -> bool:
    minute, hour = schedule.fields.text[:2]
    if not (minute.startswith("*") or hour.startswith("*")):
        return False  # cronsim walks the wall clock then, and does not loop
    first, last = (start - timedelta(days=2)).date(), (end + timedelta(days=2)).date()
    return any(first <= day <= last for day in repeated_midnights(schedule.tz))


@pytest.mark.slow  # seconds of timers or loops by design: not in --fast
def test_next_fire_times_match_cronsim() -> None:
    rng = random.Random(SEED)
    compared, excluded, failures = 0, Counter[str](), []
    began = time.perf_counter()
    for _ in range(EXPRESSIONS):
        expr, tz = random_expression(rng), rng.choice(ZONES)
        start = datetime(2000, 1, 1, tzinfo=UTC) + timedelta(
            seconds=rng.randrange(35 * 365 * 86400)
        )
        try:
            schedule = Schedule(expr, tz)
        except ScheduleError:
            continue  # never fires (Feb 30): cronlock refuses it at parse time
        compared += 1
        if not parsed_alike(expr, schedule):
            reason = parse_reason(schedule)
            if reason is None:
                failures.append(f"{expr!r}: the fields are read differently")
            else:
                excluded[reason] += 1
            continue
        mine = ours(schedule, start)
        if loops_in_cronsim(schedule, start, mine[-1]):
            excluded[MIDNIGHT_LOOP] += 1
            continue
        sims = theirs(expr, tz, start)
        if mine == sims:
            continue
        first = next(min(a, b) for a, b in zip(mine, sims, strict=True) if a != b)
        reason = dst_reason(schedule, first)
        if reason is None:
            failures.append(f"{expr!r} in {tz} from {start}: {mine} != {sims}")
        else:
            excluded[reason] += 1
    elapsed = time.perf_counter() - began
    summary = f"{compared} compared, excluded {dict(excluded)}, in {elapsed:.1f} s"
    assert not failures, summary + "\n" + "\n".join(failures[:20])
    # The exclusions stay exceptions: a change that made most cases "explained" fails here.
    assert compared > EXPRESSIONS * 0.8, summary
    assert sum(excluded.values()) < compared * 0.05, summary


def test_each_exclusion_is_real() -> None:
    """Each reason above, shown once on a case of its own."""
    assert Schedule("0 2-2/3 * * *").fields.hours == {2}
    assert CronSim("0 2-2/3 * * *", datetime(2026, 1, 1, tzinfo=UTC)).hours == {
        2,
        5,
        8,
        11,
        14,
        17,
        20,
        23,
    }

    start = datetime(2024, 4, 6, 13, tzinfo=UTC)  # Lord Howe goes back 30 minutes on 7 April
    lord_howe = Schedule("0 */2 * * *", "Australia/Lord_Howe")
    assert ours(lord_howe, start)[0] == datetime(2024, 4, 6, 15, 30, tzinfo=UTC)  # 02:00+10:30
    assert theirs("0 */2 * * *", "Australia/Lord_Howe", start)[0] == datetime(
        2024, 4, 6, 17, 30, tzinfo=UTC
    )  # 04:00+10:30: 02:00 skipped

    assert Schedule("0 0 * * 3/1").fields.dows == {3, 4, 5, 6}
    assert CronSim("0 0 * * 3/1", start).weekdays == {3, 4, 5, 6, 7}

    # New York, 2024-11-03: 01:00-01:59 happens twice. cronlock runs 01:30 once, Debian twice.
    fall = datetime(2024, 11, 3, 4, tzinfo=UTC)
    mine = ours(Schedule("*/30 1 * * *", "America/New_York"), fall)
    sims = theirs("*/30 1 * * *", "America/New_York", fall)
    assert mine[:3] == [
        datetime(2024, 11, 3, 5, 0, tzinfo=UTC),
        datetime(2024, 11, 3, 5, 30, tzinfo=UTC),
        datetime(2024, 11, 4, 6, 0, tzinfo=UTC),
    ]
    assert sims[:3] == [
        datetime(2024, 11, 3, 5, 0, tzinfo=UTC),
        datetime(2024, 11, 3, 5, 30, tzinfo=UTC),
        datetime(2024, 11, 3, 6, 0, tzinfo=UTC),
    ]


@pytest.mark.slow  # starts a process and waits out its 1 s timeout by design
def test_cronsim_loops_where_midnight_repeats() -> None:
    """The MIDNIGHT_LOOP exclusion: St John's went back from 00:01 to 23:01 on 2009-11-01."""
    assert date(2009, 11, 1) in repeated_midnights("America/St_Johns")
    start = datetime(2009, 10, 26, 12, 59, 48, tzinfo=UTC)
    schedule = Schedule("22 * */11 * *", "America/St_Johns")
    assert ours(schedule, start)[0] == datetime(2009, 11, 1, 3, 52, tzinfo=UTC)  # 00:22-03:30
    code = (
        "from datetime import datetime, timezone; from zoneinfo import ZoneInfo;"
        "from cronsim import CronSim;"
        "at = datetime(2009, 10, 26, 12, 59, 48, tzinfo=timezone.utc);"
        "next(CronSim('22 * */11 * *', at.astimezone(ZoneInfo('America/St_Johns'))))"
    )
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", code], timeout=1, check=False)
