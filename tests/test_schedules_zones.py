"""Issue 24's proof over 40 zones, scaled down (tests/support/zones.py, which
bench/schedules_proof.py runs at full size): 1,000 cron schedules over 40 IANA zones, 250 due at
one tick on the database's clock, dispatched by three real uvicorn instances; and at the same
tick on a second database, three more of which two are killed (SIGKILL) in the due minute.
Each (job, key, slot) runs exactly once, none is missed, each starts within `max_lateness`.

The checker is tested first, on histories made here, so the proof can fail: each rule it
holds is broken once and must be reported."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from cronlock import Cronlock
from cronlock.core.schedules import slots_of
from cronlock.settings import Settings
from tests.support.cluster import Instance
from tests.support.postgres import Clones
from tests.support.zones import (
    ENV,
    JOBS,
    ZONES_CHANGING,
    ZONES_FIXED,
    Phase,
    ZoneSchedule,
    check,
    choose_tick,
    plan,
    run_phase,
)
from tests.zone_jobs import MAX_LATENESS

COUNT, DUE = 1000, 250
# Seconds to set both phases' schedules (about 2.5 s here, at once) before the tick; the tick is a
# whole minute, so the test waits for it up to a minute more (the most of its wall time).
LEAD = 5.0

# --- the checker, on made-up histories -------------------------------------------------------

TICK = datetime(2026, 12, 4, 9, 30, tzinfo=UTC)
KILLED_AT = TICK + timedelta(seconds=2)


def clean_history(kills: bool = False) -> Phase:
    """What a correct run of `plan(200, 50, TICK)` leaves: one success and one effect per due
    key, by "a" (or, after the kill, the survivor "c"), due rows advanced, others untouched."""
    schedules = plan(200, 50, TICK)
    phase = Phase("made up", schedules, TICK, ["a", "b", "c"])
    if kills:
        phase.killed, phase.killed_at = ["a", "b"], KILLED_AT
    phase.set_began, phase.set_ended = TICK - timedelta(seconds=30), TICK - timedelta(seconds=29)
    runs: list[Mapping[str, Any]] = []
    for n, s in enumerate(x for x in schedules if x.due):
        started = TICK + timedelta(seconds=0.1 * n)
        instance = "c" if kills and started > KILLED_AT else "a"
        runs.append(
            {
                "id": n + 1,
                "key": str(s.key),
                "slot": TICK,
                "status": "succeeded",
                "instance": instance,
                "started_at": started,
                "attempt": 1,
                "trigger": "scheduled",
            }
        )
    phase.runs = runs
    phase.effects = [
        {"key": r["key"], "slot": TICK, "run_id": r["id"], "instance": r["instance"]} for r in runs
    ]
    phase.set_rows = {str(s.key): (s.first, 1) for s in schedules}
    phase.rows = {
        str(s.key): (
            slots_of(s.schedule, None, s.tz).next_tick(TICK) if s.due else s.first,
            1,
        )
        for s in schedules
    }
    return phase


def first_due(phase: Phase) -> ZoneSchedule:
    return next(s for s in phase.schedules if s.due)


def duplicate_effect(phase: Phase) -> None:
    phase.effects = [*phase.effects, phase.effects[0]]


def missed_run(phase: Phase) -> None:
    phase.runs, phase.effects = phase.runs[1:], phase.effects[1:]


def run_not_due(phase: Phase) -> None:
    later = next(s for s in phase.schedules if not s.due)
    phase.runs = [*phase.runs, {**phase.runs[0], "id": 999, "key": str(later.key)}]


def run_too_late(phase: Phase) -> None:
    late = TICK + timedelta(seconds=MAX_LATENESS + 1)
    phase.runs = [{**phase.runs[0], "started_at": late}, *phase.runs[1:]]


def run_early(phase: Phase) -> None:
    phase.runs = [{**phase.runs[0], "started_at": TICK - timedelta(seconds=1)}, *phase.runs[1:]]


def failed_for_no_kill(phase: Phase) -> None:
    failed = {**phase.runs[0], "id": 998, "status": "abandoned", "instance": "c"}
    phase.runs = [failed, *phase.runs]


def dead_instance_started(phase: Phase) -> None:
    last = phase.runs[-1]
    phase.runs = [*phase.runs[:-1], {**last, "instance": "b"}]


def set_with_other_tick(phase: Phase) -> None:
    key = str(first_due(phase).key)
    phase.set_rows = {**phase.set_rows, key: (TICK + timedelta(hours=1), 1)}


def offset_made_no_difference(phase: Phase) -> None:
    s = next(s for s in phase.schedules if s.other is not None)
    fake = dataclasses.replace(s, other=s.schedule)
    phase.schedules = [fake if x is s else x for x in phase.schedules]


def not_advanced(phase: Phase) -> None:
    key = str(first_due(phase).key)
    phase.rows = {**phase.rows, key: (TICK, 1)}


def later_row_touched(phase: Phase) -> None:
    key = str(next(s for s in phase.schedules if not s.due).key)
    phase.rows = {**phase.rows, key: (phase.rows[key][0], 2)}


def kill_too_late(phase: Phase) -> None:
    phase.killed_at = TICK + timedelta(seconds=61)


@pytest.mark.parametrize("kills", [False, True])
def test_clean_history_passes(kills: bool) -> None:
    verdict = check(clean_history(kills))
    assert verdict.ok, verdict.describe()
    assert verdict.figures["due"] == 50
    assert verdict.figures["twice"] == verdict.figures["missed"] == 0


@pytest.mark.parametrize(
    ("break_it", "kills", "words"),
    [
        (duplicate_effect, False, "1 succeeded runs, 2 effects"),
        (missed_run, False, "missed"),
        (run_not_due, False, "not a due (key, slot)"),
        (run_too_late, False, "s late"),
        (run_early, False, "s early"),
        (failed_for_no_kill, False, "not in flight on a killed instance"),
        (failed_for_no_kill, True, "not in flight on a killed instance"),
        (dead_instance_started, True, "started after its instance was killed"),
        (set_with_other_tick, False, "set with next tick"),
        (offset_made_no_difference, False, "the offset made no difference"),
        (not_advanced, False, "after its run"),
        (later_row_touched, False, "not due, but its row changed"),
        (kill_too_late, True, "after the tick"),
    ],
)
def test_checker_reports(break_it: Callable[[Phase], None], kills: bool, words: str) -> None:
    """Each rule, broken once in a clean history, is reported."""
    phase = clean_history(kills)
    break_it(phase)
    verdict = check(phase)
    assert not verdict.ok
    assert any(words in v for v in verdict.violations), verdict.violations


# Ticks on the days offsets change: Berlin's spring-forward instant; 02:30 in Berlin the night
# the clocks go back, first (CEST) and second (CET) time; Lord Howe's 01:45 the night its half
# hour of DST ends, the second time; the proof's own date.
TRANSITION_TICKS = (
    datetime(2026, 3, 29, 1, 0, tzinfo=UTC),
    datetime(2026, 10, 25, 0, 30, tzinfo=UTC),
    datetime(2026, 10, 25, 1, 30, tzinfo=UTC),
    datetime(2026, 4, 4, 15, 15, tzinfo=UTC),
    TICK,
)


@pytest.mark.parametrize("tick", TRANSITION_TICKS, ids=lambda t: t.strftime("%Y-%m-%dT%H:%M"))
def test_each_schedule_fires_first_where_zoneinfo_says(tick: datetime) -> None:
    """cronlock's schedule code agrees with zoneinfo on every schedule's first tick, the due
    ones' at the tick; an expression written with the offset half a year away does not fire at
    the tick; and the plan holds on the nights the clocks change."""
    schedules = plan(COUNT, DUE, tick)
    assert {s.tz for s in schedules} == set(ZONES_CHANGING + ZONES_FIXED)
    assert sum(s.due for s in schedules) == DUE
    for s in schedules:
        slots = slots_of(s.schedule, None, s.tz)
        assert slots.next_tick(tick - timedelta(minutes=5)) == s.first, s
        assert s.first == tick if s.due else s.first > tick + timedelta(minutes=59), s
        if s.other is not None:
            assert s.tz in ZONES_CHANGING, s
            assert not slots_of(s.other, None, s.tz).is_tick(tick), s
    assert any(s.other is not None for s in schedules)


def test_due_minutes_go_through_the_offset_at_that_date() -> None:
    """On the proof's date the southern zones are in DST: their due minute is the one their
    summer offset gives (and that of Kathmandu's +5:45 is a quarter past)."""
    schedules = plan(COUNT, DUE, TICK)
    contrasted = {s.tz for s in schedules if s.other is not None}
    assert {"Australia/Lord_Howe", "America/Santiago", "Pacific/Chatham"} <= contrasted
    assert len(contrasted) >= 20
    # 09:30 UTC is 20:30 at Lord Howe's +11 (DST; 20:00 at its +10:30), 15:15 in Kathmandu.
    for tz, minute, hour in (("Australia/Lord_Howe", "30", "20"), ("Asia/Kathmandu", "15", "15")):
        fields = [s.schedule.split() for s in schedules if s.due and s.tz == tz]
        assert any(f[1] != "*" for f in fields), tz
        for f in fields:
            assert f[0] == minute, (tz, f)
            assert f[1] in (hour, f"{hour},{(int(hour) + 12) % 24}", "*"), (tz, f)


# --- the proof, with real instances ----------------------------------------------------------


async def test_forty_zones_three_instances_then_two_killed(
    start_instances: Callable[..., list[Instance]],
    make_settings: Callable[..., Settings],
    clones: Clones,
    database_url: str,
) -> None:
    """Both phases at one tick, each on its own database with its own three instances."""
    cron = Cronlock(make_settings(cron_jobs=JOBS), housekeeping=False)
    async with clones.database() as kill_url:
        plain = start_instances(["p1", "p2", "p3"], env=ENV)
        doomed = start_instances(
            ["k1", "k2", "k3"], env={**ENV, "DATABASE_URL": kill_url}, ready_path="/readyz"
        )
        tick = await choose_tick(database_url, LEAD)
        phases = await asyncio.gather(
            run_phase("plain", cron, database_url, plain, count=COUNT, due=DUE, tick=tick),
            run_phase("kill", cron, kill_url, doomed, count=COUNT, due=DUE, tick=tick, kills=2),
        )
    verdicts = [check(phase) for phase in phases]
    report = "\n".join(v.describe() for v in verdicts)
    print(report)
    assert all(v.ok for v in verdicts), report
    kill_v = verdicts[1]
    for v in verdicts:
        assert v.figures["succeeded"] == v.figures["effects"] == DUE
        assert v.figures["contrasted"] > 0
    assert kill_v.phase.killed == ["k1", "k2"]
    assert kill_v.figures["after_kill"] > 0
