"""Prometheus metrics: exact values after known runs on an instance (in-process), a registry
per app, and a scrape that still answers while the database is down."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime

import asyncpg
import httpx
from prometheus_client import REGISTRY, generate_latest

from cronlock.core.jobs import load
from cronlock.core.metrics import Metrics
from cronlock.core.outcome import Outcome
from cronlock.service import create_app
from cronlock.settings import Settings
from tests.support.asgi import StartApp
from tests.support.metrics import METRICS_TOKEN, scrape, value
from tests.util import post, runs, seen_since, wait_for


async def sleeping_in_sql(db: asyncpg.Connection) -> bool:
    """A cancel reaches only a statement in progress: wait for slow-sql's pg_sleep."""
    return bool(
        await db.fetchval(
            """SELECT EXISTS (SELECT 1 FROM pg_stat_activity
               WHERE state = 'active' AND query LIKE 'SELECT pg_sleep%')"""
        )
    )


async def seed_outbox(db: asyncpg.Connection) -> None:
    await db.execute(
        """INSERT INTO cronlock.email_outbox (job, slot, user_id, sender, recipient, subject,
                                              body, status, created_at)
           VALUES ('daily-digest', now(), 1, 's@x', 'a@x', 's', 'b', 'pending',
                   now() - interval '90 seconds'),
                  ('daily-digest', now(), 2, 's@x', 'b@x', 's', 'b', 'pending', now()),
                  ('daily-digest', now(), 3, 's@x', 'c@x', 's', 'b', 'dead', now()),
                  ('daily-digest', now(), 4, 's@x', 'd@x', 's', 'b', 'sent', now())"""
    )


