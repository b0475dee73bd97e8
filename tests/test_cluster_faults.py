"""Faults against a real cluster: PgBouncer (transaction mode), 3 uvicorn instances, nginx.

One cluster for the whole module on the session's PostgreSQL (a database of its own). Every
test ends with the same checks: no effect committed twice, nothing committed lost, no lock,
transaction or waiting client left behind, and the instances that were not the victim still
serve without having been restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from tests.support.cluster import Cluster, Instance
from tests.support.faults import (
    CLUSTER_ENV,
    DB_TIMEOUT_MARGIN,
    GRACEFUL_SHUTDOWN_TIMEOUT,
    LEAKS,
    assert_clean_error,
    check_books,
    gate,
    heal,
    reset,
    settle,
    wait_ready,
)
from tests.util import AUTH, effects, lock_held, post, runs, wait_for

pytestmark = pytest.mark.cluster

STORM = 1000


@pytest.fixture
def database_url(module_database_url: str) -> str:
    """The module's database: its cluster runs on it, `db` looks at it straight."""
    return module_database_url


@pytest.fixture(scope="module")
def cluster(make_cluster: Callable[..., Cluster], module_database_url: str) -> Cluster:
    return make_cluster(module_database_url)


@pytest.fixture(autouse=True)
async def _fresh(
    cluster: Cluster, db: asyncpg.Connection, report_logs: Callable[[list[Instance]], None]
) -> AsyncIterator[None]:
    report_logs(cluster.instances)
    heal(cluster)
    await reset(db)
    yield
    # A PgBouncer that crashed (1.18 and cancel requests) fails the test with its log.
    assert cluster.pgbouncer is not None
    cluster.pgbouncer.check_alive()


def pids(instances: list[Instance]) -> list[int]:
    return [i.pid for i in instances]


async def still_serving(client: httpx.AsyncClient, instances: list[Instance]) -> None:
    """Each instance runs a job: the service recovered without being restarted."""
    for instance in instances:
        r = await post(client, instance.url + "/cron/fast")
        assert r.status_code == 200, r.text
        assert r.json()["processed"] == 1


async def _not(check: Any) -> bool:
    return not await check


async def lock_free(db: asyncpg.Connection, job: str) -> bool:
    return not await lock_held(db, job)


# --- the storm ----------------------------------------------------------------------------


async def test_storm_of_1000_triggers_runs_the_job_once(
    cluster: Cluster, db: asyncpg.Connection, database_url: str
) -> None:
    """1,000 concurrent triggers of one slow job, through nginx and at each instance."""
    assert cluster.nginx is not None
    per_instance = STORM // 10  # 700 through nginx, 100 straight at each instance
    urls = [cluster.nginx.url] * (STORM - per_instance * len(cluster.instances))
    urls += [i.url for i in cluster.instances for _ in range(per_instance)]
    random.shuffle(urls)
    assert len(urls) == STORM
    # One client per target: httpx looks for a free connection by scanning its pool, so one
    # client holding 1,000 connections costs more CPU than the cluster it is testing.
    limits = httpx.Limits(max_connections=STORM, max_keepalive_connections=0)
    clients = {url: httpx.AsyncClient(timeout=60, limits=limits) for url in set(urls)}
    started = time.monotonic()
    try:
        async with gate(database_url):
            tasks = [
                asyncio.create_task(post(clients[url], url + "/cron/gated", json={}))
                for url in urls
            ]
            # Everybody but the winner answers while the winner waits at the gate.
            answered, all_but_one = Counter[str](), asyncio.Event()

            def count(_: object) -> None:
                answered["n"] += 1
                if answered["n"] >= STORM - 1:
                    all_but_one.set()

            for task in tasks:
                task.add_done_callback(count)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(all_but_one.wait(), 60)
            answered_in = time.monotonic() - started
            waiting = [t for t in tasks if not t.done()]
            assert len(waiting) == 1, f"{len(waiting)} still waiting after {answered_in:.1f}s"
            assert await lock_held(db, "gated")
        answers = await asyncio.gather(*tasks)
    finally:
        for each in clients.values():
            await each.aclose()
    statuses = Counter(a.status_code for a in answers)
    assert statuses == {200: STORM}, statuses
    bodies = [a.json() for a in answers]
    ran = [b for b in bodies if "processed" in b]
    assert len(ran) == 1, ran
    reasons = Counter(b.get("reason") for b in bodies if b.get("skipped"))
    assert reasons == {"already running": STORM - 1}
    assert waiting[0].result().json()["processed"] == 1
    assert await effects(db, "gated") == 1
    assert [r["status"] for r in await runs(db, "gated")] == ["succeeded"]
    await check_books(db, answers)
    await settle(db, cluster)
    # Bounded, and far from the 60 s client timeout (about 3 s on 2 cores).
    assert answered_in < 30, f"{STORM - 1} skips took {answered_in:.1f}s"


