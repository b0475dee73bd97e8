"""Lease runs under fire, with real processes and real signals, through PgBouncer in
transaction mode: the holder killed (-9) at random moments, frozen past its lease (SIGSTOP)
then woken, stopped (SIGTERM); PostgreSQL and PgBouncer restarted mid-run; and no
transaction outliving a step, sampled from pg_stat_activity throughout a run.

The job (`lease-items`, tests/lease_jobs.py) writes one row per item into a table without a
unique constraint, so an item committed twice would show as two rows: every test ends with
each item exactly once and the run succeeded.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from tests.lease_jobs import LEASE, LEASE_ENV, create_effects
from tests.support.cluster import Cluster, Instance
from tests.support.faults import heal
from tests.support.postgres import ScratchPostgres, own_postgres
from tests.util import AUTH, successor, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ENV = {
    **LEASE_ENV,
    "CRON_JOBS": "tests.lease_jobs",
    "DB_ACQUIRE_TIMEOUT": "2",
    "DB_TIMEOUT_MARGIN": "1",
    "MIGRATE_RETRY_INTERVAL": "0.3",
    "GRACEFUL_SHUTDOWN_TIMEOUT": "3",
    "LOG_FORMAT": "text",
}


@pytest.fixture(scope="module")
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cronlock-lease-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def postgres(root: Path) -> Iterator[ScratchPostgres]:
    with own_postgres(root) as server:
        yield server


@pytest.fixture(scope="module")
def cluster(make_cluster: Callable[..., Cluster], postgres: ScratchPostgres) -> Cluster:
    return make_cluster(postgres.dsn(), env=ENV)


@pytest.fixture
async def db(
    cluster: Cluster,
    postgres: ScratchPostgres,
    report_logs: Callable[[list[Instance]], None],
) -> AsyncIterator[asyncpg.Connection]:
    """A direct connection (not through PgBouncer) on a clean ledger and effects table."""
    report_logs(cluster.instances)
    if not postgres.is_running():
        postgres.start()
    heal(cluster)
    conn = await asyncpg.connect(postgres.dsn(), statement_cache_size=0)
    try:
        await create_effects(conn)
        await conn.execute("TRUNCATE lease_effects; DELETE FROM cronlock.runs")
        yield conn
    finally:
        await conn.close()


async def reconnect(postgres: ScratchPostgres) -> asyncpg.Connection:
    return await asyncpg.connect(postgres.dsn(), statement_cache_size=0)


async def begin(client: httpx.AsyncClient, cluster: Cluster, **params: Any) -> int:
    r = await client.post(f"{cluster.instances[0].url}/cron/lease-items", headers=AUTH, json=params)
    assert r.status_code == 202, r.text
    run_id: int = r.json()["run_id"]
    return run_id


async def holder(db: asyncpg.Connection, cluster: Cluster) -> Instance | None:
    """The instance whose live lease runs the job now."""
    name = await db.fetchval(
        "SELECT instance FROM cronlock.runs WHERE job = 'lease-items' AND status = 'running' "
        "AND lease_expires_at > now() ORDER BY id DESC LIMIT 1"
    )
    return next((i for i in cluster.instances if i.name == name), None)


async def counter(client: httpx.AsyncClient, instance: Instance, series: str) -> float:
    """A series' value on one instance's /metrics (0 when absent): the module's instances
    live across tests, so a test compares before and after."""
    text = (await client.get(f"{instance.url}/metrics", headers=AUTH)).text
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


LOST = 'cronlock_leases_lost_total{job="lease-items"}'
TAKEN = 'cronlock_lease_takeovers_total{job="lease-items"}'


async def done(db: asyncpg.Connection) -> bool:
    return bool(
        await db.fetchval(
            "SELECT EXISTS (SELECT 1 FROM cronlock.runs "
            "WHERE job = 'lease-items' AND status = 'succeeded')"
        )
    )


async def check_exactly_once(db: asyncpg.Connection, n: int) -> list[asyncpg.Record]:
    """Every item once, the run succeeded once, nothing left running; the attempts."""
    counts = await db.fetchrow(
        "SELECT count(*) AS rows, count(DISTINCT item) AS items, min(item) AS lo, "
        "max(item) AS hi FROM lease_effects"
    )
    assert counts is not None
    assert dict(counts) == {"rows": n, "items": n, "lo": 1, "hi": n}, dict(counts)
    attempts = await db.fetch(
        "SELECT id, status, attempt, retry_of, instance, lease_token, result, error "
        "FROM cronlock.runs WHERE job = 'lease-items' ORDER BY id"
    )
    assert [a["status"] for a in attempts].count("succeeded") == 1, attempts
    assert attempts[-1]["status"] == "succeeded"
    assert attempts[-1]["result"] == str(n)
    assert all(a["status"] != "running" for a in attempts)
    # One chain: each attempt continues the one before, with a greater token.
    for before, after in itertools.pairwise(attempts):
        assert after["retry_of"] == before["id"], attempts
        assert after["attempt"] == before["attempt"] + 1
        assert after["lease_token"] > before["lease_token"]
    return attempts


async def test_kill_9_the_holder_again_and_again_every_item_once(
    cluster: Cluster, db: asyncpg.Connection, client: httpx.AsyncClient
) -> None:
    n, rng = 600, random.Random(13)
    await begin(client, cluster, n=n, batch=3, pause=0.02)
    kills = 0
    for _ in range(3):
        # A random moment: between steps, inside one, or while committing.
        await asyncio.sleep(rng.uniform(0.3, 1.2))
        victim = await holder(db, cluster)
        if victim is None:
            break
        victim.kill()
        kills += 1
        victim.start()  # back, as an orchestrator would; the run goes on elsewhere or here

        async def taken_over(before: int = kills) -> bool:
            return int(
                await db.fetchval("SELECT count(*) FROM cronlock.runs WHERE job = 'lease-items'")
            ) > before or await done(db)

        # Within the lease plus the watchers' poll, not a trigger later.
        await wait_for(taken_over, LEASE + 5, "a takeover")
    assert kills >= 2
    await wait_for(lambda: done(db), 60, "the run to complete")
    attempts = await check_exactly_once(db, n)
    assert len(attempts) >= kills + 1
    assert all("lease expired" in (a["error"] or "") for a in attempts[:-1])


async def test_a_frozen_holder_wakes_up_and_commits_nothing(
    cluster: Cluster, db: asyncpg.Connection, client: httpx.AsyncClient
) -> None:
    n = 400
    first = await begin(client, cluster, n=n, batch=2, pause=0.02, hold=0.05)
    await asyncio.sleep(0.5)
    stale = await holder(db, cluster)
    assert stale is not None
    before = {
        i.name: (await counter(client, i, LOST), await counter(client, i, TAKEN))
        for i in cluster.instances
    }
    stale.freeze()
    frozen_at = await db.fetchval("SELECT clock_timestamp()")
    try:
        taken = await successor(db, first, LEASE + 5)
        assert taken["instance"] != stale.name
        await asyncio.sleep(0.5)  # the new holder commits a few steps meanwhile
    finally:
        stale.thaw()
    await wait_for(lambda: done(db), 60, "the run to complete")
    await check_exactly_once(db, n)
    # Nothing of the stale holder's committed after the takeover: its run's last effect is
    # older than its successor's start (a step in flight at SIGSTOP was rolled back by the
    # server's idle-in-transaction timeout, which is at most the lease).
    last_stale = await db.fetchval("SELECT max(at) FROM lease_effects WHERE run_id = $1", first)
    assert last_stale is None or last_stale < taken["started_at"], (last_stale, frozen_at)

    # It found out, and said so.
    async def said_so() -> bool:
        # Its lease_lost event, whichever way it found out: the lease gone at a renewal, or
        # (woken on a loaded machine) a step that could not begin within DB_QUERY_TIMEOUT.
        log = stale.log()
        said = ("lease lost", "lease not renewed", "event=lease_lost", '"event": "lease_lost"')
        return any(line in log for line in said)

    await wait_for(said_so, 10, "the stale holder to log its lost lease")
    error = await db.fetchval("SELECT error FROM cronlock.runs WHERE id = $1", first)
    assert f"taken over by run {taken['id']}" in error
    # And counted it; the instance that took over counted its takeover.
    # At least: under load a 2 s lease can also be lost (and taken over) once more later on.
    assert await counter(client, stale, LOST) >= before[stale.name][0] + 1
    taker = next(i for i in cluster.instances if i.name == taken["instance"])
    assert await counter(client, taker, TAKEN) >= before[taker.name][1] + 1


async def test_sigterm_hands_the_run_over_at_once(
    cluster: Cluster, db: asyncpg.Connection, client: httpx.AsyncClient
) -> None:
    n = 300
    first = await begin(client, cluster, n=n, batch=3, pause=0.02)
    await asyncio.sleep(0.5)
    leaving = await holder(db, cluster)
    assert leaving is not None
    leaving.signal(signal.SIGTERM)
    stopped = time.monotonic()
    await successor(db, first, LEASE + 5)
    assert time.monotonic() - stopped < LEASE  # given up, not waited out
    leaving.wait_exit(10)
    leaving.start()
    await wait_for(lambda: done(db), 60, "the run to complete")
    attempts = await check_exactly_once(db, n)
    assert attempts[0]["status"] == "abandoned"


@pytest.mark.parametrize("fault", ["postgres", "pgbouncer"])
async def test_the_run_survives_a_database_side_restart(
    fault: str,
    cluster: Cluster,
    postgres: ScratchPostgres,
    db: asyncpg.Connection,
    client: httpx.AsyncClient,
) -> None:
    n = 400
    await begin(client, cluster, n=n, batch=2, pause=0.02)
    await asyncio.sleep(0.8)
    await db.close()
    if fault == "postgres":
        postgres.restart()
    else:
        assert cluster.pgbouncer is not None
        cluster.pgbouncer.terminate()
        await asyncio.sleep(0.5)
        cluster.pgbouncer.start()
    db = await reconnect(postgres)
    try:
        await wait_for(lambda: done(db), 60, "the run to complete after the restart")
        await check_exactly_once(db, n)
    finally:
        await db.close()


async def test_no_transaction_outlives_a_step(
    cluster: Cluster, db: asyncpg.Connection, client: httpx.AsyncClient
) -> None:
    """Sampled every 20 ms through a run of a few seconds: the longest transaction of any
    cronlock session stays around a step's length (hold=0.05 s), far below the run's."""
    await begin(client, cluster, n=300, batch=3, pause=0.02, hold=0.05)
    longest, samples = 0.0, 0
    started = time.monotonic()
    while not await done(db):
        value = await db.fetchval(
            "SELECT coalesce(max(extract(epoch FROM clock_timestamp() - xact_start)), 0) "
            "FROM pg_stat_activity WHERE backend_type = 'client backend' "
            "AND pid <> pg_backend_pid() AND xact_start IS NOT NULL "
            "AND datname = current_database()"
        )
        longest, samples = max(longest, float(value)), samples + 1
        assert time.monotonic() - started < 60
        await asyncio.sleep(0.02)
    run_seconds = time.monotonic() - started
    assert samples > 50
    assert run_seconds > 3
    assert longest < 0.5, f"a transaction lasted {longest:.3f} s during a {run_seconds:.1f} s run"
    await check_exactly_once(db, 300)
