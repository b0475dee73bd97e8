"""Lease mode, in process: the 202 answer, one live run per (job, key) whatever the trigger,
fenced steps and checkpoints, attempts that resume, takeover after a holder gives its lease
up, cancel, the run's timeout, and the declarations refused up front. The crash and freeze
proofs with real processes are in tests/test_lease_faults.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import httpx
import pytest

from app import lease, ops
from app.errors import JobDefinitionError
from app.jobs import job, load
from app.settings import Settings
from tests.lease_jobs import LEASE_SETTINGS, create_effects
from tests.util import AUTH, wait_for

Starter = Callable[..., Any]


@pytest.fixture
async def effects_table(db: asyncpg.Connection) -> asyncpg.Connection:
    await create_effects(db)
    return db


async def start(start_app: Starter, name: str = "a", **overrides: Any) -> Any:
    return await start_app(name, cron_jobs="tests.lease_jobs", **{**LEASE_SETTINGS, **overrides})


async def view(client: httpx.AsyncClient, app: Any, run_id: int) -> dict[str, Any]:
    r = await client.get(f"{app.url}/cron/runs/{run_id}", headers=AUTH)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


async def settled(client: httpx.AsyncClient, app: Any, run_id: int, within: float = 20) -> Any:
    async def done() -> bool:
        return bool((await view(client, app, run_id))["status"] != "running")

    await wait_for(done, within, f"run {run_id} to end")
    return await view(client, app, run_id)


async def duplicates(db: asyncpg.Connection, job: str) -> list[Any]:
    return await db.fetch(
        "SELECT item, count(*) FROM lease_effects WHERE job = $1 GROUP BY item HAVING count(*) > 1",
        job,
    )


async def items(db: asyncpg.Connection, job: str) -> int:
    return int(await db.fetchval("SELECT count(*) FROM lease_effects WHERE job = $1", job))


async def test_a_lease_run_answers_202_and_works_in_fenced_steps(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    a = await start(start_app)
    r = await client.post(
        f"{a.url}/cron/lease-items", headers=AUTH, json={"n": 60, "batch": 5, "pause": 0.03}
    )
    assert r.status_code == 202, r.text
    body = r.json()
    assert set(body) == {"job", "run_id", "slot", "lease_expires_at"}
    assert body["job"] == "lease-items"
    assert body["slot"] is None
    run_id = body["run_id"]

    running = await view(client, a, run_id)
    assert running["status"] == "running"
    assert running["running"] is True
    assert running["holder"] == "a"
    assert running["attempt"] == 1
    assert running["token"] >= 1
    locks = (await client.get(f"{a.url}/cron/locks", headers=AUTH)).json()["locks"]
    held = [lk for lk in locks if lk["kind"] == "lease"]
    assert [(lk["job"], lk["run_id"], lk["instance"]) for lk in held] == [
        ("lease-items", run_id, "a")
    ]
    jobs = (await client.get(f"{a.url}/cron/jobs", headers=AUTH)).json()["jobs"]
    mine = next(j for j in jobs if j["name"] == "lease-items")
    assert mine["running"] is True
    assert mine["running_on"]["run_id"] == run_id

    done = await settled(client, a, run_id)
    assert done["status"] == "succeeded"
    assert done["result"] == 60
    assert done["checkpoint"] == {"last": 60}
    assert done["progress"] == {"done": 60, "total": 60}
    assert done["steps"] == 12
    assert done["running"] is False
    assert done["holder"] is None
    assert await items(effects_table, "lease-items") == 60
    assert await duplicates(effects_table, "lease-items") == []


async def test_while_a_lease_is_live_every_trigger_on_every_instance_is_already_running(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    a = await start(start_app, "a")
    b = await start(start_app, "b")
    r = await client.post(
        f"{a.url}/cron/lease-items", headers=AUTH, json={"n": 40, "batch": 2, "pause": 0.05}
    )
    assert r.status_code == 202
    # The probe's answer (a plain trigger), the lock statement's (force skips the probe), on
    # the holder and on the other instance: the lease decides, not the advisory lock.
    for app in (a, b):
        for query in ("", "?force=true"):
            skip = await client.post(f"{app.url}/cron/lease-items{query}", headers=AUTH, json={})
            assert skip.status_code == 200, skip.text
            assert skip.json() == {
                "job": "lease-items",
                "skipped": True,
                "reason": "already running",
            }
    await settled(client, a, r.json()["run_id"])
    assert await items(effects_table, "lease-items") == 40
    assert await duplicates(effects_table, "lease-items") == []


async def test_a_stale_token_commits_nothing_and_says_why(
    start_app: Starter,
    client: httpx.AsyncClient,
    effects_table: asyncpg.Connection,
    make_settings: Callable[..., Settings],
) -> None:
    """The fence itself: a step whose token is not the row's raises LeaseLost and its writes
    roll back; the run's own holder goes on."""
    a = await start(start_app)
    r = await client.post(
        f"{a.url}/cron/lease-items", headers=AUTH, json={"n": 30, "batch": 3, "pause": 0.05}
    )
    run_id = r.json()["run_id"]
    row = await effects_table.fetchrow(
        "SELECT lease_token FROM cronlock.runs WHERE id = $1", run_id
    )
    assert row is not None
    settings = make_settings(cron_jobs="tests.lease_jobs", **LEASE_SETTINGS)
    registry = load(settings.job_modules)
    from app.db import Database
    from app.errors import LeaseLost
    from app.jobs import JobContext

    db = Database(settings)
    await db.open()
    try:
        stale = lease.Fence(
            db,
            settings,
            job="lease-items",
            run_id=run_id,
            token=row["lease_token"] - 1,
            lease=2.0,
            checkpoint=None,
        )
        ctx: Any = JobContext(
            conn=None,  # type: ignore[arg-type]
            job=registry["lease-items"],
            run_id=run_id,
            slot=None,
            now=datetime.now(UTC),
            params=None,
            trigger="manual",
            instance="stale",
            settings=settings,
            steps=stale,
        )
        with pytest.raises(LeaseLost, match="newer token"):
            async with ctx.step() as conn:
                await conn.execute("INSERT INTO lease_effects VALUES (-1, 0, 'x', null, 'stale')")
    finally:
        await db.close()
    done = await settled(client, a, run_id)
    assert done["status"] == "succeeded"
    assert await effects_table.fetchval("SELECT count(*) FROM lease_effects WHERE item = -1") == 0
    assert await items(effects_table, "lease-items") == 30


