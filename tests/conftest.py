"""Real PostgreSQL, PgBouncer, nginx and uvicorn processes for the tests. Nothing is faked.

- `pg_server` (session): a throwaway local server, or `DATABASE_URL`'s when set.
- `template_database` (session): migrated once; `database_url`/`db` clone it per test.
- `make_settings`; `start_app` (the app in this process, over httpx.ASGITransport) or
  `start_instance` (a real uvicorn process); `client` reaches either by its `url`.
- `pgbouncer` (session), `start_nginx` (factory): the pooler and the proxy (marker `cluster`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Generator, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import asyncpg
import httpx
import pytest

from tests.support import TEST_SECRET
from tests.support.asgi import Dispatch, InProcess, StartApp, serve
from tests.support.binaries import require_binary
from tests.support.cluster import Cluster, Instance, Nginx, PgBouncer
from tests.support.delivery import API_KEY
from tests.support.faults import start_cluster
from tests.support.instances import INSTANCE_STOP_GRACE, Instances
from tests.support.postgres import (
    Clones,
    ExternalPostgres,
    PostgresServer,
    ScratchPostgres,
    cloned_database,
    create_database,
    drop_database,
    unique_name,
)
from tests.support.provider import Provider

if TYPE_CHECKING:
    from cronlock.settings import Settings
    from tests.support.patroni import PatroniCluster

CLUSTER_FIXTURES = ("pgbouncer", "start_nginx", "make_cluster")
# Real app processes (uvicorn instances): what `./scripts/test --fast` leaves out, with the
# tests marked `slow` by hand (other processes: the CLI, outbox workers, a wheel build).
PROCESS_FIXTURES = ("instances", "report_logs", "patroni_cluster")
INSTANCES_KEY = pytest.StashKey[list[Instance | InProcess]]()
READY_TIMEOUT = 30.0


# The modules that take longest (seconds of one CI run; the fast tier's share where it has
# one): the fast tier's longest by far (test_lease.py), then the full suite's, longest first.
# With --no-loadscope-reorder (scripts/test) xdist hands out modules in collection order, so
# starting these first keeps one worker from running a long module alone at the end. Only
# the order depends on this list; a name that is gone is no error, only no longer first.
LONGEST_FIRST = (
    "test_lease.py",  # 33 s, 25 of them fast
    "test_schedules_dst.py",  # 112, waiting on two servers' clocks at once
    "test_failover_patroni.py",  # 73
    "test_lease_faults.py",  # 63
    "test_soak.py",  # 63
    "test_outbox.py",  # 61, 10 of them fast
    "test_hostile.py",  # 53
    "test_cluster_faults.py",  # 47
    "test_batch.py",  # 45
    "test_mailer.py",  # 43, 9 fast
    "test_keyed.py",  # 43
    "test_on_its_own.py",  # 36
    "test_cli.py",  # 35, 9 fast
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # `-m "not cluster and not slow"` (./scripts/test --fast) then deselects every test that
    # needs PgBouncer or nginx, or starts app processes.
    for item in items:
        names = getattr(item, "fixturenames", ())
        if any(name in names for name in CLUSTER_FIXTURES):
            item.add_marker(pytest.mark.cluster)
        if any(name in names for name in PROCESS_FIXTURES):
            item.add_marker(pytest.mark.slow)
    rank = {name: n for n, name in enumerate(LONGEST_FIRST)}
    # A stable sort: each module's tests stay together and in their order.
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed and report.when in ("call", "setup"):
        for instance in item.stash.get(INSTANCES_KEY, []):
            report.sections.append((f"instance {instance.name} log", instance.log_tail(80)))
    return report


def _scratch_dir(prefix: str) -> Path:
    # Under /tmp, not pytest's 0700 basetemp: servers run as `postgres` when we are root,
    # and unix socket paths must stay short.
    return Path(tempfile.mkdtemp(prefix=prefix))


# --- PostgreSQL ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresServer]:
    """The session's PostgreSQL: `DATABASE_URL` if set, else a fast local throwaway server."""
    url = os.environ.get("DATABASE_URL")
    if url:
        yield ExternalPostgres(url)
        return
    root = _scratch_dir("cronlock-pg-")
    server = ScratchPostgres(root / "pg")
    try:
        server.start()
        yield server
    finally:
        server.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
async def template_database(pg_server: PostgresServer) -> AsyncIterator[str]:
    """A database migrated once per session, cloned by `database_url` for every test."""
    from cronlock.db.schema import migrate, migration_sets

    name = unique_name("cronlock_template")
    admin = pg_server.dsn("postgres")
    await create_database(admin, name)
    conn = await asyncpg.connect(pg_server.dsn(name), statement_cache_size=0)
    try:
        # cronlock's and the demo's (tests load cronlock.demo.digest too), as instances would.
        await migrate(conn, "cronlock", migration_sets(["cronlock.demo.digest"]))
    finally:
        await conn.close()
    yield name
    await drop_database(admin, name)


