"""Housekeeping: the built-in `ledger-prune` job, and catching up a missed slot once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import asyncpg
import httpx

from cronlock.core import catchup
from cronlock.core.due import due_slot
from cronlock.core.jobs import load
from cronlock.core.runner import Runner
from cronlock.db.pool import Database
from cronlock.settings import Settings
from tests.support.asgi import StartApp
from tests.support.metrics import METRICS_TOKEN, scrape, value
from tests.util import AUTH, effects, post, runs, seen_since, wait_for

Starter = Callable[..., Any]
HOUSEKEEPING = {"CRON_JOBS": "tests.jobs,cronlock.housekeeping", "LEDGER_RETENTION_DAYS": "30"}


async def seed(db: asyncpg.Connection, job: str, status: str, age: timedelta) -> int:
    run_id = await db.fetchval(
        """INSERT INTO cronlock.runs (job, status, trigger, instance, backend_pid, started_at)
           VALUES ($1, $2, 'scheduled', 'seeded', 999999, now() - $3::interval) RETURNING id""",
        job,
        status,
        age,
    )
    assert isinstance(run_id, int)
    return run_id


def test_housekeeping_is_in_the_default_jobs() -> None:
    settings = Settings(_env_file=None)
    assert settings.job_modules == ["cronlock.demo.digest", "cronlock.housekeeping"]
    registry = load(settings.job_modules)
    prune = registry["ledger-prune"]
    assert prune.schedule is not None
    assert prune.schedule.expr == "17 3 * * *"
    assert prune.catch_up is True
    assert set(registry) == {"daily-digest", "ledger-prune"}


async def test_ledger_prune_keeps_the_retention_and_closes_abandoned_rows(
    start_app: StartApp, client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    days = timedelta(days=1)
    old_ok = await seed(db, "fast", "succeeded", 40 * days)
    old_failed = await seed(db, "fails", "failed", 40 * days)
    old_running = await seed(db, "slow", "running", 40 * days)  # its instance died long ago
    young_ok = await seed(db, "fast", "succeeded", 10 * days)
    young_running = await seed(db, "slow-sql", "running", timedelta(minutes=5))

    # ledger-prune, deployed long ago, catches up its missed night as soon as the instance
    # sees the database.
    await seen_since(db, "ledger-prune")
    i = await start_app("keeper", cron_jobs=HOUSEKEEPING["CRON_JOBS"], ledger_retention_days=30)

    async def pruned() -> bool:
        return any(r["status"] == "succeeded" for r in await runs(db, "ledger-prune"))

    await wait_for(pruned, 15, "ledger-prune to be caught up")
    [prune] = await runs(db, "ledger-prune")
    assert (prune["trigger"], prune["source"], prune["instance"]) == (
        "backfill",
        "catch-up",
        "keeper",
    )
    assert prune["result"] == {"pruned": 3, "abandoned": 2, "retention_days": 30.0}
    left = {r["id"]: r["status"] for r in await db.fetch("SELECT id, status FROM cronlock.runs")}
    assert left == {young_ok: "succeeded", young_running: "abandoned", prune["id"]: "succeeded"}
    assert not {old_ok, old_failed, old_running} & set(left)

    # A scheduled trigger finds its slot done when it is the one caught up; forced, it runs
    # again as a manual run with nothing left to do.
    job = load(["cronlock.housekeeping"])["ledger-prune"]
    assert job.schedule is not None
    now: datetime = await db.fetchval("SELECT now()")
    answer = (await post(client, i.url + "/cron/ledger-prune")).json()
    if job.schedule.prev_tick(now) == prune["slot"]:
        assert answer["reason"] == "already done"
    else:  # between 03:17 and the end of its grace: the caught-up slot was yesterday's
        assert answer["processed"]["pruned"] == 0
    forced = (await post(client, i.url + "/cron/ledger-prune?force=true")).json()
    assert forced["processed"] == {"pruned": 0, "abandoned": 0, "retention_days": 30.0}


async def test_a_fresh_install_has_missed_nothing(
    start_app: StartApp, client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """A fresh install's ledger-prune (and any new job) starts its history when an instance
    first sees the database: last night's slot is neither overdue nor caught up."""
    i = await start_app(
        "fresh",
        cron_jobs=HOUSEKEEPING["CRON_JOBS"],
        catch_up_interval=0.2,
        metrics_token=METRICS_TOKEN,
    )
    await asyncio.sleep(1.0)  # a few catch-up passes
    assert await runs(db, "ledger-prune") == []
    view = (await client.get(i.url + "/cron/jobs", headers=AUTH)).json()
    prune = next(j for j in view["jobs"] if j["name"] == "ledger-prune")
    assert prune["first_seen"] is not None
    assert prune["due_slot"] < prune["first_seen"]
    assert prune["overdue"] is False
    m = await scrape(client, i.url)
    assert value(m, "cronlock_job_overdue", job="ledger-prune") == 0
    assert value(m, "cronlock_job_overdue", job="yearly") == 0


