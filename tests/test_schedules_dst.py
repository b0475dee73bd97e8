"""Dynamic schedules dispatched live across both EU daylight-saving changes of 2027, by three real
uvicorn instances: the rules of docs/schedules.md ("Daylight saving") hold in the dispatch, not
only in the tick arithmetic. Two code-scheduled jobs (tests/dst_jobs.py) go through the same
night on the built-in scheduler's own path.

Only the PostgreSQL server's clock is faked (libfaketime, Debian's `faketime`), to read about
LEAD seconds before the change when it starts; cronlock takes every slot decision on the
database's clock, so the instances, whose clocks stay real (months behind), dispatch as they
would that night. Each phase has a server of its own; the slots each key and job must run are
written out below by hand, as UTC instants, from the documented rules, never computed with
cronlock's own code.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import pytest

from cronlock import Cronlock
from cronlock.db.schema import migrate, migration_sets
from cronlock.settings import Settings
from tests.support.binaries import require_binary
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


SPRING = utc("2027-03-28 01:00")  # Berlin 02:00 CET -> 03:00 CEST, London, Helsinki at once
FALL = utc("2027-10-31 01:00")  # Berlin 03:00 CEST -> 02:00 CET, London, Helsinki at once
PHASES = {
    "spring-forward": (
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
    ),
    "fall-back": (
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
    ),
}


# The code-scheduled jobs' slots in each window: no rows, the scheduler ticks them.
CODE = {
    "spring-forward": {
        "berlin-two": (SPRING,),
        "berlin-minutely": (SPRING, utc("2027-03-28 01:01")),
    },
    # 02:00 CEST ran at 00:00 UTC, before the window; 02:00 CET, at the change, runs nothing.
    "fall-back": {"berlin-two": (), "berlin-minutely": (FALL, utc("2027-10-31 01:01"))},
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


@pytest.fixture(params=list(PHASES))
def phase(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture
def faked_server(phase: str) -> Iterator[ScratchPostgres]:
    """A PostgreSQL of the phase's own whose clock reads LEAD seconds before the change."""
    require_binary("faketime")
    change, _ = PHASES[phase]
    root = Path(tempfile.mkdtemp(prefix="cronlock-dst-"))
    server = ScratchPostgres(root / "pg", env=faked_clock(change - timedelta(seconds=LEAD)))
    server.start()
    try:
        yield server
    finally:
        server.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
async def database_url(faked_server: ScratchPostgres) -> str:
    """The phase's database on that server, migrated (so `db`, `make_settings` and the
    instances use it)."""
    await create_database(faked_server.dsn(), "dst")
    url = faked_server.dsn("dst")
    conn = await asyncpg.connect(url, statement_cache_size=0)
    try:
        await migrate(conn, "cronlock", migration_sets(CRON_JOBS.split(",")))
    finally:
        await conn.close()
    await prepare(url)
    return url


async def test_dispatch_across_the_change(
    phase: str,
    db: asyncpg.Connection,
    make_settings: Callable[..., Settings],
    instances: Instances,
) -> None:
    """Each key and code job runs its slots of the window exactly once, each at or after its
    slot, with one effect each, and nothing else runs; each row then waits for its next tick."""
    change, keys = PHASES[phase]
    began = await db_now(db)
    assert abs((change - began).total_seconds() - LEAD) < 10, (
        f"the server's clock reads {began.isoformat()}, not about {LEAD:.0f} s before "
        f"{change.isoformat()}: libfaketime is not in effect"
    )
    cron = Cronlock(make_settings(cron_jobs=JOBS), housekeeping=False)
    async with db.transaction():
        for key, k in keys.items():
            row = await cron.schedules.set(
                db, JOB, key, schedule=k.schedule, every=k.every, tz=k.tz
            )
            first = k.runs[0] if k.runs else k.next_at
            assert row.next_at == first, (key, k, row.next_at)
    instances.start_many(["d1", "d2", "d3"], env={**ENV, "CRON_JOBS": CRON_JOBS})
    ready = await db_now(db)
    assert ready < change, f"the instances were ready at {ready.isoformat()}, after the change"

    end = change + timedelta(seconds=AFTER)
    await asyncio.sleep((end - ready).total_seconds())

    async def past_the_end() -> bool:
        return await db_now(db) >= end

    await wait_for(past_the_end, 10.0, f"the server's clock to pass {end.isoformat()}", 0.2)
    instances.stop()

    runs = await db.fetch(
        "SELECT id, job, key, slot, status, started_at FROM cronlock.runs ORDER BY id"
    )
    expected = [(JOB, str(key), slot) for key, k in keys.items() for slot in k.runs]
    expected += [(job, "", slot) for job, slots in CODE[phase].items() for slot in slots]
    assert sorted((r["job"], r["key"] or "", r["slot"]) for r in runs) == sorted(expected)
    assert [r for r in runs if r["status"] != "succeeded"] == []
    assert [r for r in runs if r["started_at"] < r["slot"]] == []
    effects = await db.fetch("SELECT run_id, key, slot FROM zone_effects")
    assert sorted(tuple(e.values()) for e in effects) == [
        (r["id"], r["key"], r["slot"]) for r in runs
    ]
    rows = await db.fetch("SELECT key, next_at FROM cronlock.schedules WHERE job = $1", JOB)
    assert {r["key"]: r["next_at"] for r in rows} == {
        str(key): k.next_at for key, k in keys.items()
    }
