"""The 40-zone proof of dynamic schedules (issue 24), one code path for two sizes:
bench/schedules_proof.py runs it at full size (20,000 schedules, 5,000 due in one minute) and
tests/test_schedules_zones.py scaled down on every CI run.

**The schedules** (`plan`). Key k lives in `ZONES[k % 40]`: 24 zones whose UTC offset changes
during the year (daylight saving, the half-hour of Lord Howe, Troll's two hours, Casablanca's
Ramadan) and 16 whose offset does not (Kolkata's +5:30, Kathmandu's +5:45, Eucla's +8:45,
Kiritimati's +14...). A due key's cron expression is written in its zone's wall time of the tick,
found through the zone's offset at that instant (zoneinfo), in one of six shapes (daily, a
weekday, a day of the month, a month and day, hourly with a wildcard hour, a list of hours); the
others fire later: at a wall time 1 to 22 hours after the tick, or at the tick's wall time on
the zone's tomorrow (its weekday or its day of the month). Each schedule carries the instant it
must fire at first, computed here with zoneinfo, not with cronlock.

**The DST claim.** A due key in a zone whose offset at the tick differs from its offset half a
year away also carries the expression that other offset would have given: cronlock must not
fire it at the tick (`is_tick`), so those keys' due minute depends on the offset at that date.

**The check** (`check`), from the ledger, the effects (`zone_effects`, one row per run, written
in the run's transaction: tests/zone_jobs.py) and the rows: each schedule was set with the
expected next tick; each due (job, key, slot) has exactly one succeeded run and one effect, of
that run, started at or after the tick and within `max_lateness`; no other key or slot ran; an
attempt that did not succeed was in flight on a killed instance when it died, and nothing
started on a killed instance after; each due row advanced to its next tick, the others are
untouched.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol
from zoneinfo import ZoneInfo

import asyncpg

from cronlock import Cronlock
from cronlock.core.schedules import slots_of
from tests.zone_jobs import JOB, MAX_LATENESS

JOBS = "tests.zone_jobs"

# Offsets that change during the year (as tzdata has it in 2026), then offsets that do not.
ZONES_CHANGING = (
    "Europe/Berlin",
    "Europe/London",
    "Europe/Dublin",  # "negative" DST: its standard time is the summer's
    "Europe/Chisinau",
    "Atlantic/Azores",
    "America/New_York",
    "America/Chicago",
    "America/Denver",
    "America/Los_Angeles",
    "America/Anchorage",
    "America/St_Johns",  # -3:30 / -2:30
    "America/Havana",
    "America/Santiago",
    "Pacific/Easter",
    "Australia/Sydney",
    "Australia/Adelaide",  # +9:30 / +10:30
    "Australia/Lord_Howe",  # half an hour of DST: +10:30 / +11
    "Pacific/Auckland",
    "Pacific/Chatham",  # +12:45 / +13:45
    "Pacific/Norfolk",
    "Antarctica/Troll",  # two hours of DST: +0 / +2
    "Asia/Jerusalem",
    "Africa/Cairo",
    "Africa/Casablanca",  # an hour back during Ramadan
)
ZONES_FIXED = (
    "UTC",
    "Asia/Kolkata",  # +5:30
    "Asia/Kathmandu",  # +5:45
    "Asia/Tokyo",
    "Asia/Shanghai",
    "Asia/Dubai",
    "Africa/Nairobi",
    "Australia/Eucla",  # +8:45
    "Australia/Brisbane",
    "Pacific/Kiritimati",  # +14: a day ahead of UTC
    "Pacific/Pago_Pago",  # -11: a day behind
    "Pacific/Marquesas",  # -9:30
    "Asia/Tehran",  # +3:30
    "America/Sao_Paulo",
    "Asia/Yangon",  # +6:30
    "America/Phoenix",
)
ZONES = ZONES_CHANGING + ZONES_FIXED

# The instances' settings (the rest are cronlock's defaults): a run uses two pooled
# connections (the lock's transaction, the ledger's row); a killed instance's claimed rows wait
# SCHEDULER_CLAIM_TIMEOUT; its runs in flight are found abandoned by a survivor's retry loop.
ENV = {
    "CRON_JOBS": JOBS,
    "SCHEDULER_ENABLED": "true",
    "SCHEDULER_CONCURRENCY": "10",
    "DB_POOL_MAX_SIZE": "24",
    "SCHEDULER_CLAIM_TIMEOUT": "5",
    "RETRY_POLL_INTERVAL": "1",
    "GRACEFUL_SHUTDOWN_TIMEOUT": "5",
    "LOG_SKIPS": "false",
}
EFFECTS_SQL = """
CREATE TABLE IF NOT EXISTS zone_effects (
    key text, slot timestamptz, run_id bigint, instance text,
    at timestamptz DEFAULT clock_timestamp())