async def test_metric_values_after_known_runs(
    start_app: StartApp, client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    i = await start_app("metrics", metrics_token=METRICS_TOKEN)
    for job in ("fast", "fast", "fails", "times-out", "yearly", "yearly"):
        await post(client, i.url + f"/cron/{job}")
    accepted = await post(client, i.url + "/cron/slow?wait=false", json={"seconds": 1})
    assert accepted.status_code == 202
    skipped = await post(client, i.url + "/cron/slow", json={"seconds": 0})
    assert skipped.json()["reason"] == "already running"
    # An operator cancels a running statement: recorded (and counted) as cancelled.
    pending = asyncio.create_task(post(client, i.url + "/cron/slow-sql", json={"seconds": 10}))
    await wait_for(lambda: sleeping_in_sql(db), 10, "slow-sql to be in its pg_sleep")
    await db.execute(
        "SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep%'"
    )
    assert (await pending).status_code == 500

    async def slow_done() -> bool:
        return [r["status"] for r in await runs(db, "slow")] == ["succeeded"]

    await wait_for(slow_done, 10, "the accepted slow run to finish")
    await seed_outbox(db)
    now: datetime = await db.fetchval("SELECT now()")
    scheduled = [j.name for j in load(["tests.jobs"]).values() if j.schedule]
    await seen_since(db, *scheduled)  # as if deployed long ago: every job had slots to miss

    m = await scrape(client, i.url)
    runs_total = "cronlock_runs_total"
    assert value(m, runs_total, job="fast", outcome="succeeded") == 2
    assert value(m, runs_total, job="fails", outcome="failed") == 1
    assert value(m, runs_total, job="times-out", outcome="timed_out") == 1
    assert value(m, runs_total, job="yearly", outcome="succeeded") == 1
    assert value(m, runs_total, job="slow", outcome="succeeded") == 1  # "accepted" is no run
    assert value(m, runs_total, job="slow-sql", outcome="cancelled") == 1
    assert value(m, runs_total, job="fast", outcome="failed") == 0  # every series starts at 0
    assert sum(v for (name, _), v in m.items() if name == runs_total) == 7
    skips = "cronlock_skips_total"
    assert value(m, skips, job="yearly", reason="already done") == 1
    assert value(m, skips, job="slow", reason="already running") == 1
    assert sum(v for (name, _), v in m.items() if name == skips) == 2
    hist = "cronlock_run_duration_seconds"
    assert value(m, hist + "_count", job="fast", outcome="succeeded") == 2
    assert value(m, hist + "_count", job="slow", outcome="succeeded") == 1
    assert (value(m, hist + "_sum", job="slow", outcome="succeeded") or 0) >= 1.0
    assert (value(m, hist + "_sum", job="times-out", outcome="timed_out") or 0) >= 0.5
    assert value(m, hist + "_bucket", job="slow", outcome="succeeded", le="0.5") == 0
    assert value(m, hist + "_bucket", job="slow", outcome="succeeded", le="+Inf") == 1

    # Deployment-wide, from the ledger: yearly just succeeded for this year's slot; the other
    # scheduled test jobs never did.
    overdue = "cronlock_job_overdue"
    assert value(m, overdue, job="yearly") == 0
    never_ran = [name for name in scheduled if name != "yearly"]
    assert {"minutely", "late-minutely", "hourly-grace"} <= set(never_ran)
    for job in never_ran:
        assert value(m, overdue, job=job) == 1, job
    assert value(m, overdue, job="fast") is None  # no schedule, nothing to be late for
    assert value(m, "cronlock_overdue_jobs") == len(never_ran)
    year_start = datetime(now.year, 1, 1, tzinfo=UTC).timestamp()
    assert value(m, "cronlock_job_last_success_slot_timestamp_seconds", job="yearly") == year_start
    assert value(m, "cronlock_outbox_depth") == 2
    assert value(m, "cronlock_outbox_due") == 2
    assert (value(m, "cronlock_outbox_oldest_pending_age_seconds") or 0) >= 90
    assert value(m, "cronlock_outbox_dead_rows") == 1
    assert value(m, "cronlock_database_up") == 1
    assert not any(name.endswith("_created") for name, _ in m)


async def test_metrics_answer_while_the_database_is_down(
    start_app: StartApp, client: httpx.AsyncClient
) -> None:
    down = await start_app(
        "down", database_url="postgresql://nobody@127.0.0.1:9/none", metrics_token=METRICS_TOKEN
    )
    r = await post(client, down.url + "/cron/fast")
    assert r.status_code == 503
    m = await scrape(client, down.url)
    assert value(m, "cronlock_database_up") == 0
    assert value(m, "cronlock_runs_total", job="fast", outcome="succeeded") == 0


def test_each_metrics_object_has_its_own_registry() -> None:
    a, b = Metrics(["x"]), Metrics(["x"])
    a.observe(Outcome("x", "succeeded", run_id=1, duration_ms=1500.0))
    a.observe(Outcome("x", "accepted", run_id=2))
    a.observe(Outcome("x", "skipped", reason="already done"))
    labels = {"job": "x", "outcome": "succeeded"}
    assert a.registry.get_sample_value("cronlock_runs_total", labels) == 1
    assert a.registry.get_sample_value("cronlock_run_duration_seconds_sum", labels) == 1.5
    assert (
        a.registry.get_sample_value("cronlock_skips_total", {"job": "x", "reason": "already done"})
        == 1
    )
    assert b.registry.get_sample_value("cronlock_runs_total", labels) == 0
    assert REGISTRY.get_sample_value("cronlock_runs_total", labels) is None
    assert b"cronlock_runs_total" in generate_latest(b.registry)


async def test_two_apps_in_one_process_keep_their_own_metrics(
    make_settings: Callable[..., Settings],
) -> None:
    # Two instances of one deployment in one process, told apart by their names.
    first = create_app(make_settings(instance_name="one"))
    second = create_app(make_settings(instance_name="two"))
    async with (
        first.router.lifespan_context(first) as one,
        second.router.lifespan_context(second) as two,
    ):
        assert one is not None
        assert two is not None
        m1, m2 = one["runner"].metrics, two["runner"].metrics
        assert m1 is not None
        assert m2 is not None
        assert m1.registry is not m2.registry
        m1.observe(Outcome("fast", "failed", run_id=1, duration_ms=1.0))
        labels = {"job": "fast", "outcome": "failed"}
        assert m1.registry.get_sample_value("cronlock_runs_total", labels) == 1
        assert m2.registry.get_sample_value("cronlock_runs_total", labels) == 0
