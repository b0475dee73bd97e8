"""Dynamic schedules dispatched live across both EU daylight-saving changes of 2027, by three real
uvicorn instances a change: the rules of docs/schedules.md ("Daylight saving") hold in the
dispatch, not only in the tick arithmetic. Two code-scheduled jobs (tests/dst_jobs.py) go
through the same nights on the built-in scheduler's own path.

Only the PostgreSQL servers' clocks are faked (libfaketime, Debian's `faketime`), each to read
LEAD seconds before its change when it starts; cronlock takes every slot decision on the
database's clock, so the instances, whose clocks stay real (months behind), dispatch as they
would that night. Each change has a server of its own, and both are run at once (in the same
real two minutes). The slots each key and job must run are written out below by hand, as UTC
instants, from the documented rules, never computed with cronlock's own code.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import pytest

from cronlock import Cronlock
from cronlock.db.schema import migrate, migration_sets
from cronlock.settings import Settings
from tests.support import TEST_SECRET
from tests.support.binaries import require_binary
from tests.support.cluster import Instance
from tests.support.instances import Instances
from tests.support.postgres import ScratchPostgres, create_database
from tests.support.zones import ENV, JOBS, db_now, prepare
from tests.util import wait_for
from tests.zone_jobs import JOB

CRON_JOBS = f"{JOBS},tests.dst_jobs"

# Where Debian's `faketime` wrapper preloads the library from: ld.so expands $LIB to the
# machine's library folder (lib/x86_64-linux-gnu).
LIBFAKETIME = "/usr/$LIB/faketime/libfaketime.so.1"
# The server's clock when it starts, before the change: time to set the schedules and start the
# instances (a few seconds) with no tick of the window missed.
LEAD = 35.0
# How long past the change the instances dispatch: the ticks at the change and a minute after
# it, not the next minute's.
AFTER = 75.0


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


@dataclass(frozen=True)
class Key:
    """One key's schedule, the slots it must run in the window and its row's next tick after."""

    tz: str
    schedule: str | None
    runs: tuple[datetime, ...]
    next_at: datetime
    every: int | None = None


@dataclass(frozen=True)
class Night:
    """One phase: the change (UTC), the dynamic job's keys, and the slots the code-scheduled
    jobs (no rows: the scheduler ticks them) must run in the window."""

    change: datetime
    keys: dict[int, Key]
    code: dict[str, tuple[datetime, ...]]


SPRING = utc("2027-03-28 01:00")  # Berlin 02:00 CET -> 03:00 CEST, London, Helsinki at once
FALL = utc("2027-10-31 01:00")  # Berlin 03:00 CEST -> 02:00 CET, London, Helsinki at once
PHASES = {
    "spring-forward": Night(
        SPRING,
        {
            # A fixed hour's tick in the skipped hour runs once, at the change.
            1: Key("Europe/Berlin", "30 2 * * *", (SPRING,), utc("2027-03-29 00:30")),
            # The gap's 02:00 and the real 03:00 CEST: one run, not two.
            2: Key("Europe/Berlin", "0 2,3 * * *", (SPRING,), utc("2027-03-29 00:00")),
            # Sixty gap ticks (a fixed hour, a wildcard minute), one run.
            3: Key("Europe/Berlin", "* 2 * * *", (SPRING,), utc("2027-03-29 00:00")),
            4: Key("Europe/London", "30 1 * * *", (SPRING,), utc("2027-03-29 00:30")),
            5: Key("Europe/Helsinki", "0 3 * * *", (SPRING,), utc("2027-03-29 00:00")),
            # A wildcard hour follows the real clock: 03:00 and 03:01 CEST.
            6: Key(
                "Europe/Berlin",
                "* * * * *",
                (SPRING, utc("2027-03-28 01:01")),
                utc("2027-03-28 01:02"),
            ),
            7: Key("Europe/Berlin", "0 * * * *", (SPRING,), utc("2027-03-28 02:00")),
            8: Key(
                "Europe/London",
                "* * * * *",
                (SPRING, utc("2027-03-28 01:01")),
                utc("2027-03-28 01:02"),
            ),
            9: Key("Europe/London", "0 * * * *", (SPRING,), utc("2027-03-28 02:00")),
            # Quiet in the window: 03:30 CEST; today's 01:00 CET was at 00:00, before it.
            10: Key("Europe/Berlin", "30 3 * * *", (), utc("2027-03-28 01:30")),
            11: Key("Europe/Berlin", "0 1 * * *", (), utc("2027-03-28 23:00")),
            # Every 50 s from the epoch, in UTC: no wall clock to change.
            12: Key(
                "UTC", None, (SPRING, utc("2027-03-28 01:00:50")), utc("2027-03-28 01:01:40"), 50
            ),
            # Controls: Tokyo changes nothing; 10:00 JST is 01:00 UTC every day.
            13: Key("Asia/Tokyo", "0 10 * * *", (SPRING,), utc("2027-03-29 01:00")),
            14: Key(
                "Asia/Tokyo",
                "* * * * *",
                (SPRING, utc("2027-03-28 01:01")),
                utc("2027-03-28 01:02"),
            ),
        },
        {"berlin-two": (SPRING,), "berlin-minutely": (SPRING, utc("2027-03-28 01:01"))},
    ),
    "fall-back": Night(
        FALL,
        {
            # A fixed hour's tick in the repeated hour ran the first time (CEST, 00:00-00:59
            # UTC, before the window): the second time (CET, from 01:00) runs nothing, and the
            # row waits for tomorrow's.
            1: Key("Europe/Berlin", "0 2 * * *", (), utc("2027-11-01 01:00")),
            2: Key("Europe/Berlin", "* 2 * * *", (), utc("2027-11-01 01:00")),
            3: Key("Europe/Berlin", "30 2 * * *", (), utc("2027-11-01 01:30")),
            4: Key("Europe/London", "30 1 * * *", (), utc("2027-11-01 01:30")),
            5: Key("Europe/Helsinki", "0 3 * * *", (), utc("2027-11-01 01:00")),
            # A wildcard hour follows the real clock: 02:00 and 02:01 CET, the second time.
            6: Key(
                "Europe/Berlin",
                "* * * * *",
                (FALL, utc("2027-10-31 01:01")),
                utc("2027-10-31 01:02"),
            ),
            7: Key("Europe/Berlin", "0 * * * *", (FALL,), utc("2027-10-31 02:00")),
            8: Key(
                "Europe/London",
                "* * * * *",
                (FALL, utc("2027-10-31 01:01")),
                utc("2027-10-31 01:02"),
            ),
            9: Key("Europe/London", "0 * * * *", (FALL,), utc("2027-10-31 02:00")),
            # Quiet in the window: the first 02:00 has run, 03:00 CET is at 02:00 UTC; 01:00
            # CEST was at 23:00 UTC yesterday, tomorrow's 01:00 CET is at 00:00.
            10: Key("Europe/Berlin", "0 2,3 * * *", (), utc("2027-10-31 02:00")),
            11: Key("Europe/Berlin", "0 1 * * *", (), utc("2027-11-01 00:00")),
            12: Key(
                "UTC", None, (FALL, utc("2027-10-31 01:00:50")), utc("2027-10-31 01:01:40"), 50
            ),
            13: Key("Asia/Tokyo", "0 10 * * *", (FALL,), utc("2027-11-01 01:00")),
            14: Key(
                "Asia/Tokyo",
                "* * * * *",
                (FALL, utc("2027-10-31 01:01")),
                utc("2027-10-31 01:02"),
            ),
        },
        # 02:00 CEST ran at 00:00 UTC, before the window; 02:00 CET, at the change, does not.
        {"berlin-two": (), "berlin-minutely": (FALL, utc("2027-10-31 01:01"))},
    ),
}


def faked_clock(at: datetime) -> dict[str, str]:
    """A process environment whose clock reads `at` now and runs on from there. An offset from
    the real clock, not a start time, so every backend the postmaster forks agrees."""
    return {
        "LD_PRELOAD": LIBFAKETIME,
        "FAKETIME": f"{at.timestamp() - time.time():+.0f}",
        # The server's waits and timeouts, and its files' times, stay as they are.
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "NO_FAKE_STAT": "1",
    }


@pytest.fixture
async def nights() -> AsyncIterator[dict[str, str]]:
    """Each phase's migrated database, on a PostgreSQL of its own whose clock read LEAD
    seconds before the phase's change when it started: both changes come in the same real
    minute, so one wait sees both."""
    require_binary("faketime")
    root = Path(tempfile.mkdtemp(prefix="cronlock-dst-"))
    servers: list[ScratchPostgres] = []
    urls = {}
    try:
        for phase, night in PHASES.items():
            server = ScratchPostgres(
                root / phase, env=faked_clock(night.change - timedelta(seconds=LEAD))
            )
            servers.append(server)
            server.start()
            await create_database(server.dsn(), "dst")
            urls[phase] = server.dsn("dst")
            conn = await asyncpg.connect(urls[phase], statement_cache_size=0)
            try:
                await migrate(conn, "cronlock", migration_sets(CRON_JOBS.split(",")))
            finally:
                await conn.close()
            await prepare(urls[phase])
        yield urls
    finally:
        for server in servers:
            server.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)


async def set_schedules(phase: str, url: str, db: asyncpg.Connection) -> None:
    """The phase's keys, through the library, each with its first tick as expected."""
    night = PHASES[phase]
    began = await db_now(db)
    assert abs((night.change - began).total_seconds() - LEAD) < 10, (
        f"{phase}: the server's clock reads {began.isoformat()}, not about {LEAD:.0f} s before "
        f"{night.change.isoformat()}: libfaketime is not in effect"
    )
    settings = Settings(_env_file=None, database_url=url, cron_secret=TEST_SECRET, cron_jobs=JOBS)
    cron = Cronlock(settings, housekeeping=False)
    async with db.transaction():
        for key, k in night.keys.items():
            row = await cron.schedules.set(
                db, JOB, key, schedule=k.schedule, every=k.every, tz=k.tz
            )
            first = k.runs[0] if k.runs else k.next_at
            assert row.next_at == first, (phase, key, k, row.next_at)


