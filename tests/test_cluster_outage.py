"""The database side fails: PostgreSQL restarts or stays down, PgBouncer restarts, an instance
is pointed at a hot standby. The module's cluster has a PostgreSQL and a PgBouncer of its own,
so taking them down breaks no other test.

Each test ends as the fault tests do (tests/test_cluster_faults.py): nothing twice, nothing
lost, nothing left behind, and the instances recovered without a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from tests.support.cluster import Cluster, Instance
from tests.support.faults import (
    CLUSTER_ENV,
    DB_QUERY_TIMEOUT,
    assert_clean_error,
    check_books,
    heal,
    reset,
    settle,
)
from tests.support.postgres import ScratchPostgres, own_postgres, start_standby
from tests.util import AUTH, lock_held, post, runs, wait_for

pytestmark = pytest.mark.cluster

# How long a trigger or /readyz may take to answer while the database is away: PgBouncer's
# query_wait_timeout (tests/support/cluster.py) or the pool's connect timeout, plus
# scheduling slack.
ANSWER_BOUND = 8.0


@pytest.fixture(scope="module")
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cronlock-outage-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def postgres(root: Path) -> Iterator[ScratchPostgres]:
    """A PostgreSQL of this module's own: the tests stop, restart and clone it."""
    with own_postgres(root) as server:
        yield server


@pytest.fixture(scope="module")
def cluster(make_cluster: Callable[..., Cluster], postgres: ScratchPostgres) -> Cluster:
    return make_cluster(postgres.dsn())


@contextlib.asynccontextmanager
async def observe(postgres: ScratchPostgres) -> AsyncIterator[asyncpg.Connection]:
    """A direct connection to PostgreSQL (a restart ends the previous one)."""
    conn = await asyncpg.connect(postgres.dsn(), statement_cache_size=0)
    try:
        yield conn
    finally:
        await conn.close()


@pytest.fixture(autouse=True)
async def _fresh(
    cluster: Cluster,
    postgres: ScratchPostgres,
    report_logs: Callable[[list[Instance]], None],
) -> AsyncIterator[None]:
    report_logs(cluster.instances)
    if not postgres.is_running():
        postgres.start()
    heal(cluster)
    async with observe(postgres) as db:
        await reset(db)
    yield
    assert cluster.pgbouncer is not None
    cluster.pgbouncer.check_alive()


def targets(cluster: Cluster) -> list[str]:
    """nginx and every instance."""
    assert cluster.nginx is not None
    return [cluster.nginx.url, *(i.url for i in cluster.instances)]


async def timed(request: Any) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    answer: httpx.Response = await request
    return answer, time.monotonic() - started


async def assert_unavailable(client: httpx.AsyncClient, cluster: Cluster) -> None:
    """Triggers 503 with Retry-After everywhere, /readyz 503, /healthz 200, all promptly.
    Each question is timed on its own, asked alongside others so that none waits for another's
    timeout to run out first; but never two triggers at one instance at once (the second
    would rightly be answered "already running" by the instance itself)."""
    assert cluster.nginx is not None
    direct = [timed(post(client, i.url + "/cron/fast")) for i in cluster.instances]
    readies = [timed(client.get(i.url + "/readyz")) for i in cluster.instances]
    answers = await asyncio.gather(*direct, *readies)
    proxied = await timed(post(client, cluster.nginx.url + "/cron/fast"))
    urls = [*(i.url for i in cluster.instances), cluster.nginx.url]
    for url, (answer, took) in zip(urls, [*answers[: len(direct)], proxied], strict=True):
        body = assert_clean_error(answer, (503,))
        assert body["error"] == "database unavailable", body
        assert body["reason"], body
        assert took < ANSWER_BOUND, f"{url}: 503 after {took:.1f}s"
    for instance, (ready, took) in zip(cluster.instances, answers[len(direct) :], strict=True):
        assert_clean_error(ready, (503,))
        assert took < ANSWER_BOUND, f"{instance.name} /readyz after {took:.1f}s"
        assert (await client.get(instance.url + "/healthz")).status_code == 200


