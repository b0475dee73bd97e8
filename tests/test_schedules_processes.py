"""Dynamic schedules dispatched by three real uvicorn instances with the built-in scheduler, two
of them killed with SIGKILL mid-stream: each (key, slot) is attempted once and succeeds once,
none is missed, and the survivor takes over the rows the killed ones had claimed. Scaled to run
in about 25 s; bench/schedules.py runs the issue's full figures (BENCHMARKS.md)."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

import asyncpg

from cronlock import Cronlock
from cronlock.core.schedules import slots_of
from cronlock.settings import Settings
from tests.support.cluster import Instance
from tests.test_schedules import EFFECTS_SQL, JOBS

# A key's ticks are EVERY s apart: a survivor later than that on one (a killed instance's claim
# waits out SCHEDULER_CLAIM_TIMEOUT first) runs only the latest, by design, so EVERY leaves room
# for a busy machine.
EVERY = 4
EPSILON = timedelta(microseconds=1)
KEYS = 150
ENV = {
    "CRON_JOBS": JOBS,
    "SCHEDULER_ENABLED": "true",
    "SCHEDULER_POLL_INTERVAL": "0.2",
    "SCHEDULER_CLAIM_TIMEOUT": "1",
    "SCHEDULER_CONCURRENCY": "20",
    "GRACEFUL_SHUTDOWN_TIMEOUT": "2",
    "LOG_SKIPS": "false",
}


async def test_three_dispatchers_kill_two(
    start_instances: Callable[..., list[Instance]],
    make_settings: Callable[..., Settings],
    db: asyncpg.Connection,
) -> None:
    await db.execute(EFFECTS_SQL)
    cron = Cronlock(make_settings(cron_jobs=JOBS), housekeeping=False)
    async with db.transaction():
        for key in range(KEYS):
            await cron.schedules.set(db, "tenant-report", key, every=EVERY)
    i1, i2, i3 = start_instances(["i1", "i2", "i3"], env=ENV)
    await asyncio.sleep(2 * EVERY + 1)
    i1.kill()
    i2.kill()
    killed_at = await db.fetchval("SELECT now()")
    await asyncio.sleep(3 * EVERY + 1)
    ended_at = await db.fetchval("SELECT now()")
    i3.stop()

    runs = await db.fetch(
        "SELECT key, slot, status, instance FROM cronlock.runs WHERE job = 'tenant-report'"
    )
    by_key: dict[str, list[asyncpg.Record]] = {}
    for r in runs:
        by_key.setdefault(r["key"], []).append(r)
    assert len(by_key) == KEYS
    step = timedelta(seconds=EVERY)
    for tenant, attempts in by_key.items():
        slots = sorted(r["slot"] for r in attempts)
        # One attempt per slot, ever: no instance made a second one.
        assert len(slots) == len(set(slots)), (tenant, slots)
        # None missed: consecutive ticks, through the kill, up to the last one due well
        # before the end (the survivor's claim timeout and poll in hand).
        assert all(b - a == step for a, b in itertools.pairwise(slots)), (tenant, slots)
        assert slots[-1] >= ended_at - 2 * step, (tenant, slots, ended_at)
        # Only runs in flight on a killed instance may have failed to succeed.
        for r in attempts:
            if r["status"] != "succeeded":
                assert r["instance"] in ("i1", "i2"), r
                assert r["slot"] <= killed_at, r
    effects = await db.fetch(
        "SELECT key, slot, count(*) AS n FROM dyn_effects GROUP BY key, slot HAVING count(*) > 1"
    )
    assert effects == []
    after_kill = [r for r in runs if r["slot"] > killed_at + step]
    assert after_kill
    assert {r["instance"] for r in after_kill} == {"i3"}


# --- schedule changes racing the dispatchers -------------------------------------------------

RACE_KEYS = 100
RACE_SECONDS = 12.0
RACE_WRITERS = 24


@dataclass
class Change:
    """One committed change of a key's row: a set (with its unique params name), a pause or a
    remove; `committed` is read on the database's clock after the commit, so a run that saw the
    row before this change started before it."""

    kind: str
    name: str | None
    every: int | None
    first: datetime | None
    committed: datetime


async def change_schedules(
    cron: Cronlock, database_url: str, seconds: float
) -> dict[str, list[Change]]:
    """RACE_WRITERS connections changing random keys' rows, each change its own transaction,
    for `seconds`; every change in commit order per key (one writer per key at a time)."""
    log: dict[str, list[Change]] = {str(k): [] for k in range(RACE_KEYS)}
    busy: set[int] = set()
    counter = itertools.count()
    rng = random.Random(24)
    deadline = time.monotonic() + seconds

    async def writer() -> None:
        conn = await asyncpg.connect(database_url, statement_cache_size=0)
        try:
            while time.monotonic() < deadline:
                key = rng.choice([k for k in range(RACE_KEYS) if k not in busy])
                busy.add(key)
                try:
                    roll = rng.random()
                    name: str | None = None
                    every: int | None = None
                    first: datetime | None = None
                    async with conn.transaction():
                        if roll < 0.8:
                            kind, name, every = "set", f"v{next(counter)}", rng.choice((1, 2))
                            row = await cron.schedules.set(
                                conn,
                                "tenant-report",
                                key,
                                every=every,
                                params={"name": name, "sleep": rng.choice((0.0, 0.0, 0.3))},
                            )
                            first = row.next_at
                        elif roll < 0.9:
                            kind = "pause"
                            await cron.schedules.pause(conn, "tenant-report", key)
                        else:
                            kind = "remove"
                            await cron.schedules.remove(conn, "tenant-report", key)
                    committed = await conn.fetchval("SELECT clock_timestamp()")
                    log[str(key)].append(Change(kind, name, every, first, committed))
                finally:
                    busy.discard(key)
        finally:
            await conn.close()

    await asyncio.gather(*(writer() for _ in range(RACE_WRITERS)))
    return log


async def test_schedule_changes_race_the_dispatchers(
    start_instances: Callable[..., list[Instance]],
    make_settings: Callable[..., Settings],
    database_url: str,
    db: asyncpg.Connection,
) -> None:
    """Changes at the rate this machine does (about 1,000/s is the aim) racing three
    dispatchers: no slot attempted twice, every run is of a slot its row held (the set it
    carries the params of, a tick of that schedule, not before its first tick) and started
    before the row's next change committed, and a removed schedule runs nothing more."""
    await db.execute(EFFECTS_SQL)
    cron = Cronlock(make_settings(cron_jobs=JOBS), housekeeping=False)
    env = {**ENV, "SCHEDULER_POLL_INTERVAL": "0.1", "SCHEDULER_CONCURRENCY": "10"}
    instances = start_instances(["r1", "r2", "r3"], env=env)
    began = time.monotonic()
    log = await change_schedules(cron, database_url, RACE_SECONDS)
    rate = sum(len(c) for c in log.values()) / (time.monotonic() - began)
    await asyncio.sleep(2.5)  # runs under way finish; removed rows must stay quiet
    for instance in instances:
        instance.stop()

    runs = await db.fetch(
        "SELECT key, slot, started_at, params->>'name' AS name FROM cronlock.runs "
        "WHERE job = 'tenant-report'"
    )
    assert runs, "no run at all: the dispatchers did not keep up with the changes"
    assert rate > 20, f"only {rate:.0f} changes/s: no race to speak of"
    pairs = [(r["key"], r["slot"]) for r in runs]
    assert len(pairs) == len(set(pairs)), "a slot attempted twice"
    sets = {
        c.name: (key, n)
        for key, changes in log.items()
        for n, c in enumerate(changes)
        if c.kind == "set"
    }
    for r in runs:
        key, n = sets[r["name"]]
        assert key == r["key"], r
        held, following = log[key][n], log[key][n + 1 : n + 2]
        assert held.every is not None
        assert held.first is not None
        assert r["slot"] >= held.first, (r, held)
        assert slots_of(None, held.every, "UTC").next_tick(r["slot"] - EPSILON) == r["slot"]
        if following:
            assert r["started_at"] < following[0].committed, (r, held, following[0])
    removed = [key for key, changes in log.items() if changes and changes[-1].kind == "remove"]
    assert removed
    print(f"{rate:.0f} changes/s, {len(runs)} runs, {len(removed)} keys removed at the end")