# --- the holder dies or freezes -------------------------------------------------------------


async def test_killed_holder_frees_the_lock_through_pgbouncer(
    cluster: Cluster, db: asyncpg.Connection, client: httpx.AsyncClient
) -> None:
    victim, *survivors = cluster.instances
    before = pids(survivors)
    running = asyncio.create_task(post(client, victim.url + "/cron/slow-sql", json={"seconds": 30}))
    await wait_for(lambda: lock_held(db, "slow-sql"), 10, "the victim to take the lock")
    victim.kill()
    # PgBouncer closes the server connection of a client that vanished mid-transaction.
    freed = await wait_for(lambda: _not(lock_held(db, "slow-sql")), 10, "the lock to free")
    with pytest.raises(httpx.HTTPError):
        await running
    r = await post(client, survivors[0].url + "/cron/slow-sql", json={"seconds": 0})
    assert r.status_code == 200, r.text
    assert r.json()["processed"] == 1
    again = await post(client, survivors[1].url + "/cron/slow-sql", json={"seconds": 0})
    assert again.json()["processed"] == 1
    # The victim's effect rolled back with its transaction: the survivors' two remain.
    assert await effects(db, "slow-sql") == 2

    # The ledger tells the truth once someone looks: the victim's run is `abandoned`.
    async def closed() -> bool:
        await client.get(survivors[0].url + "/cron/runs?job=slow-sql", headers=AUTH)
        return "running" not in {row["status"] for row in await runs(db, "slow-sql")}

    await wait_for(closed, 10, "the victim's run to be closed")
    statuses = sorted(row["status"] for row in await runs(db, "slow-sql"))
    assert statuses == ["abandoned", "succeeded", "succeeded"]
    assert freed < 5
    await check_books(db, [r, again])
    await settle(db, cluster)
    assert pids(survivors) == before
    await still_serving(client, survivors)


async def test_frozen_holder_loses_the_lock_and_commits_nothing(
    cluster: Cluster, db: asyncpg.Connection, client: httpx.AsyncClient
) -> None:
    frozen, other, _ = cluster.instances
    # `held` has timeout 2: the database ends its transaction 2 + DB_TIMEOUT_MARGIN s after
    # the last statement, whatever the instance does.
    bound = 2 + DB_TIMEOUT_MARGIN
    pending = asyncio.create_task(post(client, frozen.url + "/cron/held", json={"seconds": 4}))
    await wait_for(lambda: lock_held(db, "held"), 10, "the lock to be taken")
    frozen.freeze()
    started = time.monotonic()
    try:
        await wait_for(
            lambda: _not(lock_held(db, "held")), bound + 5, "the database to free the lock"
        )
        freed_after = time.monotonic() - started
        r = await post(client, other.url + "/cron/held", json={"seconds": 0})
        assert r.status_code == 200, r.text
        assert r.json()["processed"] == 1
    finally:
        frozen.thaw()
    answer = await pending
    body = assert_clean_error(answer, (500, 504))
    assert isinstance(body.get("run_id"), int), body
    assert await effects(db, "held") == 1
    statuses = Counter(row["status"] for row in await runs(db, "held"))
    assert statuses["succeeded"] == 1
    assert statuses["failed"] + statuses["timed_out"] == 1, statuses
    assert freed_after < bound + 1.5
    await check_books(db, [r])
    await settle(db, cluster)
    await still_serving(client, cluster.instances)


# --- the job misbehaves ---------------------------------------------------------------------


