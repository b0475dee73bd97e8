"""The fault tests' cluster (tests.support.cluster.Cluster: PgBouncer in transaction mode, uvicorn
instances, nginx) and the checks every fault test ends with: no effect committed twice,
nothing committed lost, no lock, transaction or waiting client left behind."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from cronlock.cli.embedded import find_bindir
from tests.fault_jobs import GATE_BASE
from tests.jobs import EFFECTS_SQL
from tests.support import TEST_SECRET
from tests.support.cluster import Cluster, Instance, PgBouncer

# What every cluster instance runs with. DB_TIMEOUT_MARGIN is short so that the database's
# own timeouts (job timeout + margin) free the lock of a frozen or blocked instance quickly.
CLUSTER_ENV = {
    "CRON_SECRET": TEST_SECRET,
    "CRON_JOBS": "tests.jobs,tests.fault_jobs",
    "OUTBOX_ENABLED": "false",
    "DB_TIMEOUT_MARGIN": "1",
    "DB_ACQUIRE_TIMEOUT": "2",
    "DB_QUERY_TIMEOUT": "3",
    "MIGRATE_RETRY_INTERVAL": "0.5",
    "GRACEFUL_SHUTDOWN_TIMEOUT": "3",
    "LOG_FORMAT": "text",
}
DB_TIMEOUT_MARGIN = float(CLUSTER_ENV["DB_TIMEOUT_MARGIN"])
DB_QUERY_TIMEOUT = float(CLUSTER_ENV["DB_QUERY_TIMEOUT"])
GRACEFUL_SHUTDOWN_TIMEOUT = float(CLUSTER_ENV["GRACEFUL_SHUTDOWN_TIMEOUT"])
# What would mean an answer leaked internals: a stack trace, the driver, a DSN, the secret.
LEAKS = ("Traceback", 'File "', "asyncpg", "postgresql://", TEST_SECRET)


def start_cluster(
    root: Path,
    database_url: str,
    *,
    instances: int = 3,
    pool_per_instance: int = 10,
    env: dict[str, str] | None = None,
) -> Cluster:
    """PgBouncer, `instances` uvicorn processes and nginx in front of `database_url`, sized
    by app.sizing.sizing, each instance ready (its /readyz answers 200) when returned."""
    cluster = Cluster(
        root,
        instances=instances,
        pool_per_instance=pool_per_instance,
        database_url=database_url,
        env={**CLUSTER_ENV, **(env or {})},
    )
    cluster.start()
    try:
        for instance in cluster.instances:
            wait_ready(instance)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def wait_ready(instance: Instance, timeout: float = 20.0) -> None:
    """Until the instance's /readyz answers 200 (it has seen the database migrated)."""
    deadline = time.monotonic() + timeout
    while True:
        instance.check_alive()
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(instance.url + "/readyz", timeout=5.0).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"{instance.name} not ready after {timeout} s")
        time.sleep(0.1)


def heal(cluster: Cluster) -> None:
    """Bring back instances a previous test killed, froze or shut down; PgBouncer and nginx
    are never brought back: one that died fails the test with its log."""
    assert cluster.pgbouncer is not None
    assert cluster.nginx is not None
    cluster.pgbouncer.thaw()
    cluster.pgbouncer.check_alive()
    cluster.nginx.check_alive()
    for instance in cluster.instances:
        instance.thaw()
        if not instance.is_alive():
            instance.start()
    for instance in cluster.instances:
        wait_ready(instance)


async def reset(db: asyncpg.Connection) -> None:
    """An empty ledger and no effects: each test counts its own."""
    await db.execute("SELECT pg_advisory_xact_lock(424242)")  # tests.jobs.record's lock
    await db.execute(EFFECTS_SQL)
    await db.execute("TRUNCATE job_effects, cronlock.runs")


# --- nothing twice, nothing lost ----------------------------------------------------------


async def check_books(db: asyncpg.Connection, answers: Iterable[httpx.Response] = ()) -> None:
    """Every effect belongs to a succeeded run and every succeeded run has exactly one effect
    (each test job records one effect per run), and every run a 200 answer reported as done
    is in the ledger as succeeded."""
    effects = await db.fetch("SELECT job, run_id, count(*) AS n FROM job_effects GROUP BY 1, 2")
    twice = [dict(r) for r in effects if r["n"] != 1]
    assert not twice, f"effects committed more than once: {twice}"
    succeeded = {
        r["id"]: r["job"]
        for r in await db.fetch("SELECT id, job FROM cronlock.runs WHERE status = 'succeeded'")
    }
    with_effects = {r["run_id"]: r["job"] for r in effects}
    assert with_effects == succeeded, (
        f"effects {sorted(with_effects.items())} != succeeded runs {sorted(succeeded.items())}"
    )
    for answer in answers:
        if answer.status_code == 200 and "processed" in answer.json():
            run_id = answer.json()["run_id"]
            assert run_id in succeeded, f"run {run_id} answered as done is not in the ledger"


