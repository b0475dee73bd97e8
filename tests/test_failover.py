"""Following the primary (a multi-host DATABASE_URL, host by host) and refusing a stale one
(the timeline guard), on real PostgreSQL servers: a primary, streaming standbys of it, and
real signals (SIGSTOP: a server that accepts TCP and never answers)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest

from cronlock.db import pool as dbmod
from cronlock.db.primary import parse_timeline
from cronlock.db.schema import migrate, migration_sets
from cronlock.settings import Settings, split_hosts
from tests.lease_jobs import LEASE_SETTINGS, create_effects
from tests.support import TEST_SECRET
from tests.support.asgi import StartApp
from tests.support.delivery import API_KEY, until
from tests.support.metrics import METRICS_TOKEN, scrape, value
from tests.support.postgres import ScratchPostgres, children_of, create_database, start_standby
from tests.support.provider import Provider
from tests.util import AUTH, seen_since

DBNAME = "failover"


def multi_host(*servers: ScratchPostgres) -> str:
    hosts = ",".join(f"127.0.0.1:{s.port}" for s in servers)
    return f"postgresql://postgres@{hosts}/{DBNAME}?target_session_attrs=read-write"


@contextlib.contextmanager
def frozen(server: ScratchPostgres) -> Iterator[None]:
    """SIGSTOP the postmaster: the kernel still accepts connections, nobody answers."""
    pid = server.postmaster_pid()
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.fixture(scope="module")
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cronlock-fo-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def new_primary(path: Path) -> ScratchPostgres:
    """A primary of its own (tests here promote its standbys or kill it), with a migrated
    database holding the demo's users."""
    server = ScratchPostgres(path)
    server.start()
    await create_database(server.dsn(), DBNAME)
    conn = await asyncpg.connect(server.dsn(DBNAME))
    try:
        await migrate(conn, "cronlock", migration_sets(["cronlock.demo.digest"]))
        await conn.execute(
            "INSERT INTO cronlock_demo.users (email) "
            "SELECT 'user' || i || '@example.com' FROM generate_series(1, 5) AS i"
        )
    finally:
        await conn.close()
    return server


@pytest.fixture(scope="module")
async def primary(root: Path) -> AsyncIterator[ScratchPostgres]:
    server = await new_primary(root / "primary")
    try:
        yield server
    finally:
        server.stop("immediate")


@pytest.fixture
def standby(primary: ScratchPostgres, root: Path) -> Iterator[ScratchPostgres]:
    path = root / f"standby-{time.monotonic_ns()}"
    server = start_standby(primary, path)
    try:
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            pid = server.postmaster_pid()
            if pid is not None:
                os.kill(pid, signal.SIGCONT)
        server.stop("immediate")
        shutil.rmtree(path, ignore_errors=True)


async def trigger(client: httpx.AsyncClient, url: str, job: str = "fast") -> httpx.Response:
    return await client.post(f"{url}/cron/{job}", headers=AUTH, timeout=30)


def test_split_hosts() -> None:
    assert split_hosts("postgresql://u:p@a:5432,[::1]:5433,c/db?x=1") == [
        ("a", 5432),
        ("::1", 5433),
        ("c", None),
    ]
    assert split_hosts("postgresql:///db?host=/run/postgresql") == [("", None)]
    assert parse_timeline("000000020000000000000003") == 2
    assert parse_timeline("0000001A0000000000000003") == 26
    assert parse_timeline(None) is None


@pytest.mark.slow
async def test_connect_skips_a_frozen_first_host(
    primary: ScratchPostgres, standby: ScratchPostgres
) -> None:
    """asyncpg alone puts one timeout around the whole host list: the frozen first host would
    use it up. Host by host, the second host is reached within the first one's timeout."""
    url = multi_host(standby, primary)
    settings = Settings(_env_file=None, database_url=url, db_connect_timeout=1.0)
    with frozen(standby):
        start = time.monotonic()
        conn = await dbmod.connect(settings)
        took = time.monotonic() - start
        try:
            assert not await conn.fetchval("SELECT pg_is_in_recovery()")
            assert await conn.fetchval("SELECT inet_server_port()") == primary.port
        finally:
            await conn.close()
        assert 0.9 < took < 3.0, took
        # asyncpg's own multi-host connect, for comparison: nothing connects.
        with pytest.raises(TimeoutError):
            await asyncpg.connect(url, timeout=1.0)


