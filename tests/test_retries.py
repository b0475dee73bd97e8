"""Retries cronlock owns (cronlock/core/retries.py): one ledger row per attempt, for the same slot,
by any instance; a trigger during an attempt is still "already running"; manual runs are not
retried; retries end when they run out."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import asyncpg
import pytest

from cronlock.settings import Settings
from tests.support.asgi import StartApp
from tests.util import AUTH, own_runner, post, wait_for

FAST_RETRIES = {"cron_jobs": "tests.own_jobs", "retry_poll_interval": 0.1}


async def attempts(db: asyncpg.Connection, job: str) -> list[asyncpg.Record]:
    return await db.fetch(
        "SELECT id, slot, status, attempt, retry_of, trigger, source, instance"
        " FROM cronlock.runs WHERE job = $1 ORDER BY id",
        job,
    )


async def test_fails_twice_then_succeeds_three_rows_for_the_slot(
    start_app: StartApp, client: Any, db: asyncpg.Connection
) -> None:
    a = await start_app("a", **FAST_RETRIES)
    b = await start_app("b", **FAST_RETRIES)
    first = await post(client, a.url + "/cron/flaky")
    assert first.status_code == 500  # attempt 1 failed: the scheduler is told
    # /cron/jobs says it is failing and when the retry comes.
    jobs = {
        j["name"]: j for j in (await client.get(b.url + "/cron/jobs", headers=AUTH)).json()["jobs"]
    }
    retry = jobs["flaky"]["retry"]
    assert retry is not None, jobs["flaky"]
    assert retry["summary"].startswith("failing, retry 1 of 3 at ")
    assert retry["last_run_id"] == first.json()["run_id"]

    async def running_attempt() -> bool:
        return bool(
            await db.fetchval(
                "SELECT count(*) FROM cronlock.runs WHERE job = 'flaky' AND status = 'running'"
                " AND attempt > 1"
            )
        )

    await wait_for(running_attempt, 10, "a retry to start")
    # A trigger during a retry's attempt: "already running", as for any run.
    during = await post(client, b.url + "/cron/flaky")
    assert during.json()["reason"] == "already running"

    async def done() -> bool:
        rows = await attempts(db, "flaky")
        return bool(rows) and rows[-1]["status"] == "succeeded"

    await wait_for(done, 15, "the third attempt to succeed")
    await asyncio.sleep(0.5)  # no fourth attempt follows
    rows = await attempts(db, "flaky")
    assert [r["attempt"] for r in rows] == [1, 2, 3]
    assert [r["status"] for r in rows] == ["failed", "failed", "succeeded"]
    assert len({r["slot"] for r in rows}) == 1
    assert rows[1]["retry_of"] == rows[0]["id"]
    assert rows[2]["retry_of"] == rows[1]["id"]
    assert [r["source"] for r in rows] == ["http", "retry", "retry"]
    jobs = (await client.get(a.url + "/cron/jobs", headers=AUTH)).json()["jobs"]
    assert next(j for j in jobs if j["name"] == "flaky")["retry"] is None


async def test_manual_runs_are_not_retried_and_retries_run_out(
    start_app: StartApp, client: Any, db: asyncpg.Connection
) -> None:
    a = await start_app("a", **FAST_RETRIES)
    manual = await post(client, a.url + "/cron/always-fails?force=true")
    assert manual.status_code == 500
    await asyncio.sleep(0.6)
    assert len(await attempts(db, "always-fails")) == 1  # not retried
    scheduled = await post(client, a.url + "/cron/always-fails")
    assert scheduled.status_code == 500

    async def exhausted() -> bool:
        return len(await attempts(db, "always-fails")) == 4  # manual + 1 + 2 retries

    await wait_for(exhausted, 10, "two retries")
    await asyncio.sleep(1.0)  # 0.2 s, 0.4 s, then none: retries=2
    rows = await attempts(db, "always-fails")
    assert [r["attempt"] for r in rows] == [1, 1, 2, 3]
    assert {r["status"] for r in rows} == {"failed"}
    jobs = (await client.get(a.url + "/cron/jobs", headers=AUTH)).json()["jobs"]
    assert next(j for j in jobs if j["name"] == "always-fails")["retry"] is None


async def test_a_paused_job_is_not_retried(
    start_app: StartApp, client: Any, db: asyncpg.Connection
) -> None:
    a = await start_app("a", **FAST_RETRIES)
    assert (await post(client, a.url + "/cron/always-fails")).status_code == 500
    await post(client, a.url + "/cron/jobs/always-fails/pause")
    await asyncio.sleep(0.8)
    assert len(await attempts(db, "always-fails")) == 1
    await post(client, a.url + "/cron/jobs/always-fails/resume")

    async def retried() -> bool:
        return len(await attempts(db, "always-fails")) > 1

    await wait_for(retried, 10, "the retry after resume")


async def test_the_same_retry_is_made_once(
    make_settings: Callable[..., Settings], db: asyncpg.Connection
) -> None:
    """Two instances that both saw a failed attempt as due: the second to get the lock finds
    the retry made (checked under the lock) and skips, even after the first one ended."""
    from cronlock.core import ledger, retries

    settings = make_settings(cron_jobs="tests.own_jobs")
    async with own_runner(settings) as runner:
        job = runner.registry["always-fails"]
        assert (await runner.trigger(job)).kind == "failed"
        now = await db.fetchval("SELECT now() + interval '1 minute'")  # past the delay
        async with runner.db.connection() as conn:
            # A window of two hours: the hourly job's slot began up to an hour before now (a
            # one-hour window failed this test in the last minute of every hour).
            found = await retries.pending(conn, runner.registry, now, 7200)
        failed = found["always-fails"][0].failed
        first = await retries.run(runner, job, failed)
        second = await retries.run(runner, job, failed)
        assert first is not None
        assert first.kind == "failed"
        assert second is not None
        assert (second.kind, second.reason) == ("skipped", "already retried")
        rows = await ledger.list_runs(db, "cronlock", job="always-fails")
        assert sorted(r.attempt for r in rows) == [1, 2]


async def test_a_retry_that_cannot_be_made_is_said_once_and_a_paused_jobs_retries_wait(
    make_settings: Callable[..., Settings],
    db: asyncpg.Connection,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A failed run whose slot is no tick of the schedule any more (it changed in a deploy):
    its retry is refused, and said once, not at every pass of the loop. A paused job's due
    retry waits without a word (and without an outcome) at every pass."""
    from cronlock.core import pause, retries

    settings = make_settings(cron_jobs="tests.own_jobs")
    async with own_runner(settings) as runner:
        schedule = runner.registry["always-fails"].schedule
        assert schedule is not None
        now = await db.fetchval("SELECT now()")
        seed = (
            "INSERT INTO cronlock.runs (job, slot, status, trigger, instance, started_at,"
            " finished_at) VALUES ('always-fails', $1, 'failed', 'scheduled', 'gone',"
            " now() - interval '1 minute', now() - interval '1 minute') RETURNING id"
        )
        stale = await db.fetchval(seed, schedule.prev_tick(now) - timedelta(minutes=30))
        refused: set[int] = set()
        with caplog.at_level("INFO", logger="cronlock"):
            assert await retries.retry_once(runner, refused) == []
            assert await retries.retry_once(runner, refused) == []
        said = [r for r in caplog.records if f"cannot retry run {stale}" in r.getMessage()]
        assert len(said) == 1
        assert refused == {stale}
        await db.execute("DELETE FROM cronlock.runs")
        await db.fetchval(seed, schedule.prev_tick(now))
        await pause.pause(db, "cronlock", "always-fails", by="test")
        caplog.clear()
        with caplog.at_level("INFO", logger="cronlock"):
            assert await retries.retry_once(runner, refused) == []
        assert not [r for r in caplog.records if "always-fails" in r.getMessage()]
        assert await db.fetchval("SELECT count(*) FROM cronlock.runs") == 1