@pytest.fixture(scope="session")
async def clones(pg_server: PostgresServer, template_database: str) -> AsyncIterator[Clones]:
    """Copies of the template for `database_url`, each made while the test before runs."""
    made = Clones(pg_server, template_database)
    try:
        yield made
    finally:
        await made.close()


@pytest.fixture
async def database_url(clones: Clones) -> AsyncIterator[str]:
    """A fresh, migrated database for this test only (dropped afterwards)."""
    async with clones.database() as url:
        yield url


@pytest.fixture
async def fresh_url(pg_server: PostgresServer) -> AsyncIterator[str]:
    """An empty database (not migrated), dropped afterwards."""
    name = unique_name("fresh")
    admin = pg_server.dsn("postgres")
    await create_database(admin, name)
    try:
        yield pg_server.dsn(name)
    finally:
        await drop_database(admin, name)


@pytest.fixture(scope="module")
async def module_database_url(
    request: pytest.FixtureRequest, pg_server: PostgresServer, template_database: str
) -> AsyncIterator[str]:
    """A migrated database the tests of one module share, with the processes the module starts
    once for them all (its cluster, its instances). Such a module overrides `database_url`
    with it (so `db`, `start_instance`, `make_settings` follow), and each test resets what it
    counts (tests.support.faults.reset)."""
    prefix = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    async with cloned_database(pg_server, template_database, prefix) as url:
        yield url


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection straight to this test's database (never through PgBouncer)."""
    conn = await asyncpg.connect(database_url, statement_cache_size=0)
    try:
        yield conn
    finally:
        await conn.close()


# --- the app ------------------------------------------------------------------------------


@pytest.fixture
def make_settings(database_url: str) -> Callable[..., Settings]:
    """`make_settings(**overrides)`: Settings for this test's database, short timers, no .env."""
    from cronlock.settings import Settings

    def make(**overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "database_url": database_url,
            "cron_secret": TEST_SECRET,
            "cron_jobs": "tests.jobs",
            "db_acquire_timeout": 2.0,
            "migrate_retry_interval": 0.2,
            "outbox_poll_interval": 0.2,
            "outbox_enabled": False,
        }
        values.update(overrides)
        return Settings(_env_file=None, **values)

    return make


@pytest.fixture
def dispatch() -> Dispatch:
    """Where `client` sends a request: to an in-process app by its url, else the network."""
    # Idle connections expire well before uvicorn's 5 s keep-alive: reusing one the server is
    # closing at that moment fails the request (httpx.ReadError) instead of retrying it.
    return Dispatch(limits=httpx.Limits(max_connections=200, keepalive_expiry=2.0))


@pytest.fixture
async def client(dispatch: Dispatch) -> AsyncIterator[httpx.AsyncClient]:
    """The test's HTTP client, for `start_app` apps and real processes alike."""
    async with httpx.AsyncClient(transport=dispatch, timeout=60) as c:
        yield c


@pytest.fixture
async def start_app(
    request: pytest.FixtureRequest,
    make_settings: Callable[..., Settings],
    dispatch: Dispatch,
    database_url: str,
) -> AsyncIterator[StartApp]:
    """`await start_app(name="app", **settings)`: the app (`create_app(make_settings(...))`)
    served in this process, its lifespan run, shut down at teardown. For tests where no
    process boundary is under test (uvicorn, signals, several processes at once).

    Returned once ready, as `start_instance`: /readyz = 200 on this test's database, or
    /healthz = 200 when `database_url` points elsewhere."""
    from cronlock.service import create_app

    started = request.node.stash.setdefault(INSTANCES_KEY, [])
    async with contextlib.AsyncExitStack() as stack:

        async def start(name: str = "app", **overrides: Any) -> InProcess:
            overrides.setdefault("graceful_shutdown_timeout", INSTANCE_STOP_GRACE)
            settings = make_settings(instance_name=name, **overrides)
            app = create_app(settings)
            served = await stack.enter_async_context(serve(app, name, settings.log_level))
            started.append(served)
            dispatch.add(served)
            own = settings.database_url == database_url
            await _ready(served, "/readyz" if own else "/healthz")
            return served

        yield start