async def test_a_trigger_takes_an_expired_run_over_and_the_old_holder_is_fenced_off(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    """No watcher (its poll is longer than the test): the next trigger takes over. The old
    holder is alive and unaware (as one paused long enough would be), so nothing but the
    fence stops it: its next step finds the run no longer its own and commits nothing."""
    a = await start(start_app, "a", lease_poll_interval=600)
    b = await start(start_app, "b", lease_poll_interval=600)
    r = await client.post(
        f"{a.url}/cron/lease-items", headers=AUTH, json={"n": 40, "batch": 2, "pause": 0.3}
    )
    first = r.json()["run_id"]

    async def some_done() -> bool:
        return await items(effects_table, "lease-items") >= 4

    await wait_for(some_done, 10, "a few steps")
    # The lease runs out under the holder's feet (a pause it did not see).
    await effects_table.execute(
        "UPDATE cronlock.runs SET lease_expires_at = now() - interval '1 second' WHERE id = $1",
        first,
    )
    # "already running" while the old holder has the row for a moment (NOWAIT): try again.
    for _ in range(20):
        taken = await client.post(f"{b.url}/cron/lease-items", headers=AUTH, json={"n": 1})
        if taken.status_code == 202:
            break
        assert taken.json()["reason"] == "already running", taken.text
        await asyncio.sleep(0.05)
    assert taken.status_code == 202, taken.text
    second = taken.json()["run_id"]
    assert second != first
    done = await settled(client, b, second)
    # The takeover kept the run's own params (n=40), not the trigger's.
    assert (done["status"], done["result"], done["attempt"], done["retry_of"]) == (
        "succeeded",
        40,
        2,
        first,
    )
    old = await view(client, a, first)
    assert old["status"] == "abandoned"
    assert f"taken over by run {second}" in old["error"]

    async def noticed() -> bool:
        return "stopped: lease lost" in ((await view(client, a, first))["error"] or "")

    await wait_for(noticed, 5, "the old holder to notice")
    assert await items(effects_table, "lease-items") == 40
    assert await duplicates(effects_table, "lease-items") == []


async def test_a_failed_attempt_is_resumed_by_the_next_trigger_for_its_slot(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    a = await start(start_app)
    slot = (datetime.now(UTC) - timedelta(minutes=5)).replace(second=0, microsecond=0)
    url = f"{a.url}/cron/lease-slot?slot={slot.isoformat().replace('+00:00', 'Z')}"
    params = {"n": 30, "batch": 5, "pause": 0.01, "fail_at": 15}
    r = await client.post(url, headers=AUTH, json=params)
    assert r.status_code == 202, r.text
    failed = await settled(client, a, r.json()["run_id"])
    assert failed["status"] == "failed"
    assert "failing on purpose at item 15" in failed["error"]
    assert failed["checkpoint"] == {"last": 15}

    again = await client.post(url, headers=AUTH, json=params)
    assert again.status_code == 202, again.text
    second = await settled(client, a, again.json()["run_id"])
    assert second["status"] == "succeeded"
    assert second["result"] == 30
    assert (second["attempt"], second["retry_of"]) == (2, failed["id"])
    assert await items(effects_table, "lease-slot") == 30
    assert await duplicates(effects_table, "lease-slot") == []
    # Once per slot holds for lease runs too.
    third = await client.post(url, headers=AUTH, json=params)
    assert third.json()["reason"] == "already done"


async def test_cancel_reaches_a_lease_run_through_its_holder(
    start_app: Starter,
    client: httpx.AsyncClient,
    effects_table: asyncpg.Connection,
    make_settings: Callable[..., Settings],
) -> None:
    a = await start(start_app)
    r = await client.post(
        f"{a.url}/cron/lease-items", headers=AUTH, json={"n": 10_000, "batch": 1, "pause": 0.1}
    )
    run_id = r.json()["run_id"]
    settings = make_settings(cron_jobs="tests.lease_jobs", **LEASE_SETTINGS)
    registry = load(settings.job_modules, settings.lock_namespace, settings.db_schema)
    conn = await asyncpg.connect(settings.database_url)
    try:
        done = await ops.cancel(conn, registry, settings, "lease-items", terminate=False, wait=5.0)
    finally:
        await conn.close()
    assert done is not None
    assert done.holder.kind == "lease"
    assert done.released
    assert done.run is not None
    assert done.run.status == "cancelled"
    assert (await view(client, a, run_id))["cancel_requested_at"] is not None
    written = await items(effects_table, "lease-items")
    await asyncio.sleep(0.5)
    assert await items(effects_table, "lease-items") == written  # nothing after the cancel


async def test_the_timeout_bounds_the_whole_run(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    a = await start(start_app)
    r = await client.post(
        f"{a.url}/cron/lease-short", headers=AUTH, json={"n": 10_000, "batch": 1, "pause": 0.1}
    )
    done = await settled(client, a, r.json()["run_id"], within=10)
    assert done["status"] == "timed_out"
    assert "timeout of 3" in done["error"]
    assert 2900 < done["duration_ms"] < 5000


async def test_a_lease_job_has_no_connection_of_its_own(
    start_app: Starter, client: httpx.AsyncClient
) -> None:
    a = await start(start_app)
    r = await client.post(f"{a.url}/cron/lease-outside", headers=AUTH)
    done = await settled(client, a, r.json()["run_id"])
    assert done["status"] == "failed"
    assert "is a lease job: it has no ctx.conn" in done["error"]


async def test_keys_of_a_lease_job_run_at_once_one_run_per_key(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    a = await start(start_app, "a", db_pool_max_size=20)
    b = await start(start_app, "b", db_pool_max_size=20)
    answers = await asyncio.gather(
        *(
            client.post(
                f"{(a, b)[n % 2].url}/cron/lease-customer",
                headers=AUTH,
                json={"customer_id": n % 5, "n": 20},
            )
            for n in range(40)
        )
    )
    accepted = [r.json() for r in answers if r.status_code == 202]
    assert sorted(x["key"] for x in accepted) == ["0", "1", "2", "3", "4"]
    assert all(r.json()["reason"] == "already running" for r in answers if r.status_code == 200)
    for x in accepted:
        assert (await settled(client, a, x["run_id"]))["status"] == "succeeded"
    per_key = await effects_table.fetch(
        "SELECT key, count(*), count(DISTINCT item) AS items FROM lease_effects "
        "WHERE job = 'lease-customer' GROUP BY key ORDER BY key"
    )
    assert [(x["key"], x["count"], x["items"]) for x in per_key] == [
        (str(k), 20, 20) for k in range(5)
    ]


async def test_the_probe_reads_a_live_lease(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    """The trigger path's first look answers "already running" from the lease alone (no
    advisory lock is held between steps), for lease jobs only."""
    from app.lock import job_lock, lock_key, probe

    a = await start(start_app)
    r = await client.post(
        f"{a.url}/cron/lease-items", headers=AUTH, json={"n": 40, "batch": 2, "pause": 0.05}
    )
    key = lock_key(job_lock("cronlock", "lease-items"), 0)
    as_lease = await probe(effects_table, "cronlock", "lease-items", key, lease=True)
    as_plain = await probe(effects_table, "cronlock", "lease-items", key)
    assert (as_lease["running"], as_plain["running"]) == (True, False)
    await settled(client, a, r.json()["run_id"])
    after = await probe(effects_table, "cronlock", "lease-items", key, lease=True)
    assert after["running"] is False


def test_a_lease_is_declared_within_its_timeout() -> None:
    with pytest.raises(JobDefinitionError, match="at most the timeout"):
        job("lease-too-long", lease=120, timeout=60)


def test_a_lease_too_short_for_the_timeouts_refuses_to_start(
    make_settings: Callable[..., Settings],
) -> None:
    from app.main import create_app

    with pytest.raises(JobDefinitionError, match=r"lease=2\.0 s is too short for DB_QUERY_TIMEOUT"):
        create_app(make_settings(cron_jobs="tests.lease_jobs"))


def test_the_chunked_digest_is_a_lease_job() -> None:
    registry = load(["app.demo.chunked"])
    assert registry["chunked-digest"].lease == 30
    assert json.dumps(registry["chunked-digest"].schedule.expr) == '"0 7 * * *"'  # type: ignore[union-attr]


async def test_the_cli_runs_a_lease_job_to_its_end(
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    effects_table: asyncpg.Connection,
) -> None:
    from app import cli
    from tests.lease_jobs import LEASE_ENV

    for name, value in {
        "DATABASE_URL": database_url,
        "CRON_JOBS": "tests.lease_jobs",
        "INSTANCE_NAME": "cli",
        **LEASE_ENV,
    }.items():
        monkeypatch.setenv(name, value)
    code = await asyncio.to_thread(
        cli.main, ["run", "lease-items", "--params", '{"n": 12, "batch": 4, "pause": 0}', "--json"]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert (out["processed"], out["job"]) == (12, "lease-items")
    assert await items(effects_table, "lease-items") == 12
    row = await effects_table.fetchrow("SELECT status, source, steps FROM cronlock.runs")
    assert row is not None
    assert tuple(row) == ("succeeded", "cli", 3)