# --- nothing left behind ------------------------------------------------------------------

LEFT_SQL = """
SELECT
  (SELECT coalesce(json_agg(json_build_object('pid', l.pid, 'objid', l.objid,
                                              'granted', l.granted)), '[]')
   FROM pg_locks l
   WHERE l.locktype = 'advisory'
     AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
     AND l.pid <> pg_backend_pid()) AS locks,
  (SELECT coalesce(json_agg(json_build_object('pid', a.pid, 'state', a.state,
                                              'app', a.application_name,
                                              'query', left(a.query, 80))), '[]')
   FROM pg_stat_activity a
   WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
     AND a.backend_type = 'client backend' AND a.state IS DISTINCT FROM 'idle') AS busy,
  (SELECT count(*) FROM pg_stat_activity a
   WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
     AND a.backend_type = 'client backend') AS backends
"""


def pgbouncer_show(bouncer: PgBouncer, what: str) -> list[dict[str, str]]:
    """`SHOW <what>` on PgBouncer's admin console (simple query protocol only: psql)."""
    out = subprocess.run(
        [
            str(find_bindir() / "psql"),
            "-X",
            "-h",
            "127.0.0.1",
            "-p",
            str(bouncer.port),
            "-U",
            bouncer.upstream_user,
            "-d",
            "pgbouncer",
            "-A",
            "-F",
            "\t",
            "-P",
            "footer=off",
            "-c",
            f"SHOW {what}",
        ],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    if out.returncode != 0:
        bouncer.check_alive()
        raise AssertionError(f"SHOW {what} failed: {out.stderr.strip()}")
    lines = out.stdout.splitlines()
    header = lines[0].split("\t")
    return [dict(zip(header, line.split("\t"), strict=True)) for line in lines[1:]]


async def leftovers(
    db: asyncpg.Connection, cluster: Cluster, dbname: str | None = None
) -> dict[str, Any]:
    """What is still held or busy in the test's database and in PgBouncer, and whether the
    connections add up: every PgBouncer client and server must fit the live instances'
    pools (a killed or frozen instance's sessions must be gone)."""
    assert cluster.pgbouncer is not None
    row = await db.fetchrow(LEFT_SQL)
    assert row is not None
    name = dbname or await db.fetchval("SELECT current_database()")
    pools = [p for p in pgbouncer_show(cluster.pgbouncer, "POOLS") if p["database"] == name]
    clients = [c for c in pgbouncer_show(cluster.pgbouncer, "CLIENTS") if c["database"] == name]
    live = sum(1 for i in cluster.instances if i.is_alive())
    found: dict[str, Any] = {}
    locks = _json(row["locks"])
    if locks:
        found["advisory locks"] = locks
    busy = _json(row["busy"])
    if busy:
        found["sessions not idle"] = busy
    server_room = cluster.sizes["pgbouncer_default_pool_size"]
    server_room += cluster.sizes["pgbouncer_reserve_pool_size"]
    if row["backends"] > server_room:
        found["backends"] = row["backends"]
    for pool in pools:
        if int(pool["cl_waiting"]) or int(pool["sv_active"]):
            found["pgbouncer pool"] = pool
    if len(clients) > live * cluster.pool_per_instance:
        found["pgbouncer clients"] = len(clients)
    return found


async def settle(
    db: asyncpg.Connection, cluster: Cluster, *, within: float = 10.0, dbname: str | None = None
) -> float:
    """Wait until nothing is left behind (see `leftovers`); returns how long it took."""
    started = time.monotonic()
    while True:
        found = await leftovers(db, cluster, dbname)
        if not found:
            return time.monotonic() - started
        if time.monotonic() - started > within:
            raise AssertionError(f"left behind after {within} s: {found}")
        await asyncio.sleep(0.1)


def _json(value: Any) -> Any:
    import json

    return json.loads(value) if isinstance(value, str) else value


# --- answers ------------------------------------------------------------------------------


def assert_clean_error(answer: httpx.Response, statuses: Iterable[int]) -> dict[str, Any]:
    """A JSON error answer with one of `statuses`, no stack trace, no internals."""
    assert answer.status_code in set(statuses), (answer.status_code, answer.text)
    assert answer.headers["content-type"].startswith("application/json"), answer.text
    for leak in LEAKS:
        assert leak not in answer.text, answer.text
    body: dict[str, Any] = answer.json()
    assert "error" in body, body
    if answer.status_code == 503:
        assert answer.headers.get("retry-after"), answer.headers
    return body


@contextlib.asynccontextmanager
async def gate(dsn: str, key: int = 0) -> AsyncIterator[asyncpg.Connection]:
    """Hold the gate a `gated` run waits for; it opens when the block ends."""
    conn = await asyncpg.connect(dsn, statement_cache_size=0)
    try:
        await conn.execute("SELECT pg_advisory_lock($1)", GATE_BASE + key)
        yield conn
    finally:
        await conn.close()