async def test_job_sql_failing_midway_leaves_nothing(
    cluster: Cluster, db: asyncpg.Connection, client: httpx.AsyncClient
) -> None:
    assert cluster.nginx is not None
    answers = [await post(client, cluster.nginx.url + "/cron/sql-fails") for _ in range(3)]
    run_ids = set()
    for answer in answers:
        body = assert_clean_error(answer, (500,))
        assert body["error"] == "job failed"
        run_ids.add(body["run_id"])
    # The aborted transaction took the lock with it: each trigger ran (and failed) anew.
    assert len(run_ids) == 3
    assert await effects(db, "sql-fails") == 0
    assert [row["status"] for row in await runs(db, "sql-fails")] == ["failed"] * 3
    await check_books(db, answers)
    await settle(db, cluster)
    await still_serving(client, cluster.instances)


async def test_job_exceeding_its_timeout_is_rolled_back(
    cluster: Cluster, db: asyncpg.Connection, client: httpx.AsyncClient
) -> None:
    """Waiting (times-out) or inside a statement (times-out-in-sql): 504 after the 0.5 s
    timeout, rolled back, and no cancel request sent through PgBouncer (the runner closes
    the connection instead; PgBouncer 1.18 can crash on cancel requests)."""
    assert cluster.nginx is not None
    answers = []
    for job in ("times-out", "times-out-in-sql"):
        started = time.monotonic()
        answer = await post(client, cluster.nginx.url + f"/cron/{job}", json={"seconds": 10})
        took = time.monotonic() - started
        body = assert_clean_error(answer, (504,))
        assert body["error"] == "job timed out"
        assert took < 0.5 + 2
        # Closing the connection ends the transaction at once; a statement still running
        # ends within client_connection_check_interval (1 s).
        freed = await wait_for(functools.partial(lock_free, db, job), 5, f"{job}'s lock")
        assert freed < 2.5
        assert await effects(db, job) == 0
        (row,) = await runs(db, job)
        assert (row["id"], row["status"]) == (body["run_id"], "timed_out")
        answers.append(answer)
    assert cluster.pgbouncer is not None
    assert "cancel" not in cluster.pgbouncer.log().lower()
    await check_books(db, answers)
    await settle(db, cluster)
    await still_serving(client, cluster.instances)


async def test_job_blocking_the_event_loop_is_ended_by_the_database(
    cluster: Cluster, db: asyncpg.Connection, client: httpx.AsyncClient
) -> None:
    """The service cannot time out a job that never yields: the database's timeouts (job
    timeout + DB_TIMEOUT_MARGIN) end its transaction, and another instance can run it."""
    blocked, other, _ = cluster.instances
    bound = 0.5 + DB_TIMEOUT_MARGIN  # blocks-loop has timeout 0.5
    pending = asyncio.create_task(
        post(client, blocked.url + "/cron/blocks-loop", json={"seconds": 5})
    )
    await wait_for(lambda: lock_held(db, "blocks-loop"), 10, "the lock to be taken")
    started = time.monotonic()
    await wait_for(lambda: _not(lock_held(db, "blocks-loop")), bound + 5, "the lock to free")
    freed_after = time.monotonic() - started
    r = await post(client, other.url + "/cron/blocks-loop", json={"seconds": 0.01})
    assert r.status_code == 200, r.text
    assert r.json()["processed"] == 1
    answer = await pending
    body = assert_clean_error(answer, (500, 504))
    assert isinstance(body.get("run_id"), int), body
    assert freed_after < bound + 1.0
    assert await effects(db, "blocks-loop") == 1
    statuses = Counter(row["status"] for row in await runs(db, "blocks-loop"))
    assert statuses["succeeded"] == 1
    assert statuses["failed"] + statuses["timed_out"] == 1, statuses
    await check_books(db, [r])
    await settle(db, cluster)
    await still_serving(client, cluster.instances)


# --- shutdown and exhaustion ----------------------------------------------------------------


