"""Small helpers shared by the tests that drive real instances."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import asyncpg
import httpx

from cronlock.db.lock import LockKey, lock_key, lock_text
from tests.support import TEST_SECRET

if TYPE_CHECKING:
    from cronlock.core.runner import Runner
    from cronlock.settings import Settings

AUTH = {"Authorization": f"Bearer {TEST_SECRET}"}


@contextlib.asynccontextmanager
async def own_runner(settings: Settings) -> AsyncIterator[Runner]:
    """A Runner over a Database of its own (opened, its migrations checked, never applied),
    closed afterwards: for tests that drive the runner, the retries or catch-up directly."""
    from cronlock.core.jobs import load
    from cronlock.core.runner import Runner
    from cronlock.db.pool import Database

    database = Database(settings)
    await database.open()
    try:
        await database.check(apply_migrations=False)
        yield Runner(settings, load(settings.job_modules), database)
    finally:
        await database.close()


async def post(
    client: httpx.AsyncClient, url: str, *, json: Any = None, headers: dict[str, str] | None = None
) -> httpx.Response:
    return await client.post(url, json=json, headers=headers if headers is not None else AUTH)


async def effects(db: asyncpg.Connection, job: str | None = None) -> int:
    """How many effects the test jobs committed (0 if no job ever committed one)."""
    if not await db.fetchval("SELECT to_regclass('job_effects') IS NOT NULL"):
        return 0
    count = await db.fetchval(
        "SELECT count(*) FROM job_effects WHERE $1::text IS NULL OR job = $1", job
    )
    return int(count)


def job_key(job: str, namespace: int = 0, schema: str = "cronlock") -> LockKey:
    """The advisory key of a job in a deployment (DB_SCHEMA, LOCK_NAMESPACE)."""
    return lock_key(lock_text(schema, job), namespace)


async def lock_held(db: asyncpg.Connection, job: str, namespace: int = 0) -> bool:
    key = job_key(job, namespace)
    held = await db.fetchval(
        """SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted
           AND classid = $1 AND objid = $2 AND objsubid = 1)""",
        key.classid,
        key.objid,
    )
    return bool(held)


async def lock_free(db: asyncpg.Connection, job: str, namespace: int = 0) -> bool:
    return not await lock_held(db, job, namespace)


async def wait_for(
    check: Callable[[], Awaitable[bool]], within: float, what: str, interval: float = 0.05
) -> float:
    """Poll until `check` is true; returns the seconds it took, fails after `within` s."""
    start = time.monotonic()
    while True:
        if await check():
            return time.monotonic() - start
        if time.monotonic() - start > within:
            raise AssertionError(f"timed out after {within} s waiting for {what}")
        await asyncio.sleep(interval)


async def successor(db: asyncpg.Connection, run_id: int, within: float) -> asyncpg.Record:
    """The attempt that took lease run `run_id` over (`retry_of`), once there is one: its
    `id`, `instance` and `started_at`."""
    found: asyncpg.Record | None = None

    async def taken_over() -> bool:
        nonlocal found
        found = await db.fetchrow(
            "SELECT id, instance, started_at FROM cronlock.runs WHERE retry_of = $1", run_id
        )
        return found is not None

    await wait_for(taken_over, within, f"a takeover of run {run_id}")
    assert found is not None
    return found


async def runs(db: asyncpg.Connection, job: str) -> list[dict[str, Any]]:
    """The job's ledger rows, oldest first, with the JSON columns decoded."""
    rows = await db.fetch("SELECT * FROM cronlock.runs WHERE job = $1 ORDER BY id", job)
    decoded = []
    for row in rows:
        item = dict(row)
        for column in ("params", "result"):
            if isinstance(item[column], str):
                item[column] = json.loads(item[column])
        decoded.append(item)
    return decoded


async def seen_since(
    db: asyncpg.Connection, *jobs: str, ago: timedelta = timedelta(days=400)
) -> None:
    """Set back when the database first saw `jobs` (`jobs_seen`), as if deployed `ago` (over a
    year by default, so a yearly job has had a slot to miss): a job's history starts there, so
    only slots after it can be missed or overdue (core/due.py)."""
    await db.execute(
        """INSERT INTO cronlock.jobs_seen (job, first_seen_at)
           SELECT unnest($1::text[]), now() - $2::interval
           ON CONFLICT (job) DO UPDATE SET first_seen_at = excluded.first_seen_at""",
        list(jobs),
        ago,
    )