async def wait_until(db: asyncpg.Connection, at: datetime) -> None:
    """Until the server's clock reads `at` (at most 10 s longer than it says)."""
    await asyncio.sleep(max(0.0, (at - await db_now(db)).total_seconds()))

    async def passed() -> bool:
        return await db_now(db) >= at

    await wait_for(passed, 10.0, f"the server's clock to read {at.isoformat()}", 0.2)


async def check(phase: str, db: asyncpg.Connection) -> None:
    """Each key and code job ran its slots of the window exactly once, each at or after its
    slot, with one effect each, and nothing else ran; each row waits for its next tick."""
    night = PHASES[phase]
    runs = await db.fetch(
        "SELECT id, job, key, slot, status, started_at FROM cronlock.runs ORDER BY id"
    )
    expected = [(JOB, str(key), slot) for key, k in night.keys.items() for slot in k.runs]
    expected += [(job, "", slot) for job, slots in night.code.items() for slot in slots]
    assert sorted((r["job"], r["key"] or "", r["slot"]) for r in runs) == sorted(expected), phase
    assert [r for r in runs if r["status"] != "succeeded"] == [], phase
    assert [r for r in runs if r["started_at"] < r["slot"]] == [], phase
    effects = await db.fetch("SELECT run_id, key, slot FROM zone_effects")
    assert sorted(tuple(e.values()) for e in effects) == [
        (r["id"], r["key"], r["slot"]) for r in runs
    ], phase
    rows = await db.fetch("SELECT key, next_at FROM cronlock.schedules WHERE job = $1", JOB)
    assert {r["key"]: r["next_at"] for r in rows} == {
        str(key): k.next_at for key, k in night.keys.items()
    }, phase