async def test_a_missed_slot_is_caught_up_once_across_instances(
    start_instances: Callable[..., list[Any]], db: asyncpg.Connection
) -> None:
    env = {"CRON_JOBS": "tests.jobs,tests.catchup_jobs", "CATCH_UP_INTERVAL": "0.5"}
    await seen_since(db, "catch-up-daily", "yearly")  # an old deployment's jobs
    instances = start_instances(["c0", "c1", "c2"], env)

    async def caught_up() -> bool:
        return bool(await runs(db, "catch-up-daily"))

    await wait_for(caught_up, 15, "the missed slot to be caught up")
    await asyncio.sleep(1.5)  # every instance has had its first look by now
    [row] = await runs(db, "catch-up-daily")
    assert row["status"] == "succeeded"
    assert (row["trigger"], row["source"]) == ("backfill", "catch-up")
    assert row["instance"] in {i.name for i in instances}
    assert row["result"] == "backfill"
    assert await effects(db, "catch-up-daily") == 1

    # The instances keep looking, every CATCH_UP_INTERVAL: a slot whose attempt is gone from
    # the ledger (deleted by hand) is missed again, and made up once more.
    await db.execute("DELETE FROM cronlock.runs WHERE job = 'catch-up-daily'")
    await wait_for(caught_up, 5, "the slot to be caught up again")
    await asyncio.sleep(1.5)
    assert len(await runs(db, "catch-up-daily")) == 1
    assert await effects(db, "catch-up-daily") == 2
    # Jobs that did not opt in stay overdue and are never replayed.
    assert await runs(db, "yearly") == []


async def test_an_attempted_slot_is_not_caught_up(
    make_settings: Callable[..., Settings], db: asyncpg.Connection
) -> None:
    """A slot whose run failed was not missed: it stays overdue for a person to look at."""
    settings = make_settings(cron_jobs="tests.catchup_jobs")
    registry = load(settings.job_modules)
    job = registry["catch-up-daily"]
    now: datetime = await db.fetchval("SELECT now()")
    due = due_slot(job, now)
    await seen_since(db, "catch-up-daily")  # deployed before the slot: it could be missed
    await db.execute(
        """INSERT INTO cronlock.runs (job, slot, status, trigger, instance)
           VALUES ('catch-up-daily', $1, 'failed', 'scheduled', 'earlier')""",
        due,
    )
    database = Database(settings)
    await database.open()
    try:
        await database.check(apply_migrations=False)
        runner = Runner(settings, registry, database)
        assert await catchup.catch_up(runner) == []
    finally:
        await database.close()
    assert [r["status"] for r in await runs(db, "catch-up-daily")] == ["failed"]


def test_missed_slot_rules() -> None:
    job = load(["tests.catchup_jobs"])["catch-up-daily"]
    assert job.schedule is not None
    midnight = datetime.fromisoformat("2026-06-10T00:00:00+00:00")
    window = 7 * 86400.0
    # Within the grace (60 s) the day before is what is due; it succeeded.
    yesterday = midnight - timedelta(days=1)
    seen = midnight - timedelta(days=30)  # deployed a month ago
    at = midnight + timedelta(seconds=30)
    assert catchup.missed_slot(job, at, yesterday, seen, window) is None
    at = midnight + timedelta(seconds=61)
    assert catchup.missed_slot(job, at, yesterday, seen, window) == midnight
    at = midnight + timedelta(hours=5)
    assert catchup.missed_slot(job, at, midnight, seen, window) is None
    # Too old to backfill: left for a person.
    assert catchup.missed_slot(job, at, None, seen, 3600.0) is None
    # Never run: missed, once deployed before the slot; not when first seen after it (a job
    # deployed at 00:30 missed nothing at midnight), nor when never seen at all.
    assert catchup.missed_slot(job, at, None, seen, window) == midnight
    assert catchup.missed_slot(job, at, None, midnight, window) == midnight
    assert catchup.missed_slot(job, at, None, midnight + timedelta(minutes=30), window) is None
    assert catchup.missed_slot(job, at, None, None, window) is None
