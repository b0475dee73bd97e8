"""Slot decisions of the runner against a real ledger, at chosen database times.

The database clock cannot be moved, so these call the runner's slot step with the `now` the
lock statement would have returned; everything else (the ledger, the unique index) is real.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from cronlock.core.jobs import load
from cronlock.core.runner import Runner
from cronlock.db.pool import Database

Settings = Any


@pytest.fixture
async def runner(make_settings: Callable[..., Settings]) -> Any:
    settings = make_settings()
    registry = load(settings.job_modules)
    db = Database(settings)
    await db.open()
    yield Runner(settings, registry, db)
    await db.close()


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).astimezone(UTC)


async def decide(runner: Any, db: asyncpg.Connection, name: str, now: datetime) -> Any:
    return await runner.decide_slot(db, runner.registry[name], None, "scheduled", None, now)


async def test_early_trigger_counts_for_the_coming_tick(
    runner: Any, db: asyncpg.Connection
) -> None:
    tick = at("2026-03-10T02:30:00+01:00")
    assert await decide(runner, db, "berlin-0230", tick - timedelta(seconds=10)) == (None, tick)
    previous = tick - timedelta(days=1)
    early = tick - timedelta(seconds=31)
    assert await decide(runner, db, "berlin-0230", early) == (None, previous)


async def test_dst_gap_and_fold_in_berlin(runner: Any, db: asyncpg.Connection) -> None:
    # 2026-03-29: 02:00 -> 03:00. The 02:30 tick runs once, right after the change (01:00 UTC).
    gap_slot = at("2026-03-29T01:00:00+00:00")
    assert await decide(runner, db, "berlin-0230", at("2026-03-29T01:05:00+00:00")) == (
        None,
        gap_slot,
    )
    # 2026-10-25: 03:00 -> 02:00. 02:30 happens twice; only the first counts.
    first = at("2026-10-25T02:30:00+02:00")
    second_pass = at("2026-10-25T02:30:00+01:00")
    assert await decide(runner, db, "berlin-0230", second_pass) == (None, first)


async def test_done_slot_is_skipped_and_other_slots_are_not(
    runner: Any, db: asyncpg.Connection
) -> None:
    slot = at("2026-06-01T02:30:00+02:00")
    await db.execute(
        """INSERT INTO cronlock.runs (job, slot, status, trigger, instance)
           VALUES ('berlin-0230', $1, 'succeeded', 'scheduled', 'seed')""",
        slot,
    )
    assert await decide(runner, db, "berlin-0230", slot + timedelta(hours=3)) == (
        "already done",
        slot,
    )
    tomorrow = slot + timedelta(days=1, minutes=1)
    assert await decide(runner, db, "berlin-0230", tomorrow) == (None, slot + timedelta(days=1))


async def test_manual_runs_do_not_count(runner: Any, db: asyncpg.Connection) -> None:
    slot = at("2026-06-02T02:30:00+02:00")
    await db.execute(
        """INSERT INTO cronlock.runs (job, slot, status, trigger, instance)
           VALUES ('berlin-0230', $1, 'succeeded', 'manual', 'seed')""",
        slot,
    )
    assert await decide(runner, db, "berlin-0230", slot) == (None, slot)


async def test_one_succeeded_scheduled_run_per_slot_is_a_database_fact(
    db: asyncpg.Connection,
) -> None:
    insert = """INSERT INTO cronlock.runs (job, slot, status, trigger, instance)
                VALUES ('x', '2026-01-01T00:00:00Z', 'succeeded', $1, 'seed')"""
    await db.execute(insert, "scheduled")
    await db.execute(insert, "manual")
    with pytest.raises(asyncpg.UniqueViolationError):
        await db.execute(insert, "backfill")