"""

DAY = timedelta(days=1)
HALF_YEAR = timedelta(days=182)
# Fixed-hour shapes (the hour field is a number, so the zone's offset decides the UTC hour),
# then the hourly one (a wildcard hour follows the real clock).
DUE_SHAPES = (
    "{m} {h} * * *",
    "{m} {h} * * {w}",
    "{m} {h} {d} * *",
    "{m} {h} {d} {mon} *",
    "{m} {h},{h2} * * *",
    "{m} * * * *",
)
LATER_SHAPES = DUE_SHAPES[:4]
TOMORROW_SHAPES = ("{m} {h} * * {w}", "{m} {h} {d} * *")
# The kill phase kills when this share of the due runs has started (or this long after the
# tick), so the survivor has most of the minute's runs still to make.
KILL_AT_SHARE = 0.2
KILL_AT_LATEST = 30.0
# After the last due run succeeded, the dispatchers go on this long before they are stopped:
# longer than a claim's timeout and a retry poll, so a second run of a slot would show.
QUIET = 8.0


class Process(Protocol):
    """A real app instance (tests.support.cluster.Instance, bench's PinnedInstance)."""

    name: str

    def kill(self) -> int | None: ...

    def stop(self, timeout: float = ...) -> None: ...


# --- the schedules ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ZoneSchedule:
    """One key's schedule, and the instant it must first fire at (zoneinfo's answer)."""

    key: int
    tz: str
    schedule: str
    due: bool
    first: datetime
    # A due key whose zone has another offset half a year away: the expression that offset
    # would have given (it must not fire at the tick); None otherwise.
    other: str | None = None


def expression(shape: str, wall: datetime) -> str:
    """`shape` filled with a wall time's fields (cron's weekday: 0 is Sunday)."""
    return shape.format(
        m=wall.minute,
        h=wall.hour,
        h2=(wall.hour + 12) % 24,
        d=wall.day,
        mon=wall.month,
        w=wall.isoweekday() % 7,
    )


def changes_offset(tz: str, at: datetime) -> bool:
    """Whether the zone's UTC offset changes within half a year either side of `at`."""
    zone = ZoneInfo(tz)
    return (
        len({(at + k * timedelta(days=7)).astimezone(zone).utcoffset() for k in range(-26, 27)}) > 1
    )


def plan(count: int, due: int, tick: datetime, seed: int = 24) -> list[ZoneSchedule]:
    """`count` schedules over ZONES, `due` of them (chosen by `seed`) due at `tick` (a UTC
    minute), the others later."""
    assert 0 < due <= count
    rng = random.Random(seed)
    due_keys = set(rng.sample(range(count), due))
    out = []
    for key in range(count):
        tz = ZONES[key % len(ZONES)]
        zone = ZoneInfo(tz)
        if key in due_keys:
            out.append(_due(key, tz, zone, tick))
        else:
            out.append(_later(key, tz, zone, tick, rng))
    return out


def _due(key: int, tz: str, zone: ZoneInfo, tick: datetime) -> ZoneSchedule:
    wall = tick.astimezone(zone)
    # Every zone gets every shape (key % 40 is its zone).
    shape = DUE_SHAPES[key // len(ZONES) % len(DUE_SHAPES)]
    if wall.fold:
        # The second occurrence of a repeated wall time (the night the clocks go back): a
        # fixed-hour expression fires at the first (docs/schedules.md), an hourly one at both.
        shape = DUE_SHAPES[-1]
    expr = expression(shape, wall)
    other = None
    offset = (tick + HALF_YEAR).astimezone(zone).utcoffset()
    if offset is not None and offset != wall.utcoffset():
        # The wall time the tick would have under the other offset (as a naive datetime).
        contrast = expression(shape, (tick + offset).replace(tzinfo=None))
        other = contrast if contrast != expr else None
    return ZoneSchedule(key, tz, expr, True, tick, other)


def _once(wall: datetime) -> bool:
    """Whether a wall time occurs exactly once in its zone (not in a gap, not repeated)."""
    return wall.replace(fold=0).utcoffset() == wall.replace(fold=1).utcoffset()


def _later(key: int, tz: str, zone: ZoneInfo, tick: datetime, rng: random.Random) -> ZoneSchedule:
    tomorrow = tick.astimezone(zone) + DAY  # aware arithmetic: the same wall time, a day on
    if rng.random() < 0.25 and _once(tomorrow):
        shape = rng.choice(TOMORROW_SHAPES)
        return ZoneSchedule(key, tz, expression(shape, tomorrow), False, tomorrow.astimezone(UTC))
    while True:
        # 1 to 22 hours on: the wall time's previous occurrence is before the tick by an hour
        # at least, even across a 23-hour day, so nothing fires between the set and the tick.
        at = tick + timedelta(minutes=rng.randrange(60, 22 * 60))
        wall = at.astimezone(zone)
        if _once(wall):
            return ZoneSchedule(key, tz, expression(rng.choice(LATER_SHAPES), wall), False, at)


# --- one phase against real instances --------------------------------------------------------


@dataclass
class Phase:
    """What one phase did: the schedules, when they were set, what was killed and when (all
    times on the database's clock), and what the ledger, the effects and the rows say after."""

    title: str
    schedules: list[ZoneSchedule]
    tick: datetime
    instances: list[str]
    killed: list[str] = field(default_factory=list)
    killed_at: datetime | None = None
    set_began: datetime | None = None
    set_ended: datetime | None = None
    set_rows: dict[str, tuple[datetime, int]] = field(default_factory=dict)
    runs: Sequence[Mapping[str, Any]] = field(default_factory=list)
    effects: Sequence[Mapping[str, Any]] = field(default_factory=list)
    rows: dict[str, tuple[datetime, int]] = field(default_factory=dict)
    # When the last due key had succeeded (or the wait for it ended).
    done_at: datetime | None = None


async def db_now(conn: asyncpg.Connection) -> datetime:
    now: datetime = await conn.fetchval("SELECT now()")
    return now


async def choose_tick(dsn: str, lead: float) -> datetime:
    """The first whole minute on the database's clock at least `lead` seconds away."""
    conn = await asyncpg.connect(dsn, statement_cache_size=0)
    try:
        now = await db_now(conn)
    finally:
        await conn.close()
    return (now + timedelta(seconds=lead)).replace(second=0, microsecond=0) + timedelta(minutes=1)


async def prepare(dsn: str) -> None:
    conn = await asyncpg.connect(dsn, statement_cache_size=0)
    try:
        await conn.execute(EFFECTS_SQL)
    finally:
        await conn.close()


async def set_schedules(
    cron: Cronlock, dsn: str, phase: Phase, *, connections: int = 4, chunk: int = 250
) -> None:
    """Every schedule through `cron.schedules.set`, `chunk` to a transaction over
    `connections` connections at once; each row's next tick and version as set."""
    queue = [phase.schedules[i : i + chunk] for i in range(0, len(phase.schedules), chunk)]

    async def writer() -> None:
        conn = await asyncpg.connect(dsn, statement_cache_size=0)
        try:
            while queue:
                batch = queue.pop()
                async with conn.transaction():
                    for s in batch:
                        row = await cron.schedules.set(
                            conn, JOB, s.key, schedule=s.schedule, tz=s.tz
                        )
                        phase.set_rows[row.key] = (row.next_at, row.version)
        finally:
            await conn.close()

    conn = await asyncpg.connect(dsn, statement_cache_size=0)
    try:
        phase.set_began = await db_now(conn)
        await asyncio.gather(*(writer() for _ in range(connections)))
        phase.set_ended = await db_now(conn)
    finally:
        await conn.close()


STARTED_SQL = "SELECT count(*) FROM cronlock.runs WHERE job = $1 AND slot = $2"
SUCCEEDED_SQL = (
    "SELECT count(DISTINCT key) FROM cronlock.runs WHERE job = $1 AND slot = $2"
    " AND status = 'succeeded'"
)


def _kill_all(instances: Sequence[Process]) -> None:
    for instance in instances:
        instance.kill()


def _stop_all(instances: Sequence[Process]) -> None:
    for instance in instances:
        instance.stop()


async def observe(dsn: str, phase: Phase, instances: Sequence[Process], kills: int) -> None:
    """Through the due minute: kill `kills` instances (SIGKILL) once KILL_AT_SHARE of the due
    runs started, wait until every due key succeeded (or `max_lateness` and a margin passed),
    let the dispatchers go on for QUIET seconds, stop the rest, and read what they left."""
    due = sum(1 for s in phase.schedules if s.due)
    conn = await asyncpg.connect(dsn, statement_cache_size=0)
    try:
        await asyncio.sleep(max(0.0, (phase.tick - await db_now(conn)).total_seconds()))
        if kills:
            kill_by = phase.tick + timedelta(seconds=KILL_AT_LATEST)
            while await conn.fetchval(STARTED_SQL, JOB, phase.tick) < KILL_AT_SHARE * due:
                if await db_now(conn) >= kill_by:
                    break
                await asyncio.sleep(0.05)
            victims = list(instances[:kills])
            await asyncio.to_thread(_kill_all, victims)
            phase.killed = [v.name for v in victims]
            phase.killed_at = await db_now(conn)
        deadline = phase.tick + timedelta(seconds=MAX_LATENESS + 30)
        while await conn.fetchval(SUCCEEDED_SQL, JOB, phase.tick) < due:
            if await db_now(conn) >= deadline:
                break
            await asyncio.sleep(0.25)
        phase.done_at = await db_now(conn)
        await asyncio.sleep(QUIET)
        survivors = [i for i in instances if i.name not in phase.killed]
        await asyncio.to_thread(_stop_all, survivors)
        runs = await conn.fetch(
            "SELECT id, key, slot, status, instance, started_at, attempt, trigger "
            "FROM cronlock.runs WHERE job = $1 ORDER BY id",
            JOB,
        )
        phase.runs = [dict(r.items()) for r in runs]
        effects = await conn.fetch("SELECT key, slot, run_id, instance FROM zone_effects")
        phase.effects = [dict(r.items()) for r in effects]
        phase.rows = {
            r["key"]: (r["next_at"], r["version"])
            for r in await conn.fetch(
                "SELECT key, next_at, version FROM cronlock.schedules WHERE job = $1", JOB
            )
        }
    finally:
        await conn.close()


async def run_phase(
    title: str,
    cron: Cronlock,
    dsn: str,
    instances: Sequence[Process],
    *,
    count: int,
    due: int,
    tick: datetime,
    kills: int = 0,
) -> Phase:
    """One phase on a migrated database whose `instances` are up: the schedules set for
    `tick`, then observed through it (`observe`). The caller checks the result (`check`)."""
    phase = Phase(title, plan(count, due, tick), tick, [i.name for i in instances])
    await prepare(dsn)
    await set_schedules(cron, dsn, phase)
    await observe(dsn, phase, instances, kills)
    return phase


# --- the check -------------------------------------------------------------------------------


@dataclass
class Verdict:
    """The figures of one phase and every rule it broke (empty: none)."""

    phase: Phase
    figures: dict[str, Any]
    violations: list[str]

    @property
    def ok(self) -> bool:
        return not self.violations

    def describe(self, shown: int = 20) -> str:
        """The tick, the DST claim's figures, and the first `shown` violations."""
        f = self.figures
        lines = [
            f"{self.phase.title}: tick {self.phase.tick.isoformat()} (the database's clock); "
            f"{f['contrasted']:,} due keys in {f['contrasted_zones']} zones whose offset at the "
            "tick is not the one half a year away (none fires at the tick with that other "
            f"offset); set in {f['set_s']:.1f} s, {_seconds(f['set_before_tick'])} before the "
            f"tick; every due key done by tick + {_seconds(f['done_after'])}"
        ]
        lines += [f"  - {line}" for line in self.violations[:shown]]
        if len(self.violations) > shown:
            lines.append(f"  - ... and {len(self.violations) - shown:,} more")
        return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return "?" if value is None else f"{value:.1f} s"


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def check(phase: Phase) -> Verdict:
    """Hold the phase's history to the rules (the module's docstring)."""
    bad: list[str] = []
    tick, killed, killed_at = phase.tick, set(phase.killed), phase.killed_at
    limit = timedelta(seconds=MAX_LATENESS)
    planned = {str(s.key): s for s in phase.schedules}
    due_keys = {k for k, s in planned.items() if s.due}

    # Set: cronlock's next tick is zoneinfo's; another offset would not have fired.
    contrasted = 0
    for key, s in planned.items():
        row = phase.set_rows.get(key)
        if row is None or row[0] != s.first:
            got = None if row is None else row[0].isoformat()
            bad.append(
                f"key {key} ({s.tz}, {s.schedule!r}): set with next tick {got}, "
                f"expected {s.first.isoformat()}"
            )
        if s.other is not None:
            contrasted += 1
            if slots_of(s.other, None, s.tz).is_tick(tick):
                bad.append(
                    f"key {key} ({s.tz}): {s.other!r}, written with the offset of half a "
                    f"year away, fires at the tick too: the offset made no difference"
                )
    if phase.set_ended is not None and phase.set_ended >= tick:
        bad.append(f"the schedules were set until {phase.set_ended.isoformat()}, after the tick")

    # Runs: only due keys, only at the tick, from the tick to max_lateness after it.
    succeeded: dict[str, list[Mapping[str, Any]]] = {}
    for r in phase.runs:
        what = f"run {r['id']} (key {r['key']}, slot {r['slot']}, {r['status']}, {r['instance']})"
        if r["key"] not in due_keys or r["slot"] != tick:
            bad.append(f"{what}: not a due (key, slot)")
            continue
        if r["started_at"] < tick:
            bad.append(f"{what}: started {(tick - r['started_at']).total_seconds():.3f} s early")
        if r["started_at"] - tick > limit:
            bad.append(f"{what}: started {(r['started_at'] - tick).total_seconds():.1f} s late")
        if r["status"] == "succeeded":
            succeeded.setdefault(r["key"], []).append(r)
        elif r["instance"] not in killed or killed_at is None or r["started_at"] > killed_at:
            bad.append(f"{what}: did not succeed, and was not in flight on a killed instance")
        if r["instance"] in killed and killed_at is not None and r["started_at"] > killed_at:
            bad.append(f"{what}: started after its instance was killed")
    effects: dict[str, list[Mapping[str, Any]]] = {}
    for e in phase.effects:
        if e["key"] not in due_keys or e["slot"] != tick:
            bad.append(f"effect of key {e['key']} at {e['slot']}: not a due (key, slot)")
        else:
            effects.setdefault(e["key"], []).append(e)

    # Exactly once: one success and one effect, the success's, per due key.
    twice = missed = 0
    for key in sorted(due_keys, key=int):
        runs, made = succeeded.get(key, []), effects.get(key, [])
        if len(runs) > 1 or len(made) > 1:
            twice += 1
            bad.append(f"key {key}: {len(runs)} succeeded runs, {len(made)} effects")
        elif not runs or not made:
            missed += 1
            bad.append(
                f"key {key} ({planned[key].tz}): missed "
                f"({len(runs)} succeeded runs, {len(made)} effects)"
            )
        elif made[0]["run_id"] != runs[0]["id"]:
            bad.append(f"key {key}: the effect is run {made[0]['run_id']}'s, not {runs[0]['id']}'s")

    # The rows: a due row advanced to its next tick (in the run's transaction), others untouched.
    for key, s in planned.items():
        now_row, set_row = phase.rows.get(key), phase.set_rows.get(key)
        if now_row is None or set_row is None:
            bad.append(f"key {key}: its row is gone")
        elif s.due and now_row[0] != slots_of(s.schedule, None, s.tz).next_tick(tick):
            bad.append(f"key {key} ({s.tz}, {s.schedule!r}): next_at {now_row[0]} after its run")
        elif not s.due and now_row != set_row:
            bad.append(f"key {key}: not due, but its row changed ({set_row} -> {now_row})")

    late = [(runs[0]["started_at"] - tick).total_seconds() for runs in succeeded.values() if runs]
    after_kill = (
        sum(1 for runs in succeeded.values() if runs[0]["started_at"] > killed_at)
        if killed_at is not None
        else 0
    )
    if killed_at is not None:
        if killed_at - tick >= timedelta(minutes=1):
            bad.append(f"the kill came {(killed_at - tick).total_seconds():.1f} s after the tick")
        if after_kill == 0:
            bad.append("the kill left no due run to the survivors")
    zones = {s.tz for s in phase.schedules}
    figures = {
        "schedules": len(phase.schedules),
        "zones": len(zones),
        "zones_changing": sum(1 for tz in zones if changes_offset(tz, tick)),
        "due": len(due_keys),
        "contrasted": contrasted,
        "contrasted_zones": len({s.tz for s in phase.schedules if s.other is not None}),
        "instances": len(phase.instances),
        "killed": len(phase.killed),
        "killed_after": None if killed_at is None else (killed_at - tick).total_seconds(),
        "after_kill": after_kill,
        "runs": len(phase.runs),
        "succeeded": sum(len(r) for r in succeeded.values()),
        "not_succeeded": Counter(r["status"] for r in phase.runs if r["status"] != "succeeded"),
        "retries": sum(1 for r in phase.runs if r["attempt"] > 1),
        "effects": len(phase.effects),
        "twice": twice,
        "missed": missed,
        "p50": percentile(late, 50),
        "p99": percentile(late, 99),
        "max": max(late, default=float("nan")),
        "set_s": (phase.set_ended - phase.set_began).total_seconds()
        if phase.set_began and phase.set_ended
        else float("nan"),
        "set_before_tick": (tick - phase.set_ended).total_seconds() if phase.set_ended else None,
        "done_after": (phase.done_at - tick).total_seconds() if phase.done_at else None,
    }
    return Verdict(phase, figures, bad)
