"""Exactly once across a real failover: a Patroni pair (tests/support/patroni.py), two
instances behind nginx on a multi-host DATABASE_URL (target_session_attrs=read-write), under
load (backfilled slots, slow runs in flight, the digest and its outbox delivering to a
provider that honours idempotency keys, a lease run stepping through the fault), through a
switchover and a hard failover (Patroni and the primary's PostgreSQL killed together) with
synchronous replication.

Afterwards, in the surviving database: no effect twice, every slot with exactly one succeeded
run, every `200 processed` in the ledger with its effect, each email key accepted once, the
lease run taken over on the new primary from its last replicated checkpoint and succeeded
with each item committed once in its attempt chain, no lock, `running` row or open
transaction left, every instance serving without a restart.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import httpx
import pytest

from cronlock.db.schema import migrate, migration_sets
from tests.soak_jobs import LEASE_ITEMS_SQL
from tests.support.cluster import Instance, Nginx, PgBouncer
from tests.support.delivery import API_KEY
from tests.support.history import History, fire, leftovers, minute_slots, settle_slots, violations
from tests.support.instances import Instances
from tests.support.patroni import HAProxy, PatroniCluster
from tests.support.postgres import create_database, unique_name
from tests.support.provider import Provider
from tests.support.soak import lease_violations
from tests.util import AUTH

USERS = 20
SLOTS = 30
LOAD_SECONDS = 45.0
# The lease run (tests/soak_jobs.py `soak-lease`, lease 8 s): started before the fault, ten
# steps half a second apart, so that it has committed steps before the fault and has some
# left after it.
LEASE_STEPS = 10
LEASE_PAUSE = 0.5

ENV = {
    "CRON_JOBS": "tests.jobs,tests.soak_jobs,cronlock.demo.digest",
    # A run whose lease ran out is taken over within half a second of it.
    "LEASE_POLL_INTERVAL": "0.5",
    "OUTBOX_ENABLED": "true",
    "EMAIL_BACKEND": "http",
    "EMAIL_API_KEY": API_KEY,
    "OUTBOX_RATE_LIMIT": "0",
    "OUTBOX_POLL_INTERVAL": "0.2",
    "OUTBOX_LEASE": "5",
    "OUTBOX_SEND_TIMEOUT": "2",
    "OUTBOX_BACKOFF_BASE": "0.2",
    "OUTBOX_BACKOFF_MAX": "2",
    # Short: a connection to a server that went away is found out in seconds.
    "DB_CONNECT_TIMEOUT": "1",
    "DB_ACQUIRE_TIMEOUT": "2",
    "DB_QUERY_TIMEOUT": "3",
    "DB_TIMEOUT_MARGIN": "1",
    "MIGRATE_RETRY_INTERVAL": "0.5",
    "GRACEFUL_SHUTDOWN_TIMEOUT": "3",
    "LOG_FORMAT": "text",
}


@pytest.fixture
async def ha_url(patroni_cluster: PatroniCluster) -> str:
    """A fresh migrated database on the cluster (the demo's users in it): its multi-host URL."""
    name = unique_name("ha")
    leader = patroni_cluster.leader()
    await create_database(leader.dsn(), name)
    conn = await asyncpg.connect(leader.dsn(name))
    try:
        await migrate(conn, "cronlock", migration_sets(["cronlock.demo.digest"]))
        await conn.execute(LEASE_ITEMS_SQL)  # the lease run's items (tests/soak_jobs.py)
        await conn.execute(
            "INSERT INTO cronlock_demo.users (email) "
            "SELECT 'user' || i || '@example.com' FROM generate_series(1, $1) AS i",
            USERS,
        )
    finally:
        await conn.close()
    return patroni_cluster.url(name)


@pytest.fixture
async def ha_instances(
    ha_url: str,
    tmp_path: Path,
    provider: Provider,
    start_nginx: Callable[..., Nginx],
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[list[Instance], Nginx]]:
    from tests.conftest import INSTANCES_KEY

    reported = request.node.stash.setdefault(INSTANCES_KEY, [])
    instances = Instances(ha_url, tmp_path / "instances", reported)
    try:
        started = instances.start_many(["ha1", "ha2"], {**ENV, "EMAIL_API_URL": provider.url})
        yield started, start_nginx([i.address for i in started])
    finally:
        instances.stop()


@pytest.fixture
async def pooled_instances(
    patroni_cluster: PatroniCluster,
    ha_url: str,
    tmp_path: Path,
    provider: Provider,
    start_nginx: Callable[..., Nginx],
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[list[Instance], Nginx]]:
    """The pooled shape (docs/deploying.md): instances -> PgBouncer -> HAProxy, which sends
    connections only to the node whose Patroni answers 200 on /primary."""
    from tests.conftest import INSTANCES_KEY

    haproxy = HAProxy(patroni_cluster.nodes, dir=tmp_path / "haproxy")
    haproxy.start()
    bouncer = PgBouncer("127.0.0.1", haproxy.port, dir=tmp_path / "pgbouncer", default_pool_size=30)
    bouncer.start()
    dbname = urlsplit(ha_url).path.lstrip("/")
    env = {
        **ENV,
        "EMAIL_API_URL": provider.url,
        "DATABASE_URL": f"postgresql://postgres@127.0.0.1:{bouncer.port}/{dbname}",
        # LISTEN needs a session of its own: the multi-host URL, not PgBouncer.
        "DATABASE_DIRECT_URL": ha_url,
    }
    reported = request.node.stash.setdefault(INSTANCES_KEY, [])
    instances = Instances(env["DATABASE_URL"], tmp_path / "instances", reported)
    try:
        started = instances.start_many(["pooled1", "pooled2"], env)
        yield started, start_nginx([i.address for i in started])
    finally:
        instances.stop()
        bouncer.stop()
        haproxy.stop()


async def primary_conn(url: str) -> asyncpg.Connection:
    deadline = time.monotonic() + 30
    while True:
        try:
            return await asyncpg.connect(url, timeout=3)
        except (OSError, asyncpg.PostgresError, TimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


@dataclass
class Load:
    history: History
    took: float  # the fault, from its start until the new primary leads
    fault_began: datetime
    fault_ended: datetime


async def failover_under_load(
    cluster: PatroniCluster,
    url: str,
    instances: list[Instance],
    nginx: Nginx,
    provider: Provider,
    fault: Callable[[], object],
) -> Load:
    """Load through nginx, `fault` injected after a second and a half."""
    history = History()
    base = nginx.url
    slots = minute_slots(datetime.now(UTC), SLOTS)
    stop = time.monotonic() + LOAD_SECONDS
    took = 0.0
    began = ended = datetime.now(UTC)

    async with httpx.AsyncClient(limits=httpx.Limits(keepalive_expiry=2.0)) as client:

        async def inject() -> None:
            nonlocal took, began, ended
            await asyncio.sleep(1.5)
            start = time.monotonic()
            began = datetime.now(UTC)
            await asyncio.to_thread(fault)
            ended = datetime.now(UTC)
            took = time.monotonic() - start

        async def slow_runs() -> None:
            # One-transaction runs in flight when the primary goes: committed before it, or
            # rolled back with it.
            while time.monotonic() < stop and not injected.done():
                await fire(client, base, "slow", history, params={"seconds": 0.4})
            for _ in range(3):
                await fire(client, base, "slow", history, params={"seconds": 0.1})

        async def lease_run() -> None:
            # A lease run stepping when the primary goes; it goes on after its 202, and
            # check_lease_run waits for it.
            await asyncio.sleep(0.3)
            params = {"n": LEASE_STEPS, "pause": LEASE_PAUSE}
            while (await fire(client, base, "soak-lease", history, params=params)).status != 202:
                assert not injected.done(), "the lease run was not started before the fault"
                await asyncio.sleep(0.1)

        async def digest() -> None:
            await asyncio.sleep(1.4)  # queued around the fault
            while time.monotonic() < stop:
                if (await fire(client, base, "daily-digest", history)).settled:
                    return
                await asyncio.sleep(0.2)

        async def settle() -> list[str]:
            # Slowly: the slots must still be coming in when the fault hits.
            return await settle_slots(
                client, base, "minutely", slots, history, workers=2, deadline=stop, pause=0.2
            )

        injected = asyncio.ensure_future(inject())
        unsettled, *_ = await asyncio.gather(settle(), slow_runs(), lease_run(), digest(), injected)
    assert unsettled == [], f"slots never settled: {unsettled}"
    return Load(history, took, began, ended)


async def check_lease_run(db: asyncpg.Connection, load: Load) -> None:
    """The lease run stepped before the fault and after it; it was taken over on the new
    primary (a row written after the fault began is on it: the old primary is gone or a
    replica), resumed from the last checkpoint that reached it, and succeeded; each item
    committed once in the attempt chain (tests/support/soak.py `lease_violations`)."""
    deadline = time.monotonic() + 30
    while await db.fetchval(
        "SELECT count(*) FROM cronlock.runs WHERE job = 'soak-lease' AND status = 'running'"
    ):
        assert time.monotonic() < deadline, "the lease run still running 30 s after the load"
        await asyncio.sleep(0.2)
    problems = await lease_violations(db)
    assert problems == [], problems
    attempts = await db.fetch(
        """SELECT id, attempt, retry_of, status, instance, started_at, error
           FROM cronlock.runs WHERE job = 'soak-lease' ORDER BY id"""
    )
    items = await db.fetch("SELECT run_id, item, at FROM soak_lease_items ORDER BY at")
    chain = ", ".join(
        f"run {a['id']} (attempt {a['attempt']}, {a['instance']}, {a['status']}): items "
        f"{[i['item'] for i in items if i['run_id'] == a['id']]}"
        for a in attempts
    )
    print(f"lease run: {chain}")
    # One chain: each attempt continues the one before; the last succeeded with every item.
    assert [a["attempt"] for a in attempts] == list(range(1, len(attempts) + 1)), chain
    assert all(a["retry_of"] == b["id"] for b, a in itertools.pairwise(attempts)), chain
    assert attempts[-1]["status"] == "succeeded", chain
    # In commit order, 1..n: each attempt resumed right after the last committed checkpoint.
    assert [i["item"] for i in items] == list(range(1, LEASE_STEPS + 1)), chain
    # In flight across the fault: items committed before it began and after it ended.
    assert any(i["at"] < load.fault_began for i in items), chain
    assert any(i["at"] > load.fault_ended for i in items), chain
    # Taken over after the fault began: each earlier attempt closed by the takeover.
    assert len(attempts) >= 2, f"the lease run was not taken over: {chain}"
    assert attempts[1]["started_at"] > load.fault_began, chain
    for before, after in itertools.pairwise(attempts):
        assert before["status"] == "abandoned", chain
        assert f"taken over by run {after['id']}" in before["error"], chain


async def check_after(
    url: str, load: Load, instances: list[Instance], nginx: Nginx, provider: Provider
) -> None:
    history = load.history
    db = await primary_conn(url)
    try:
        await check_lease_run(db, load)

        # Every queued email goes out, each key accepted once by the provider.
        async def all_sent() -> bool:
            pending = await db.fetchval(
                "SELECT count(*) FROM cronlock.email_outbox WHERE status <> 'sent'"
            )
            return bool(pending == 0)

        deadline = time.monotonic() + 30
        while not await all_sent():
            assert time.monotonic() < deadline, "emails not all sent"
            await asyncio.sleep(0.2)
        keys = {
            r["idempotency_key"]
            for r in await db.fetch("SELECT idempotency_key FROM cronlock.email_outbox")
        }
        assert len(keys) == USERS
        delivered = provider.delivered()
        assert set(delivered) == keys
        assert all(n == 1 for n in delivered.values()), delivered
        assert len(provider.emails()) == USERS

        problems = await violations(db, history)
        assert problems == [], problems
        succeeded = await db.fetchval(
            "SELECT count(DISTINCT slot) FROM cronlock.runs "
            "WHERE job = 'minutely' AND status = 'succeeded'"
        )
        assert succeeded == SLOTS

        # A run in flight when its primary went leaves its `running` row (written on a
        # second connection, committed) behind; listing the jobs closes it as `abandoned`.
        async with httpx.AsyncClient() as client:
            listed = await client.get(f"{instances[0].url}/cron/jobs", headers=AUTH)
            assert listed.status_code == 200, listed.text
        abandoned = await db.fetchval(
            "SELECT count(*) FROM cronlock.runs WHERE status = 'abandoned'"
        )
        print(f"runs abandoned by the failover: {abandoned}")
        deadline = time.monotonic() + 15
        while left := await leftovers(db):
            assert time.monotonic() < deadline, left
            await asyncio.sleep(0.2)
    finally:
        await db.close()
    # Every instance serves again, never restarted.
    async with httpx.AsyncClient() as client:
        for instance in instances:
            instance.check_alive()
            deadline = time.monotonic() + 15
            while (await client.get(f"{instance.url}/readyz")).status_code != 200:
                assert time.monotonic() < deadline, instance.log_tail(30)
                await asyncio.sleep(0.2)
            answer = await client.post(f"{instance.url}/cron/fast", headers=AUTH)
            assert answer.status_code == 200, answer.text


async def test_switchover_under_load(
    patroni_cluster: PatroniCluster,
    ha_url: str,
    ha_instances: tuple[list[Instance], Nginx],
    provider: Provider,
) -> None:
    instances, nginx = ha_instances
    patroni_cluster.wait_healthy()
    before = patroni_cluster.timeline()
    load = await failover_under_load(
        patroni_cluster, ha_url, instances, nginx, provider, patroni_cluster.switchover
    )
    assert patroni_cluster.timeline() == before + 1
    print(f"switchover: {load.took:.1f} s; answers {dict(load.history.by_status())}")
    await check_after(ha_url, load, instances, nginx, provider)


async def test_switchover_through_haproxy_and_pgbouncer(
    patroni_cluster: PatroniCluster,
    ha_url: str,
    pooled_instances: tuple[list[Instance], Nginx],
    provider: Provider,
) -> None:
    """The pooled shape follows a switchover too: HAProxy's check on Patroni's /primary moves
    PgBouncer's server connections to the new leader."""
    instances, nginx = pooled_instances
    patroni_cluster.wait_healthy()
    load = await failover_under_load(
        patroni_cluster, ha_url, instances, nginx, provider, patroni_cluster.switchover
    )
    answers = dict(load.history.by_status())
    print(f"switchover (HAProxy, PgBouncer): {load.took:.1f} s; answers {answers}")
    await check_after(ha_url, load, instances, nginx, provider)


async def test_hard_failover_with_synchronous_replication(
    patroni_cluster: PatroniCluster,
    ha_url: str,
    ha_instances: tuple[list[Instance], Nginx],
    provider: Provider,
) -> None:
    """Synchronous replication: a commit answered 200 had reached the standby, so the hard
    failover loses none (check_after: every `200 processed` is in the surviving ledger)."""
    instances, nginx = ha_instances
    patroni_cluster.heal()
    patroni_cluster.patch_config({"synchronous_mode": True})
    patroni_cluster.wait(
        lambda ms: any(m.role == "sync_standby" and m.state == "streaming" for m in ms),
        30,
        "a synchronous standby",
    )
    load = await failover_under_load(
        patroni_cluster, ha_url, instances, nginx, provider, patroni_cluster.fail
    )
    print(f"hard failover: {load.took:.1f} s; answers {dict(load.history.by_status())}")
    await check_after(ha_url, load, instances, nginx, provider)