async def test_dispatch_across_both_changes(
    nights: dict[str, str],
    tmp_path: Path,
    report_logs: Callable[[Iterable[Instance]], None],
) -> None:
    """Three instances a phase dispatch through its change; then `check` each phase."""
    dbs = {p: await asyncpg.connect(url, statement_cache_size=0) for p, url in nights.items()}
    dispatchers = {p: Instances(url, tmp_path / p) for p, url in nights.items()}
    try:
        for phase, db in dbs.items():
            await set_schedules(phase, nights[phase], db)
        env = {**ENV, "CRON_JOBS": CRON_JOBS}
        started = await asyncio.gather(
            *(
                asyncio.to_thread(d.start_many, [f"{p}-{n}" for n in (1, 2, 3)], env)
                for p, d in dispatchers.items()
            )
        )
        report_logs(itertools.chain(*started))
        for phase, db in dbs.items():
            ready = await db_now(db)
            assert ready < PHASES[phase].change, f"{phase}: instances ready at {ready}, too late"
        for phase, db in dbs.items():
            await wait_until(db, PHASES[phase].change + timedelta(seconds=AFTER))
        for d in dispatchers.values():
            d.stop()
        for phase, db in dbs.items():
            await check(phase, db)
    finally:
        for d in dispatchers.values():
            d.stop()
        for db in dbs.values():
            await db.close()