async def _ready(served: InProcess, path: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    async with httpx.AsyncClient(transport=served.transport, base_url=served.url) as probe:
        while (await probe.get(path)).status_code != 200:
            if time.monotonic() > deadline:
                raise AssertionError(f"{served.name}: {path} not 200 after {READY_TIMEOUT} s")
            await asyncio.sleep(0.02)


@pytest.fixture
def instances(
    request: pytest.FixtureRequest, database_url: str, tmp_path: Path
) -> Iterator[Instances]:
    """This test's real instances (see `start_instance`), stopped at teardown."""
    reported = request.node.stash.setdefault(INSTANCES_KEY, [])
    started = Instances(database_url, tmp_path / "instances", reported)
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def start_instance(instances: Instances) -> Callable[..., Instance]:
    """`start_instance(name="i1", env=None, **kw)`: a real uvicorn process on this test's
    database, stopped at teardown; `kw` goes to `Instance` (port, app_factory, ready_path...).
    Returned once ready (see `Instances`)."""
    return instances.start


@pytest.fixture
def start_instances(instances: Instances) -> Callable[..., list[Instance]]:
    """`start_instances(names, env=None, **kw)`: several at once, started in parallel."""
    return instances.start_many


@pytest.fixture
def report_logs(request: pytest.FixtureRequest) -> Callable[[Iterable[Instance]], None]:
    """`report_logs(instances)`: instances started outside `start_instance` (a module's own
    cluster) whose log tails go into this test's report if it fails."""

    def attach(instances: Iterable[Instance]) -> None:
        request.node.stash.setdefault(INSTANCES_KEY, []).extend(instances)

    return attach


# --- PgBouncer and nginx ------------------------------------------------------------------


@pytest.fixture(scope="session")
def pgbouncer(pg_server: PostgresServer) -> Iterator[PgBouncer]:
    """PgBouncer (transaction mode) in front of `pg_server`; `pgbouncer.dsn(db)` for a db.

    If it dies during a test, that test errors with PgBouncer's log; it is never restarted.
    """
    require_binary("pgbouncer")
    root = _scratch_dir("cronlock-bouncer-")
    user = password = None
    if isinstance(pg_server, ExternalPostgres):
        user, password = pg_server.username, pg_server.password
    bouncer = PgBouncer(
        pg_server.host,
        pg_server.port,
        pool_mode="transaction",
        default_pool_size=20,
        max_client_conn=500,
        dir=root,
        upstream_user=user or "postgres",
        upstream_password=password,
    )
    try:
        bouncer.start()
        yield bouncer
        bouncer.check_alive()
    finally:
        bouncer.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(autouse=True)
def _cluster_liveness(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail the test (with the log) whose run saw the session PgBouncer die."""
    if "pgbouncer" not in request.fixturenames:
        yield
        return
    bouncer: PgBouncer = request.getfixturevalue("pgbouncer")
    bouncer.check_alive()
    yield
    bouncer.check_alive()


@pytest.fixture(scope="module")
def make_cluster() -> Iterator[Callable[..., Cluster]]:
    """`make_cluster(database_url, **kw)`: a module's cluster (PgBouncer, uvicorn instances,
    nginx: tests.support.faults.start_cluster), each instance ready; stopped after the
    module's last test."""
    require_binary("pgbouncer")
    require_binary("nginx")
    root = _scratch_dir("cronlock-cluster-")
    started: list[Cluster] = []

    def make(database_url: str, **kw: Any) -> Cluster:
        cluster = start_cluster(root / f"cluster{len(started)}", database_url, **kw)
        started.append(cluster)
        return cluster

    try:
        yield make
    finally:
        for cluster in started:
            cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def start_nginx() -> Iterator[Callable[..., Nginx]]:
    """`start_nginx(upstreams, **kw)`: nginx on a free port proxying to "host:port"s."""
    require_binary("nginx")
    started: list[tuple[Nginx, Path]] = []

    def start(upstreams: list[str], **kw: Any) -> Nginx:
        root = _scratch_dir("cronlock-nginx-")
        proxy = Nginx(upstreams, dir=root, **kw)
        started.append((proxy, root))
        proxy.start()
        return proxy

    yield start
    for proxy, root in started:
        proxy.stop()
        shutil.rmtree(root, ignore_errors=True)


# --- a highly available PostgreSQL ------------------------------------------------------


@pytest.fixture(scope="session")
def patroni_cluster() -> Iterator[PatroniCluster]:
    """etcd and two Patroni nodes on loopback (tests/support/patroni.py), once per session:
    bootstrapping takes seconds, a hard failover tens of them."""
    from tests.support.patroni import PatroniCluster, available

    missing = available()
    if missing is not None:
        pytest.skip(missing)
    root = _scratch_dir("cronlock-ha-")
    cluster = PatroniCluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


# --- email delivery -------------------------------------------------------------------------


@pytest.fixture
def provider() -> Iterator[Provider]:
    with Provider() as p:
        yield p


@pytest.fixture
def outbox_settings(
    make_settings: Callable[..., Settings], provider: Provider
) -> Callable[..., Settings]:
    """Settings for a sender talking to the provider stand-in (tests/support/provider.py):
    fast timers, no rate limit."""

    def make(**overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "email_backend": "http",
            "email_api_url": provider.url,
            "email_api_key": API_KEY,
            "outbox_rate_limit": 0,
            "outbox_lease": 5.0,
            "outbox_send_timeout": 2.0,
            "outbox_backoff_base": 0.2,
            "outbox_backoff_max": 5.0,
            "outbox_poll_interval": 0.1,
            "outbox_shutdown_timeout": 2.0,
            "outbox_batch_size": 20,
            "outbox_concurrency": 4,
        }
        values.update(overrides)
        return make_settings(**values)

    return make
