"""The schedules' kept counts (migration 0020, cronlock/core/schedules.py `stats`): every way a
row comes, goes, pauses or moves keeps them equal to a count of the rows, under concurrent
writers and compactions, and rolled-back writes leave them alone."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import asyncpg
import pytest

from cronlock import Cronlock
from cronlock.core import schedules
from cronlock.core.jobs import Job
from cronlock.settings import Settings

JOBS = "tests.dynamic_jobs"
TRUTH_SQL = """
SELECT j.job, count(s.key) AS schedules, count(*) FILTER (WHERE s.paused) AS paused,
       count(*) FILTER (WHERE NOT s.paused AND s.due_at <= now()) AS due,
       count(*) FILTER (WHERE NOT s.paused AND s.due_at <= now() - make_interval(secs => j.grace))
           AS late
FROM unnest($1::text[], $2::float8[]) AS j(job, grace)
LEFT JOIN cronlock.schedules AS s ON s.job = j.job
GROUP BY j.job
"""


@pytest.fixture
def cron(make_settings: Callable[..., Settings]) -> Cronlock:
    return Cronlock(make_settings(cron_jobs=JOBS), housekeeping=False)


def dynamic(cron: Cronlock) -> list[Job]:
    return [j for j in cron.jobs.values() if j.dynamic]


async def truth(db: asyncpg.Connection, jobs: list[Job]) -> dict[str, dict[str, int]]:
    rows = await db.fetch(TRUTH_SQL, [j.name for j in jobs], [j.grace for j in jobs])
    return {r["job"]: {k: int(r[k]) for k in ("schedules", "paused", "due", "late")} for r in rows}


async def deltas(db: asyncpg.Connection) -> int:
    return int(await db.fetchval("SELECT count(*) FROM cronlock.schedule_counts"))


async def test_counts_follow_every_kind_of_write(cron: Cronlock, db: asyncpg.Connection) -> None:
    jobs = dynamic(cron)
    assert await schedules.stats(db, "cronlock", jobs) == await truth(db, jobs)
    for key in range(20):
        await cron.schedules.set(db, "tenant-report", key, every=60, paused=key % 4 == 0)
        await cron.schedules.set(db, "user-digest", f"u{key}", every=60)
    await cron.schedules.set(db, "tenant-report", 1, every=30)  # replaced: no new row
    await cron.schedules.pause(db, "tenant-report", 2)
    await cron.schedules.resume(db, "tenant-report", 4)
    await cron.schedules.remove(db, "user-digest", "u3")
    await cron.schedules.remove(db, "user-digest", "nobody")
    async with db.transaction():  # a bulk statement: one delta row per job
        await db.execute(
            "UPDATE cronlock.schedules SET paused = true WHERE job = 'user-digest'"
            " AND key LIKE 'u1%'"
        )
        await db.execute("DELETE FROM cronlock.schedules WHERE job = 'user-digest' AND key = 'u5'")
    tx = db.transaction()
    await tx.start()
    await cron.schedules.set(db, "tenant-report", 100, every=60)
    await cron.schedules.remove(db, "tenant-report", 3)
    await tx.rollback()
    # Due now, and late (past the grace): counted from the rows themselves.
    await db.execute(
        "UPDATE cronlock.schedules SET due_at = now() - interval '1 hour'"
        " WHERE job = 'tenant-report' AND key IN ('5', '6', '8')"
    )
    await db.execute(
        "UPDATE cronlock.schedules SET due_at = now() - interval '1 second'"
        " WHERE job = 'tenant-report' AND key = '7'"
    )
    expected = await truth(db, jobs)
    assert expected["tenant-report"] == {"schedules": 20, "paused": 5, "due": 3, "late": 2}
    assert expected["user-digest"]["paused"] == 11  # u1, u10-u19
    assert await schedules.stats(db, "cronlock", jobs) == expected

    assert await deltas(db) > 2
    await schedules.compact_counts(db, "cronlock")
    assert await deltas(db) == 2
    assert await schedules.stats(db, "cronlock", jobs) == expected
    await db.execute("TRUNCATE cronlock.schedules")
    assert await schedules.stats(db, "cronlock", jobs) == await truth(db, jobs)
    assert (await schedules.stats(db, "cronlock", jobs))["tenant-report"]["schedules"] == 0


async def test_counts_exact_under_concurrent_writers_and_compactions(
    cron: Cronlock, db: asyncpg.Connection, database_url: str
) -> None:
    """Four writers setting, pausing and removing random keys in their own transactions (some
    rolled back), two compacting at the same time: the counts end equal to the rows."""
    jobs = dynamic(cron)
    rng = random.Random(24)
    stop = asyncio.Event()

    async def writer(seed: int) -> None:
        own = random.Random(seed)
        conn = await asyncpg.connect(database_url)
        try:
            for _ in range(150):
                key = own.randrange(40)
                tx = conn.transaction()
                await tx.start()
                op = own.random()
                if op < 0.5:
                    await cron.schedules.set(
                        conn, "tenant-report", key, every=60, paused=own.random() < 0.3
                    )
                elif op < 0.7:
                    await cron.schedules.pause(conn, "tenant-report", key)
                else:
                    await cron.schedules.remove(conn, "tenant-report", key)
                if own.random() < 0.2:
                    await tx.rollback()
                else:
                    await tx.commit()
        finally:
            await conn.close()

    async def compactor() -> None:
        conn = await asyncpg.connect(database_url)
        try:
            while not stop.is_set():
                await schedules.compact_counts(conn, "cronlock")
                await asyncio.sleep(0.005)
        finally:
            await conn.close()

    compactors = [asyncio.create_task(compactor()) for _ in range(2)]
    await asyncio.gather(*(writer(rng.randrange(10**6)) for _ in range(4)))
    stop.set()
    await asyncio.gather(*compactors)
    expected = await truth(db, jobs)
    assert expected["tenant-report"]["schedules"] > 0
    assert await schedules.stats(db, "cronlock", jobs) == expected