async def test_sigterm_finishes_or_rolls_back_within_the_grace_period(
    cluster: Cluster, db: asyncpg.Connection, client: httpx.AsyncClient
) -> None:
    """A job that ends within GRACEFUL_SHUTDOWN_TIMEOUT commits and is answered; one that
    would not is cancelled and rolled back; either way the process is gone in time."""
    finishing, cut_short, survivor = cluster.instances
    short = asyncio.create_task(post(client, finishing.url + "/cron/slow", json={"seconds": 1.5}))
    long = asyncio.create_task(post(client, cut_short.url + "/cron/long-1", json={"seconds": 15}))
    await wait_for(lambda: lock_held(db, "slow"), 10, "slow to start")
    await wait_for(lambda: lock_held(db, "long-1"), 10, "long-1 to start")
    started = time.monotonic()
    finishing.signal(signal.SIGTERM)
    cut_short.signal(signal.SIGTERM)
    limit = GRACEFUL_SHUTDOWN_TIMEOUT + 3
    finishing.wait_exit(limit)
    cut_short.wait_exit(max(0.1, limit - (time.monotonic() - started)))
    stopped_in = time.monotonic() - started
    assert stopped_in < limit

    done = await short
    assert done.status_code == 200, done.text
    assert done.json()["processed"] == {"slept": 1.5}
    try:
        cut = await long
    except httpx.HTTPError:
        pass  # the connection closed with the process
    else:
        # uvicorn answers a request it cancelled itself with a plain-text 500.
        assert cut.status_code in (500, 503, 504), cut.text
        assert not any(leak in cut.text for leak in LEAKS), cut.text

    assert [row["status"] for row in await runs(db, "slow")] == ["succeeded"]
    assert [row["status"] for row in await runs(db, "long-1")] == ["cancelled"]
    assert await effects(db, "slow") == 1
    assert await effects(db, "long-1") == 0
    await check_books(db, [done])
    await settle(db, cluster)
    await still_serving(client, [survivor])


async def test_pool_exhaustion_answers_503_at_once_and_skips_stay_fast(
    cluster: Cluster, db: asyncpg.Connection, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    """More concurrent long jobs than pooled connections: the extra ones get a clear 503
    within the acquire timeout, and a trigger for a running job is still answered at once."""
    assert cluster.pgbouncer is not None
    pool, acquire = 3, 1.0
    env = {
        **CLUSTER_ENV,
        "DATABASE_URL": cluster.instances[0].env["DATABASE_URL"],
        "DB_POOL_MAX_SIZE": str(pool),
        "DB_ACQUIRE_TIMEOUT": str(acquire),
    }
    small = Instance("small", env, dir=tmp_path / "small")
    small.start()
    try:
        wait_ready(small)
        jobs = [f"long-{n}" for n in range(1, 7)]
        started = time.monotonic()
        tasks = {
            job: asyncio.create_task(post(client, small.url + f"/cron/{job}", json={"seconds": 3}))
            for job in jobs
        }
        answered_after: dict[str, float] = {}

        def clock(job: str) -> Callable[[object], None]:
            def answered(_: object) -> None:
                answered_after[job] = time.monotonic() - started

            return answered

        for job, task in tasks.items():
            task.add_done_callback(clock(job))
        await asyncio.sleep(0.5)
        await wait_for(
            lambda: _some_running(db, jobs), acquire + 5, "the long jobs to take the pool"
        )
        running = [job for job in jobs if await lock_held(db, job)]
        assert running
        # While they hold every connection, a trigger for a running job is answered in-process.
        t0 = time.monotonic()
        skip = await post(client, small.url + f"/cron/{running[0]}", json={"seconds": 3})
        skip_took = time.monotonic() - t0
        assert skip.json() == {"job": running[0], "skipped": True, "reason": "already running"}
        assert skip_took < 0.5
        # Elsewhere the lock itself answers.
        elsewhere = await post(client, cluster.instances[0].url + f"/cron/{running[0]}")
        assert elsewhere.json()["reason"] == "already running"
        answers = {job: await task for job, task in tasks.items()}
        took = time.monotonic() - started
    finally:
        small.terminate()
    ran = [job for job, a in answers.items() if a.status_code == 200]
    refused = [job for job, a in answers.items() if a.status_code == 503]
    assert sorted(ran + refused) == sorted(jobs), {j: a.text for j, a in answers.items()}
    # One connection stays free for the ledger rows that commit outside a lock transaction.
    assert len(ran) == pool - 1, (ran, refused)
    for job in refused:
        body = assert_clean_error(answers[job], (503,))
        assert body["reason"] == "no database connection free (pool exhausted)", body
        # Refused once the acquire timeout is over, not when a connection frees up.
        assert answered_after[job] < acquire + 1.5, answered_after
    for job in ran:
        assert answers[job].json()["processed"] == int(job.split("-")[1])
    assert took < 3 + acquire + 3, f"answers took {took:.1f}s"
    await check_books(db, answers.values())
    await settle(db, cluster)
    await still_serving(client, cluster.instances)


async def _some_running(db: asyncpg.Connection, jobs: list[str]) -> bool:
    return any([await lock_held(db, job) for job in jobs])
