"""The cluster plumbing itself: PgBouncer pools, nginx proxies, instances obey signals."""

from __future__ import annotations

import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from cronlock.ops.sizing import sizing
from tests.support import TEST_SECRET, auth_headers
from tests.support.binaries import require_binary
from tests.support.cluster import Cluster, Instance, Nginx, PgBouncer, ServiceError
from tests.support.postgres import PostgresServer

ECHO_APP = "tests.support.echo_app:create_app"

pytestmark = pytest.mark.cluster


@pytest.fixture
def scratch() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="cronlock-infra-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def start_echo(scratch: Path) -> Iterator[Callable[..., Instance]]:
    """Instances of the echo app: no database needed, only the process plumbing."""
    started: list[Instance] = []

    def start(name: str = "e1", **kw: Any) -> Instance:
        kw.setdefault("env", {"CRON_SECRET": TEST_SECRET})
        kw.setdefault("app_factory", ECHO_APP)
        instance = Instance(name, dir=scratch / name, **kw)
        started.append(instance)
        instance.start()
        return instance

    yield start
    for instance in started:
        instance.stop(2.0)


@pytest.fixture
def small_bouncer(pg_server: PostgresServer, scratch: Path) -> Iterator[PgBouncer]:
    """A PgBouncer of its own with ONE server connection: pooling becomes visible."""
    require_binary("pgbouncer")
    bouncer = PgBouncer(
        pg_server.host, pg_server.port, default_pool_size=1, max_client_conn=10, dir=scratch / "b"
    )
    bouncer.start()
    yield bouncer
    bouncer.stop()


def dbname(url: str) -> str:
    return url.rsplit("/", 1)[1]


async def test_transaction_pooling_shares_one_backend(
    small_bouncer: PgBouncer, database_url: str
) -> None:
    dsn = small_bouncer.dsn(dbname(database_url))
    first = await asyncpg.connect(dsn, statement_cache_size=0)
    second = await asyncpg.connect(dsn, statement_cache_size=0)
    try:
        pid_first = await first.fetchval("SELECT pg_backend_pid()")
        pid_second = await second.fetchval("SELECT pg_backend_pid()")
        assert pid_first == pid_second

        # Why cronlock uses only transaction-level locks: a session lock taken through
        # PgBouncer belongs to the server connection, so another client "holds" it too...
        assert await first.fetchval("SELECT pg_try_advisory_lock(4711)") is True
        assert await second.fetchval("SELECT pg_try_advisory_lock(4711)") is True
        await second.execute("SELECT pg_advisory_unlock_all()")
        # ...whereas a transaction lock ends with the transaction that took it.
        async with first.transaction():
            assert await first.fetchval("SELECT pg_try_advisory_xact_lock(4711)") is True
        async with second.transaction():
            assert await second.fetchval("SELECT pg_try_advisory_xact_lock(4711)") is True
    finally:
        await first.close()
        await second.close()


async def test_a_dead_pgbouncer_is_reported_with_its_log(
    small_bouncer: PgBouncer, database_url: str
) -> None:
    small_bouncer.check_alive()
    small_bouncer.kill()
    with pytest.raises(ServiceError, match="pgbouncer is not running") as failure:
        small_bouncer.check_alive()
    assert "listening on" in str(failure.value)
    small_bouncer.restart()
    conn = await asyncpg.connect(small_bouncer.dsn(dbname(database_url)), statement_cache_size=0)
    assert await conn.fetchval("SELECT 1") == 1
    await conn.close()


def test_nginx_round_robins_and_passes_authorization(
    start_echo: Callable[..., Instance], start_nginx: Callable[..., Nginx]
) -> None:
    instances = [start_echo("e1"), start_echo("e2")]
    proxy = start_nginx([i.address for i in instances])
    with httpx.Client(base_url=proxy.url, timeout=5.0) as client:
        answers = [client.post("/cron/x", headers=auth_headers(), content=b"{}") for _ in range(4)]
        assert {a.status_code for a in answers} == {200}
        assert {a.json()["instance"] for a in answers} == {"e1", "e2"}
        assert answers[0].json()["authorization"] == f"Bearer {TEST_SECRET}"
        assert answers[0].json()["body"] == "{}"

        instances[0].kill()
        # A POST may have started a job: never replayed on the other instance (502)...
        posts = [client.post("/cron/x").status_code for _ in range(2)]
        assert 502 in posts
        # ...while a GET that could not connect is, transparently.
        assert {client.get("/cron/jobs").status_code for _ in range(4)} == {200}


def test_instance_freeze_thaw_terminate_kill(start_echo: Callable[..., Instance]) -> None:
    instance = start_echo("e1", env={"CRON_SECRET": TEST_SECRET, "GRACEFUL_SHUTDOWN_TIMEOUT": "1"})
    cmdline = Path(f"/proc/{instance.pid}/cmdline").read_bytes()
    assert TEST_SECRET.encode() not in cmdline
    assert httpx.get(f"{instance.url}/x").json()["instance"] == "e1"

    instance.freeze()
    with pytest.raises(httpx.TimeoutException):
        httpx.get(f"{instance.url}/x", timeout=0.5)
    instance.thaw()
    assert httpx.get(f"{instance.url}/x", timeout=5.0).status_code == 200

    instance.terminate()
    # uvicorn shuts down gracefully, then re-raises the signal so its status tells why it ended.
    assert instance.wait_exit(5.0) == -signal.SIGTERM
    assert "Shutting down" in instance.log()

    instance.restart()
    assert httpx.get(f"{instance.url}/x", timeout=5.0).status_code == 200
    instance.kill()
    assert instance.wait_exit(5.0) == -signal.SIGKILL


def test_an_instance_that_cannot_start_fails_with_its_log(
    start_echo: Callable[..., Instance],
) -> None:
    with pytest.raises(ServiceError, match='Could not import module "no_such_module"'):
        start_echo("bad", app_factory="no_such_module:create_app")


def test_sizing_leaves_room_for_every_pooled_connection() -> None:
    sizes = sizing(instances=3, pool_per_instance=10)
    assert sizes["pgbouncer_default_pool_size"] == 30
    assert sizes["pgbouncer_max_client_conn"] >= 2 * 30
    assert sizes["postgres_max_connections"] > (
        sizes["pgbouncer_default_pool_size"] + sizes["pgbouncer_reserve_pool_size"] + 3
    )
    assert sizes["nginx_worker_connections"] >= 2 * 1000 + sizes["nginx_keepalive"]
    with pytest.raises(ValueError, match="at least 1"):
        sizing(0, 10)


def test_cluster_starts_and_stops_everything(database_url: str, scratch: Path) -> None:
    require_binary("pgbouncer")
    require_binary("nginx")
    cluster = Cluster(
        scratch / "cluster",
        instances=2,
        pool_per_instance=2,
        database_url=database_url,
        app_factory=ECHO_APP,
        env={"CRON_SECRET": TEST_SECRET},
    )
    cluster.start()
    try:
        assert cluster.nginx is not None
        seen = {httpx.get(f"{cluster.nginx.url}/x").json()["instance"] for _ in range(4)}
        assert seen == {"i1", "i2"}
        assert "curl" in cluster.describe()
        assert TEST_SECRET not in cluster.describe()
    finally:
        cluster.stop()
    assert not any(service.is_alive() for service in cluster.services())