async def assert_recovers(
    client: httpx.AsyncClient, cluster: Cluster, pids: list[int], within: float = 15.0
) -> list[httpx.Response]:
    """Every instance (and nginx) runs a job again, without having been restarted; until
    then the only answer is a 503."""
    done: list[httpx.Response] = []
    for url in targets(cluster):

        async def runs_again(url: str = url) -> bool:
            answer = await post(client, url + "/cron/fast")
            if answer.status_code == 503:
                return False
            assert answer.status_code == 200, answer.text
            done.append(answer)
            return True

        await wait_for(runs_again, within, f"{url} to run a job again", interval=0.2)
    for instance in cluster.instances:

        async def ready(instance: Instance = instance) -> bool:
            answer = await client.get(instance.url + "/readyz")
            if answer.status_code == 503:
                assert_clean_error(answer, (503,))
                return False
            assert answer.status_code == 200, (instance.name, answer.text)
            return True

        await wait_for(ready, within, f"{instance.name} to be ready again", interval=0.2)
    assert [i.pid for i in cluster.instances] == pids
    return done


async def settled_ledger(
    client: httpx.AsyncClient, cluster: Cluster, db: asyncpg.Connection, job: str
) -> list[str]:
    """The job's run statuses once a look at /cron/runs has closed abandoned rows."""
    assert cluster.nginx is not None
    url = f"{cluster.nginx.url}/cron/runs?job={job}"

    async def closed() -> bool:
        await client.get(url, headers=AUTH)
        return "running" not in {row["status"] for row in await runs(db, job)}

    await wait_for(closed, 10, f"no {job} run left `running`", interval=0.2)
    return [row["status"] for row in await runs(db, job)]


# --- PostgreSQL -----------------------------------------------------------------------------


async def test_postgres_restart_mid_job(
    cluster: Cluster, postgres: ScratchPostgres, client: httpx.AsyncClient
) -> None:
    holder = cluster.instances[0]
    pids = [i.pid for i in cluster.instances]
    async with observe(postgres) as db:
        running = asyncio.create_task(
            post(client, holder.url + "/cron/slow-sql", json={"seconds": 30})
        )
        await wait_for(lambda: mid_job(db, "slow-sql"), 10, "the job to be running")
    postgres.restart()
    answer, took = await timed(running)
    body = assert_clean_error(answer, (500, 504))
    assert isinstance(body.get("run_id"), int), body
    assert took < 30
    recovered = await assert_recovers(client, cluster, pids)
    after = await post(client, holder.url + "/cron/slow-sql", json={"seconds": 0})
    assert after.status_code == 200, after.text
    async with observe(postgres) as db:
        statuses = await settled_ledger(client, cluster, db, "slow-sql")
        assert statuses[-1] == "succeeded"
        assert set(statuses[:-1]) <= {"failed", "abandoned", "timed_out"}, statuses
        assert len(statuses) == 2
        await check_books(db, [after, *recovered])
        await settle(db, cluster)


async def test_postgres_down_for_a_while(
    cluster: Cluster, postgres: ScratchPostgres, client: httpx.AsyncClient
) -> None:
    pids = [i.pid for i in cluster.instances]
    postgres.stop("fast")
    try:
        await assert_unavailable(client, cluster)
        await asyncio.sleep(1)
        await assert_unavailable(client, cluster)
    finally:
        postgres.start()
    recovered = await assert_recovers(client, cluster, pids)
    async with observe(postgres) as db:
        await check_books(db, recovered)
        await settle(db, cluster)


# --- PgBouncer ------------------------------------------------------------------------------


async def test_pgbouncer_restarted(
    cluster: Cluster, postgres: ScratchPostgres, client: httpx.AsyncClient
) -> None:
    assert cluster.pgbouncer is not None
    holder = cluster.instances[1]
    pids = [i.pid for i in cluster.instances]
    async with observe(postgres) as db:
        running = asyncio.create_task(
            post(client, holder.url + "/cron/slow-sql", json={"seconds": 30})
        )
        await wait_for(lambda: mid_job(db, "slow-sql"), 10, "the job to be running")
        cluster.pgbouncer.terminate()
        try:
            # The server connection went with PgBouncer: the lock with it.
            await wait_for(lambda: _not(lock_held(db, "slow-sql")), 5, "the lock to free")
            answer, _ = await timed(running)
            body = assert_clean_error(answer, (500, 504))  # a 503 has no run: no run id
            assert isinstance(body.get("run_id"), int), body
            await assert_unavailable(client, cluster)
        finally:
            cluster.pgbouncer.start()
        recovered = await assert_recovers(client, cluster, pids)
        statuses = await settled_ledger(client, cluster, db, "slow-sql")
        assert len(statuses) == 1
        assert statuses[0] in {"failed", "abandoned", "timed_out"}, statuses
        await check_books(db, recovered)
        await settle(db, cluster)