@pytest.mark.slow
async def test_instance_follows_the_primary_past_a_frozen_host(
    primary: ScratchPostgres,
    standby: ScratchPostgres,
    start_app: StartApp,
    client: httpx.AsyncClient,
) -> None:
    """An instance whose first host is a frozen server serves jobs from the second, and once
    one connect attempt gave up on the frozen host (even one the pool's acquire timeout
    cancelled), new connections start with the host that works."""
    url = multi_host(standby, primary)
    with frozen(standby):
        # A connect timeout longer than the acquire timeout: the first acquire is cancelled
        # while waiting on the frozen host.
        app = await start_app(
            "follower", database_url=url, db_connect_timeout=5.0, db_acquire_timeout=1.5
        )
        answers = [await trigger(client, app.url) for _ in range(5)]
        codes = [a.status_code for a in answers]
        assert codes[-1] == 200, [a.text for a in answers]
        # At most the first trigger waited on the frozen host (503, acquire timed out).
        assert codes.count(503) <= 1, codes
        assert (await client.get(f"{app.url}/readyz")).status_code == 200


@pytest.mark.slow
async def test_stale_primary_is_refused(
    primary: ScratchPostgres,
    standby: ScratchPostgres,
    start_app: StartApp,
    client: httpx.AsyncClient,
) -> None:
    """The standby is promoted (timeline 2) while the old primary (timeline 1) keeps running,
    unfenced: two primaries. An instance that ran a job on the new one refuses the old one
    when it is all it can reach; an instance started since cannot know (the guard's limit)."""
    promoted = await asyncpg.connect(standby.dsn(DBNAME))
    try:
        assert await promoted.fetchval("SELECT pg_promote(wait => true)")
        walfile = await promoted.fetchval("SELECT pg_walfile_name(pg_current_wal_lsn())")
    finally:
        await promoted.close()
    assert parse_timeline(walfile) == 2
    url = multi_host(primary, standby)  # the old primary first, as measured in the issue
    with frozen(primary):
        app = await start_app("saw-new", database_url=url, db_connect_timeout=1.0)
        first = await trigger(client, app.url)
        assert first.status_code == 200, first.text
    # The old primary is back (thawed) and the new one goes away: reconnecting, the instance
    # can reach only the old primary.
    standby.stop("fast")
    # Pooled connections to the new primary die first (503 "connection lost"), then the
    # instance reconnects and finds only the old primary.
    answers = [await trigger(client, app.url) for _ in range(4)]
    assert [a.status_code for a in answers] == [503] * 4, [a.text for a in answers]
    answer = answers[-1]
    reason = answer.json()["reason"]
    for said in ("stale primary", "timeline 1", "timeline 2"):
        assert said in reason
    for leak in (TEST_SECRET, "Traceback", "asyncpg"):
        assert leak not in answer.text
    ready = await client.get(f"{app.url}/readyz")
    assert ready.status_code == 503
    # What the guard cannot catch: an instance that never saw timeline 2 runs there.
    fresh = await start_app("never-saw", database_url=url, db_connect_timeout=1.0)
    assert (await trigger(client, fresh.url)).status_code == 200