def test_the_retry_delay_doubles_and_no_retry_starts_past_max_lateness() -> None:
    """docs/triggering.md: the delay doubles after each failed attempt; a retry that would
    start later than `max_lateness` after its slot is not made; past `retries`, none."""
    from dataclasses import replace
    from datetime import UTC, datetime, timedelta

    from cronlock.core import retries
    from cronlock.core.jobs import Job
    from cronlock.core.ledger import Run

    async def nothing(ctx: Any) -> None:
        return None

    job = Job("flaky", nothing, retries=3, retry_delay=10.0, max_lateness=100.0)
    assert [retries.delay(job, n) for n in (1, 2, 3)] == [10.0, 20.0, 40.0]
    slot = datetime(2026, 12, 3, 7, 0, tzinfo=UTC)
    failed = Run(
        id=1, job="flaky", key=None, slot=slot, status="failed", trigger="scheduled",
        source="http", instance="i1", backend_pid=None, started_at=slot,
        finished_at=slot + timedelta(seconds=5), duration_ms=5000.0, params=None, result=None,
        error="x",
    )  # fmt: skip
    first = retries.verdict(job, failed, now=slot + timedelta(seconds=6))
    assert (first.why, first.at) == ("waiting", slot + timedelta(seconds=15))
    due = retries.verdict(job, failed, now=slot + timedelta(seconds=15))
    assert due.why == "due"
    third = replace(failed, attempt=3, finished_at=slot + timedelta(seconds=70))
    assert retries.verdict(job, third, now=slot + timedelta(seconds=70)).why == "too late"
    exhausted = replace(failed, attempt=4)
    assert retries.verdict(job, exhausted, now=slot).why == "exhausted"
    # Started within the early tolerance and failed before its slot: the retry waits for the
    # slot (a backfill of a slot still to come is refused; it was said once and never made).
    early = replace(
        failed, started_at=slot - timedelta(seconds=5), finished_at=slot - timedelta(seconds=4)
    )
    waits = retries.verdict(job, early, now=slot - timedelta(seconds=3))
    assert (waits.why, waits.at) == ("waiting", slot + timedelta(seconds=6))
    before = replace(early, finished_at=slot - timedelta(seconds=30))
    assert (retries.verdict(job, before, now=slot - timedelta(seconds=1)).why) == "waiting"
    assert retries.verdict(job, before, now=slot).why == "due"