async def test_pgbouncer_frozen_answers_503_not_never(
    cluster: Cluster, postgres: ScratchPostgres, client: httpx.AsyncClient
) -> None:
    """A pooler that stops answering with its sockets open (SIGSTOP): no error ever reaches
    the instances on their own, only DB_QUERY_TIMEOUT ends their waits."""
    assert cluster.pgbouncer is not None
    pids = [i.pid for i in cluster.instances]
    for instance in cluster.instances:  # every pool holds an idle connection to the pooler
        assert (await post(client, instance.url + "/cron/fast")).status_code == 200
    cluster.pgbouncer.freeze()
    try:
        # At once: each instance waits out its own timeout, not the others' too.
        asked = [timed(post(client, instance.url + "/cron/fast")) for instance in cluster.instances]
        for instance, (answer, took) in zip(
            cluster.instances, await asyncio.gather(*asked), strict=True
        ):
            body = assert_clean_error(answer, (503,))
            # An idle pooled connection waits DB_QUERY_TIMEOUT; a new one, the acquire timeout.
            assert body["reason"] in (
                f"no answer from the database within {DB_QUERY_TIMEOUT:g} s",
                "database unreachable: connecting timed out",
            ), body
            assert took < DB_QUERY_TIMEOUT + 2, f"{instance.name}: 503 after {took:.1f}s"
        await assert_unavailable(client, cluster)
    finally:
        cluster.pgbouncer.thaw()
    async with observe(postgres) as db:
        recovered = await assert_recovers(client, cluster, pids)
        await check_books(db, recovered)
        await settle(db, cluster)


async def _not(check: Any) -> bool:
    return not await check


async def mid_job(db: asyncpg.Connection, job: str) -> bool:
    """The job holds its lock and its run is recorded: it is running its own statements."""
    recorded = await db.fetchval(
        "SELECT EXISTS (SELECT 1 FROM cronlock.runs WHERE job = $1 AND status = 'running')", job
    )
    return bool(recorded) and await lock_held(db, job)


# --- a standby ------------------------------------------------------------------------------


async def test_instance_on_a_hot_standby_refuses_jobs(
    cluster: Cluster, postgres: ScratchPostgres, client: httpx.AsyncClient, root: Path
) -> None:
    """Advisory locks on a standby coordinate nothing with the primary: an instance pointed
    at one stays up, refuses jobs with 503 and says why; the others carry on."""
    standby = start_standby(postgres, root / "standby")
    misled = Instance(
        "on-standby",
        {**CLUSTER_ENV, "DATABASE_URL": standby.dsn()},
        dir=root / "instances" / "on-standby",
    )
    try:
        misled.start()
        ready = await client.get(misled.url + "/readyz")
        body = assert_clean_error(ready, (503,))
        assert "standby" in body["reason"], body
        for _ in range(3):
            answer = await post(client, misled.url + "/cron/fast")
            refused = assert_clean_error(answer, (503,))
            assert "standby" in refused["reason"], refused
        assert (await client.get(misled.url + "/healthz")).status_code == 200
        assert misled.is_alive()
        # The primary-pointing instances are unaffected, meanwhile.
        fine = [await post(client, url + "/cron/fast") for url in targets(cluster)]
        assert {a.status_code for a in fine} == {200}, [a.text for a in fine]
    finally:
        misled.terminate()
        standby.stop("immediate")
    async with observe(postgres) as db:
        assert [row["status"] for row in await runs(db, "fast")] == ["succeeded"] * len(fine)
        await check_books(db, fine)
        await settle(db, cluster)