async def connect_retrying(dsn: str) -> asyncpg.Connection:
    deadline = time.monotonic() + 20
    while True:
        try:
            return await asyncpg.connect(dsn)
        except (OSError, asyncpg.PostgresError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


def walreceiver(standby: ScratchPostgres) -> int:
    pid = standby.postmaster_pid()
    assert pid is not None
    for child in children_of(pid):
        with contextlib.suppress(OSError):
            if b"walreceiver" in Path(f"/proc/{child}/cmdline").read_bytes():
                return child
    raise AssertionError("no walreceiver")


async def fail_over(
    old: ScratchPostgres, new: ScratchPostgres, receiver: int
) -> asyncpg.Connection:
    """The primary dies while its standby is behind (`receiver`, its walreceiver, frozen), and
    the standby is promoted; returns a connection to it. The walreceiver is killed, not
    resumed: the WAL waiting in its socket's buffer must never be read (the standby's
    postmaster restarts its processes, recovering from its own WAL)."""
    old.kill()
    os.kill(receiver, signal.SIGKILL)
    new.wait_ready()
    promoted = await connect_retrying(new.dsn(DBNAME))
    try:
        assert await promoted.fetchval("SELECT pg_promote(wait => true)")
    except BaseException:
        await promoted.close()
        raise
    return promoted


@pytest.mark.slow
async def test_asynchronous_failover_loses_an_answered_run_and_its_emails_keep_their_keys(
    root: Path, start_app: StartApp, client: httpx.AsyncClient, provider: Provider
) -> None:
    """Asynchronous replication, a standby behind (its walreceiver frozen): the digest answered
    200 and its emails delivered on the old primary, which then dies. The promoted standby never
    had that run: the slot runs again there, and its emails carry the same idempotency keys, so
    the provider (which honours keys) delivers each once. `cronlock_job_overdue` follows the
    surviving ledger: 0 after the run, 1 once the promoted server lacks it, 0 after the re-run
    (the digest's due slot always exists: today's 07:00, or yesterday's while today's is
    within its grace); the last success's series goes with the lost run."""
    old = await new_primary(root / f"lossy-{time.monotonic_ns()}")
    conn = await asyncpg.connect(old.dsn(DBNAME))
    try:
        await seen_since(conn, "daily-digest")  # deployed long ago: its due slot counts
    finally:
        await conn.close()
    new = start_standby(old, root / f"lossy-standby-{time.monotonic_ns()}")
    try:
        url = multi_host(old, new)
        app = await start_app(
            "lossy",
            database_url=url,
            db_connect_timeout=1.0,
            cron_jobs="cronlock.demo.digest",
            outbox_enabled=True,
            email_backend="http",
            email_api_url=provider.url,
            email_api_key=API_KEY,
            outbox_rate_limit=0,
            outbox_poll_interval=0.1,
            outbox_shutdown_timeout=1.0,
            metrics_token=METRICS_TOKEN,
        )

        async def overdue() -> float | None:
            samples = await scrape(client, app.url)
            if value(samples, "cronlock_database_up") != 1:
                return None  # not through to the primary yet
            late = value(samples, "cronlock_job_overdue", job="daily-digest")
            assert value(samples, "cronlock_overdue_jobs") == late  # the only scheduled job
            last = "cronlock_job_last_success_slot_timestamp_seconds"
            assert (value(samples, last, job="daily-digest") is None) == (late == 1)
            return late

        assert await overdue() == 1  # never run in this database
        receiver = walreceiver(new)
        os.kill(receiver, signal.SIGSTOP)
        first = await trigger(client, app.url, "daily-digest")
        assert first.status_code == 200, first.text
        assert first.json()["processed"] == 5
        # Polled, not provider.wait: the app's sender runs on this event loop.
        await until(lambda: len(provider.delivered()) == 5, 10, "the first digest's emails")
        keys = set(provider.delivered())
        assert await overdue() == 0
        promoted = await fail_over(old, new, receiver)
        try:
            # The run answered 200 is not there: lost with the old primary.
            assert await promoted.fetchval("SELECT count(*) FROM cronlock.runs") == 0
        finally:
            await promoted.close()

        async def overdue_is(expected: float) -> bool:
            return await overdue() == expected

        # The answered run is gone with the old primary: overdue again.
        await until(lambda: overdue_is(1), 10, "overdue once the run is lost")
        again = await trigger(client, app.url, "daily-digest")
        for _ in range(10):
            if again.status_code == 200:
                break
            again = await trigger(client, app.url, "daily-digest")
        assert again.status_code == 200, again.text
        assert again.json()["processed"] == 5  # the slot ran again
        assert again.json()["slot"] == first.json()["slot"]
        conn = await asyncpg.connect(new.dsn(DBNAME))
        try:
            requeued = {
                r["idempotency_key"]
                for r in await conn.fetch("SELECT idempotency_key FROM cronlock.email_outbox")
            }
        finally:
            await conn.close()
        assert requeued == keys
        assert await overdue() == 0
        await until(
            lambda: all(len(provider.for_key(k)) >= 2 for k in keys), 10, "the re-sent emails"
        )
        # Sent twice, delivered once each.
        assert provider.delivered() == {key: 1 for key in keys}
    finally:
        new.stop("immediate")
        old.stop("immediate")


@pytest.mark.slow  # a standby server of its own
async def test_database_up_is_0_while_only_a_standby_answers_then_1_once_it_is_promoted(
    standby: ScratchPostgres, start_app: StartApp, client: httpx.AsyncClient
) -> None:
    """docs/guarantees.md's alerts line: `cronlock_database_up` reads 0 on an instance while
    it cannot reach a primary (all it reaches here is a standby, whose reads would succeed),
    and 1 once that server is promoted; triggers answer 503 until then, and run after."""
    app = await start_app(
        "on-standby", database_url=standby.dsn(DBNAME), metrics_token=METRICS_TOKEN
    )
    refused = await trigger(client, app.url)
    assert refused.status_code == 503, refused.text
    assert value(await scrape(client, app.url), "cronlock_database_up") == 0
    promoted = await asyncpg.connect(standby.dsn(DBNAME))
    try:
        assert await promoted.fetchval("SELECT pg_promote(wait => true)")
    finally:
        await promoted.close()

    async def up() -> bool:
        return value(await scrape(client, app.url), "cronlock_database_up") == 1

    await until(up, 10, "database_up 1 after the promotion")
    ran = await trigger(client, app.url)
    assert ran.status_code == 200, ran.text


@pytest.mark.slow  # two PostgreSQL servers of its own
async def test_asynchronous_failover_loses_lease_steps_and_the_takeover_does_them_again_once(
    root: Path, start_app: StartApp, client: httpx.AsyncClient
) -> None:
    """Asynchronous replication, the standby behind (its walreceiver frozen) while a lease
    run commits steps on the old primary, which then dies. The promoted standby has the run
    only up to its last replicated checkpoint: a watcher takes the run over there once the
    lease is out and does the lost steps again, so every item is there once (docs/guarantees.md,
    lease runs)."""
    old = await new_primary(root / f"lossy-lease-{time.monotonic_ns()}")
    conn = await asyncpg.connect(old.dsn(DBNAME))
    try:
        await create_effects(conn)  # in the base backup the standby starts from
    finally:
        await conn.close()
    new = start_standby(old, root / f"lossy-lease-standby-{time.monotonic_ns()}")
    try:
        app = await start_app(
            "lossy-lease",
            database_url=multi_host(old, new),
            db_connect_timeout=1.0,
            cron_jobs="tests.lease_jobs",
            **LEASE_SETTINGS,
        )
        started = await client.post(
            f"{app.url}/cron/lease-items", headers=AUTH, json={"n": 30, "batch": 2, "pause": 0.3}
        )
        assert started.status_code == 202, started.text
        run_id = started.json()["run_id"]
        watch = await asyncpg.connect(old.dsn(DBNAME))
        try:

            async def committed(at_least: int) -> bool:
                count = await watch.fetchval("SELECT count(*) FROM lease_effects")
                return bool(count >= at_least)

            await until(lambda: committed(4), 10, "two steps, replicated")
            receiver = walreceiver(new)
            os.kill(receiver, signal.SIGSTOP)
            await until(lambda: committed(12), 10, "four steps more, not replicated")
            on_old = int(await watch.fetchval("SELECT count(*) FROM lease_effects"))
        finally:
            await watch.close()
        promoted = await fail_over(old, new, receiver)
        try:
            kept = int(await promoted.fetchval("SELECT count(*) FROM lease_effects"))
            assert kept < on_old, (kept, on_old)  # steps were lost with the old primary

            async def succeeded() -> bool:
                return bool(
                    await promoted.fetchval(
                        "SELECT EXISTS (SELECT 1 FROM cronlock.runs WHERE status = 'succeeded')"
                    )
                )

            await until(succeeded, 30, "the run taken over on the new primary to succeed")
            items = await promoted.fetch(
                "SELECT item, count(*) AS n FROM lease_effects GROUP BY item ORDER BY item"
            )
            chain = await promoted.fetch(
                "SELECT id, attempt, retry_of, status FROM cronlock.runs ORDER BY attempt"
            )
        finally:
            await promoted.close()
        assert [(r["item"], r["n"]) for r in items] == [(i, 1) for i in range(1, 31)]
        assert [(r["attempt"], r["status"]) for r in chain] == [(1, "abandoned"), (2, "succeeded")]
        assert chain[0]["id"] == run_id
        assert chain[1]["retry_of"] == run_id
    finally:
        new.stop("immediate")
        old.stop("immediate")


# The run's own backend (the one holding its lock, which commits it), waiting for the standby.
SYNC_WAITING_SQL = """
SELECT a.pid FROM pg_stat_activity AS a JOIN cronlock.runs AS r ON r.backend_pid = a.pid
WHERE r.status = 'running' AND a.wait_event = 'SyncRep' AND a.query ILIKE 'commit%'
"""


@pytest.mark.slow  # two PostgreSQL servers of its own
async def test_a_commit_whose_wait_for_the_synchronous_standby_is_terminated_is_a_500(
    root: Path, start_app: StartApp, client: httpx.AsyncClient
) -> None:
    """docs/guarantees.md's one case synchronous replication does not cover: the job's COMMIT
    waits for the standby (its walreceiver frozen), and its backend is terminated while it
    waits. The commit is then visible on the primary and not on the standby, and cronlock,
    whose commit never returned, answers 500 with the run id, never 200. A failover right then
    loses the run, and its slot runs again once on the promoted server."""
    old = await new_primary(root / f"sync-{time.monotonic_ns()}")
    new = start_standby(old, root / f"sync-standby-{time.monotonic_ns()}")
    watch = await asyncpg.connect(old.dsn(DBNAME))
    running: asyncio.Task[httpx.Response] | None = None
    receiver: int | None = None
    try:
        await watch.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
        await watch.execute("SELECT pg_reload_conf()")
        await until(
            lambda: watch.fetchval(
                "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'"
            ),
            10,
            "the standby synchronous",
        )
        app = await start_app("sync", database_url=multi_host(old, new), db_connect_timeout=1.0)
        body = {"customer_id": 7, "seconds": 3}  # time to freeze the standby meanwhile
        running = asyncio.create_task(
            client.post(f"{app.url}/cron/keyed-yearly", headers=AUTH, json=body, timeout=30)
        )
        # The run's row is written (and replicated) as it starts; the job then sleeps, and
        # its COMMIT comes once the standby has stopped acknowledging.
        await until(
            lambda: watch.fetchval("SELECT count(*) FROM cronlock.runs WHERE status = 'running'"),
            10,
            "the run started",
        )
        receiver = walreceiver(new)
        os.kill(receiver, signal.SIGSTOP)
        waiting: list[int] = []

        async def commit_waiting() -> bool:
            waiting[:] = [r["pid"] for r in await watch.fetch(SYNC_WAITING_SQL)]
            return bool(waiting)

        await until(commit_waiting, 10, "the job's COMMIT waiting for the standby")
        assert await watch.fetchval("SELECT pg_terminate_backend($1)", waiting[0])
        answer = await running
        assert answer.status_code == 500, answer.text
        assert answer.json()["error"] == "job failed"
        assert answer.json()["commit"] == "unknown"
        run_id = answer.json()["run_id"]
        # Committed locally: the old primary has the run succeeded and its effect.
        status = "SELECT status, slot FROM cronlock.runs WHERE id = $1"
        on_old = await watch.fetchrow(status, run_id)
        assert on_old is not None
        assert on_old["status"] == "succeeded"
        assert await watch.fetchval("SELECT count(*) FROM job_effects") == 1
        await watch.close()
        promoted = await fail_over(old, new, receiver)
        receiver = None  # killed by fail_over
        try:
            # The promoted server never had the commit: the run is still `running` there
            # (its row was replicated as it started), the effect's table not even created.
            assert await promoted.fetchval(status, run_id) == "running"
            assert await promoted.fetchval("SELECT to_regclass('job_effects')") is None
        finally:
            await promoted.close()
        again = await client.post(f"{app.url}/cron/keyed-yearly", headers=AUTH, json=body)
        for _ in range(20):
            if again.status_code == 200:
                break
            await asyncio.sleep(0.2)
            again = await client.post(f"{app.url}/cron/keyed-yearly", headers=AUTH, json=body)
        assert again.status_code == 200, again.text
        assert again.json().get("skipped") is None, again.text  # ran: the slot was not done
        conn = await asyncpg.connect(new.dsn(DBNAME))
        try:
            assert (
                await conn.fetchval(
                    "SELECT count(*) FROM cronlock.runs WHERE job = 'keyed-yearly' AND slot = $1"
                    " AND status = 'succeeded'",
                    on_old["slot"],
                )
                == 1
            )
            assert await conn.fetchval("SELECT count(*) FROM job_effects") == 1
        finally:
            await conn.close()
    finally:
        if running is not None and not running.done():
            running.cancel()
            with contextlib.suppress(BaseException):
                await running
        if receiver is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(receiver, signal.SIGKILL)
        with contextlib.suppress(Exception):
            await watch.close()
        new.stop("immediate")
        old.stop("immediate")
