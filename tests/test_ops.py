"""The operator routes against real instances and a real ledger: jobs, runs, locks, async
triggers, backfill, overdue, token separation, and logs that never carry a secret."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import asyncpg
import httpx
import pytest

from cronlock.core import pause as pause_state
from cronlock.core.jobs import load
from cronlock.core.schedule import Schedule
from cronlock.ops import views as ops
from tests.support import TEST_SECRET
from tests.support.asgi import InProcess, StartApp
from tests.support.metrics import METRICS_TOKEN, SCRAPE
from tests.util import AUTH, job_key, lock_held, post, runs, seen_since, wait_for

Starter = Callable[..., Any]

READ_TOKEN = "read-only-token-0123456789-abcdefghij"
READ = {"Authorization": f"Bearer {READ_TOKEN}"}
TOKENS = {"CRON_READ_TOKEN": READ_TOKEN, "METRICS_TOKEN": METRICS_TOKEN}
SETTINGS = {"cron_read_token": READ_TOKEN, "metrics_token": METRICS_TOKEN}
DOWN_URL = "postgresql://nobody@127.0.0.1:9/none"
MINUTELY = Schedule("* * * * *")


@pytest.fixture
async def instance(start_app: StartApp) -> InProcess:
    return await start_app("ops", **SETTINGS)


@pytest.fixture
async def pair(start_app: StartApp) -> tuple[InProcess, InProcess]:
    """One instance that runs jobs, one that an operator reads from (in-process: what one
    sees of the other goes through the database only)."""
    return (
        await start_app("runner", **SETTINGS, backfill_window=900),
        await start_app("reader", **SETTINGS, backfill_window=900),
    )


@pytest.fixture
def processes(start_instance: Starter) -> tuple[Any, Any]:
    """Two real instances (processes), for what runs once across them."""
    env = {**TOKENS, "BACKFILL_WINDOW": "900"}
    return start_instance("runner", env), start_instance("reader", env)


async def get_json(client: httpx.AsyncClient, url: str, headers: dict[str, str] = READ) -> Any:
    r = await client.get(url, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


async def seed_run(
    db: asyncpg.Connection,
    job: str,
    *,
    slot: datetime | None,
    status: str = "succeeded",
    trigger: str = "scheduled",
    instance: str = "seeded",
    age: timedelta = timedelta(minutes=1),
) -> int:
    run_id = await db.fetchval(
        """INSERT INTO cronlock.runs (job, slot, status, trigger, instance, backend_pid, started_at,
                                  finished_at)
           VALUES ($1, $2, $3, $4, $5, 999999, now() - $6::interval,
                   CASE WHEN $3 = 'running' THEN NULL ELSE now() END)
           RETURNING id""",
        job,
        slot,
        status,
        trigger,
        instance,
        age,
    )
    assert isinstance(run_id, int)
    return run_id


# --- GET /cron/jobs and /cron/locks ---------------------------------------------------------


async def sleeping(db: asyncpg.Connection, job: str) -> bool:
    """Whether the holder of `job`'s lock is running a statement (its pg_sleep)."""
    key = job_key(job)
    found = await db.fetchval(
        """SELECT EXISTS (SELECT 1 FROM pg_locks l JOIN pg_stat_activity a USING (pid)
           WHERE l.locktype = 'advisory' AND l.granted AND l.classid = $1 AND l.objid = $2
             AND l.objsubid = 1 AND a.state = 'active')""",
        key.classid,
        key.objid,
    )
    return bool(found)


@pytest.mark.slow  # seconds of timers or loops by design: not in --fast
async def test_jobs_show_last_run_and_running_from_pg_locks(
    pair: tuple[Any, Any], client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    runner, reader = pair
    fast = (await post(client, runner.url + "/cron/fast")).json()
    pending = asyncio.create_task(post(client, runner.url + "/cron/slow-sql", json={"seconds": 3}))
    # Until its sleep runs: between the lock and the job's statement the holder is briefly
    # "idle in transaction", which the view would report as such.
    await wait_for(lambda: sleeping(db, "slow-sql"), 10, "slow-sql's statement to run")

    view = await get_json(client, reader.url + "/cron/jobs")
    by_name = {j["name"]: j for j in view["jobs"]}
    assert set(by_name) == set(load(["tests.jobs"]))
    slow = by_name["slow-sql"]
    [row] = await runs(db, "slow-sql")
    assert slow["running"] is True
    assert slow["running_on"]["instance"] == "runner"
    assert slow["running_on"]["state"] == "active"
    assert slow["running_on"]["run_id"] == row["id"]
    assert slow["running_on"]["held_for"] > 0
    assert slow["last_run"] is None  # the ledger's `running` row is not a last run
    last = by_name["fast"]["last_run"]
    assert by_name["fast"]["running"] is False
    assert last["id"] == fast["run_id"]
    assert last["status"] == "succeeded"
    assert last["instance"] == "runner"
    assert last["duration_ms"] > 0
    hourly = by_name["hourly-grace"]
    now = datetime.fromisoformat(view["now"])
    assert hourly["schedule"] == "0 * * * *"
    assert hourly["tz"] == "UTC"
    assert hourly["grace"] == 600
    current, upcoming = (datetime.fromisoformat(hourly[k]) for k in ("current_slot", "next_slot"))
    assert current <= now < upcoming
    assert upcoming - current == timedelta(hours=1)
    assert by_name["fast"]["current_slot"] is None
    assert by_name["fast"]["overdue"] is False  # no schedule: never overdue

    assert (await pending).status_code == 200
    view = await get_json(client, reader.url + "/cron/jobs")
    slow = next(j for j in view["jobs"] if j["name"] == "slow-sql")
    assert slow["running"] is False
    assert slow["running_on"] is None
    assert slow["last_run"]["status"] == "succeeded"


@pytest.mark.slow  # seconds of timers or loops by design: not in --fast
async def test_locks_maps_keys_to_jobs_in_this_database_only(
    pair: tuple[Any, Any], client: httpx.AsyncClient, db: asyncpg.Connection, pg_server: Any
) -> None:
    runner, reader = pair
    elsewhere = await asyncpg.connect(pg_server.dsn("postgres"), statement_cache_size=0)
    try:
        # The same key as a job of ours, but in another database: not ours to show.
        await elsewhere.execute(
            "SELECT pg_advisory_lock(hashtextextended('cronlock:fast', 0))", timeout=5
        )
        # Someone else's lock in this database: shown, not mapped to a job.
        await db.execute("SELECT pg_advisory_lock(12345)")
        my_pid = await db.fetchval("SELECT pg_backend_pid()")
        pending = asyncio.create_task(
            post(client, runner.url + "/cron/slow-sql", json={"seconds": 2})
        )
        await wait_for(lambda: sleeping(db, "slow-sql"), 10, "slow-sql's statement to run")
        found = (await get_json(client, reader.url + "/cron/locks"))["locks"]
        await pending
    finally:
        await elsewhere.close()
        await db.execute("SELECT pg_advisory_unlock_all()")

    by_key = {lk["key"]: lk for lk in found}
    assert str(job_key("fast").key) not in by_key
    slow_key = job_key("slow-sql")
    slow = by_key[str(slow_key.key)]
    assert (slow["classid"], slow["objid"]) == (slow_key.classid, slow_key.objid)
    [row] = await runs(db, "slow-sql")
    assert slow["job"] == "slow-sql"
    assert slow["holder"] == "cronlock:runner"
    assert slow["instance"] == "runner"
    assert slow["state"] == "active"
    assert slow["granted"] is True
    assert slow["held_for"] > 0
    assert slow["run_id"] == row["id"]
    other = by_key["12345"]
    assert other["job"] is None
    assert other["pid"] == my_pid
    assert other["run_id"] is None
    # tests.jobs' helper lock, taken by the run's own backend.
    assert by_key["424242"]["pid"] == slow["pid"]
    assert set(by_key) == {str(slow_key.key), "12345", "424242"}


async def test_a_running_row_without_its_lock_is_abandoned_never_running(
    instance: Any, client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    ghost = await seed_run(db, "fast", slot=None, status="running", instance="ghost")
    view = await get_json(client, instance.url + "/cron/jobs")
    fast = next(j for j in view["jobs"] if j["name"] == "fast")
    assert fast["running"] is False
    page = await get_json(client, instance.url + "/cron/runs?job=fast")
    [run] = page["runs"]
    assert run["id"] == ghost
    assert run["status"] == "abandoned"
    assert run["running"] is False
    assert "went away" in run["error"]


async def test_a_killed_instances_run_is_closed_as_abandoned(
    start_instance: Starter, client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    victim, survivor = start_instance("victim", TOKENS), start_instance("survivor", TOKENS)
    r = await post(client, victim.url + "/cron/slow?wait=false", json={"seconds": 20})
    assert r.status_code == 202, r.text
    run_id = r.json()["run_id"]
    run = await get_json(client, survivor.url + f"/cron/runs/{run_id}")
    assert (run["status"], run["running"]) == ("running", True)
    victim.signal(signal.SIGKILL)
    await wait_for(lambda: _not(lock_held(db, "slow")), 10, "the lock to go with the process")

    async def settled() -> bool:
        nonlocal run
        run = await get_json(client, survivor.url + f"/cron/runs/{run_id}")
        assert run["running"] is False  # from pg_locks: never "running" once the lock is gone
        return bool(run["status"] == "abandoned")

    # Rows younger than a second are left for the next look (ledger.close_abandoned's min_age).
    await wait_for(settled, 5, "the run to be closed as abandoned", interval=0.2)
    assert "went away" in run["error"]


async def _not(check: Any) -> bool:
    return not await check


# --- GET /cron/runs -------------------------------------------------------------------------


async def test_runs_are_newest_first_and_paginated_by_cursor(
    instance: Any, client: httpx.AsyncClient
) -> None:
    made = []
    for job in ("fast", "fails", "fast", "fast", "fails", "fast", "fast"):
        made.append((await post(client, instance.url + f"/cron/{job}")).json()["run_id"])
    seen: list[int] = []
    url = instance.url + "/cron/runs?limit=3"
    pages = 0
    while True:
        page = await get_json(client, url)
        pages += 1
        seen += [r["id"] for r in page["runs"]]
        assert len(page["runs"]) <= 3
        if page["next"] is None:
            break
        assert page["next"] == page["runs"][-1]["id"]
        url = instance.url + f"/cron/runs?limit=3&before={page['next']}"
    assert seen == sorted(made, reverse=True)
    assert pages == 3

    failed = await get_json(client, instance.url + "/cron/runs?job=fails")
    assert [r["id"] for r in failed["runs"]] == [made[4], made[1]]
    assert {r["status"] for r in failed["runs"]} == {"failed"}
    assert all(r["error"] == "RuntimeError: boom" for r in failed["runs"])
    by_status = await get_json(client, instance.url + "/cron/runs?status=failed")
    assert [r["id"] for r in by_status["runs"]] == [made[4], made[1]]
    none = await get_json(client, instance.url + "/cron/runs?job=fast&status=failed")
    assert none == {"runs": [], "next": None}
    for bad in ("limit=0", "limit=501", "status=bogus", "before=0", "before=abc"):
        r = await client.get(instance.url + f"/cron/runs?{bad}", headers=READ)
        assert r.status_code == 422, bad


async def test_one_run_by_id(instance: Any, client: httpx.AsyncClient) -> None:
    body = (await post(client, instance.url + "/cron/fast")).json()
    run = await get_json(client, instance.url + f"/cron/runs/{body['run_id']}")
    assert run["id"] == body["run_id"]
    assert run["job"] == "fast"
    assert run["status"] == "succeeded"
    assert run["result"] == 1
    assert run["source"] == "http"
    assert run["instance"] == "ops"
    assert run["duration_ms"] == pytest.approx(body["duration_ms"], abs=1)
    r = await client.get(instance.url + "/cron/runs/999999", headers=READ)
    assert r.status_code == 404
    assert r.json() == {"error": "unknown run", "id": 999999}
    r = await client.get(instance.url + "/cron/runs/abc", headers=READ)
    assert r.status_code == 422


# --- POST /cron/<job>?wait=false and ?slot= ------------------------------------------------------


async def test_async_trigger_is_followed_until_it_finishes(
    instance: Any, client: httpx.AsyncClient
) -> None:
    r = await post(client, instance.url + "/cron/slow?wait=false", json={"seconds": 1})
    assert r.status_code == 202, r.text
    accepted = r.json()
    assert accepted == {"job": "slow", "run_id": accepted["run_id"], "slot": None}
    url = instance.url + f"/cron/runs/{accepted['run_id']}"
    run = await get_json(client, url)
    assert (run["status"], run["running"]) == ("running", True)
    again = await post(client, instance.url + "/cron/slow?wait=false", json={"seconds": 1})
    assert again.json() == {"job": "slow", "skipped": True, "reason": "already running"}

    async def finished() -> bool:
        nonlocal run
        run = await get_json(client, url)
        return bool(run["status"] != "running")

    await wait_for(finished, 10, "the accepted run to finish", interval=0.2)
    assert run["status"] == "succeeded"
    assert run["running"] is False
    assert run["result"] == {"slept": 1.0}
    assert run["duration_ms"] >= 1000


async def test_backfill_of_a_past_tick_runs_once(
    processes: tuple[Any, Any], client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    pair = processes
    now: datetime = await db.fetchval("SELECT now()")
    past = MINUTELY.prev_tick(now) - timedelta(minutes=3)
    url = "/cron/minutely?slot=" + past.isoformat().replace("+", "%2B")
    answers = await asyncio.gather(*(post(client, i.url + url) for i in pair for _ in range(4)))
    bodies = [a.json() for a in answers]
    assert all(a.status_code == 200 for a in answers), bodies
    ran = [b for b in bodies if "processed" in b]
    assert len(ran) == 1, bodies
    assert datetime.fromisoformat(ran[0]["slot"]) == past
    assert {b["reason"] for b in bodies if b.get("skipped")} <= {"already running", "already done"}
    again = (await post(client, pair[1].url + url)).json()
    assert again == {
        "job": "minutely",
        "skipped": True,
        "reason": "already done",
        "slot": past.isoformat(),
    }
    [row] = await runs(db, "minutely")
    assert (row["slot"], row["trigger"], row["status"]) == (past, "backfill", "succeeded")
    # The backfilled slot is its own: the current slot still runs when triggered.
    current = (await post(client, pair[0].url + "/cron/minutely")).json()
    assert "processed" in current
    assert datetime.fromisoformat(current["slot"]) > past


async def test_backfill_rejects_non_ticks_future_and_too_old_slots(
    pair: tuple[Any, Any], client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    runner, _ = pair
    now: datetime = await db.fetchval("SELECT now()")
    tick = MINUTELY.prev_tick(now)
    bad = {
        "not a tick": (tick - timedelta(minutes=2, seconds=30)).isoformat(),
        "in the future": (tick + timedelta(minutes=5)).isoformat(),
        "older than BACKFILL_WINDOW (900 s)": (tick - timedelta(minutes=20)).isoformat(),
        "no time zone": (tick - timedelta(minutes=2)).replace(tzinfo=None).isoformat(),
    }
    for why, slot in bad.items():
        r = await client.post(runner.url + "/cron/minutely", params={"slot": slot}, headers=AUTH)
        assert r.status_code == 422, (why, r.text)
    past = (tick - timedelta(minutes=2)).isoformat()
    r = await client.post(
        runner.url + "/cron/minutely", params={"slot": past, "force": "true"}, headers=AUTH
    )
    assert r.status_code == 422
    r = await client.post(runner.url + "/cron/fast", params={"slot": past}, headers=AUTH)
    assert r.status_code == 422  # no schedule, no slot
    assert await runs(db, "minutely") == []
    assert not await lock_held(db, "minutely")


# --- overdue ----------------------------------------------------------------------------------


async def test_overdue_across_a_slot_boundary_by_the_database_clock(
    db: asyncpg.Connection,
) -> None:
    """Ledger rows are seeded relative to the database's clock; the view is then asked at
    instants on both sides of `tick + grace` (10 minutes for hourly-grace)."""
    registry = load(["tests.jobs"])
    job = registry["hourly-grace"]
    assert job.schedule is not None
    db_now: datetime = await db.fetchval("SELECT now()")
    tick = job.schedule.prev_tick(db_now)
    hour, grace = timedelta(hours=1), timedelta(seconds=job.grace)
    second = timedelta(seconds=1)

    async def overdue(at: datetime) -> bool:
        view = await ops.jobs(db, registry, now=at)
        found = next(j for j in view.jobs if j.name == job.name)
        return found.overdue

    # Never seen by this database (no instance declaring it has started): no history to be
    # late in. First seen just after `tick`: `tick` was before its time, not missed.
    assert not await overdue(tick + grace + second)
    await db.execute(
        "INSERT INTO cronlock.jobs_seen (job, first_seen_at) VALUES ($1, $2)",
        job.name,
        tick + second,
    )
    assert not await overdue(tick + grace + second)
    assert await overdue(tick + hour + grace + second)  # the next tick was its to miss
    await seen_since(db, job.name)  # as if deployed long ago
    assert await overdue(tick + second)  # never succeeded at all
    await seed_run(db, job.name, slot=tick - hour)
    assert not await overdue(tick + grace - second)  # within the grace of `tick`
    assert await overdue(tick + grace + second)  # grace over, `tick` has no success
    await seed_run(db, job.name, slot=tick, status="failed")
    await seed_run(db, job.name, slot=tick, trigger="manual")
    assert await overdue(tick + grace + second)  # failed and manual runs do not count
    await seed_run(db, job.name, slot=tick, trigger="backfill")
    assert not await overdue(tick + grace + second)
    # Across the next boundary: the following tick is missed, and stays overdue until a run
    # for it (or a later one) succeeds, instead of clearing at the tick after.
    assert not await overdue(tick + hour + grace - second)
    assert await overdue(tick + hour + grace + second)
    assert await overdue(tick + 2 * hour + second)
    await seed_run(db, job.name, slot=tick + 2 * hour)
    assert not await overdue(tick + 2 * hour + grace + second)


async def test_one_jobs_view_is_that_job_in_every_jobs_view(
    db: asyncpg.Connection, database_url: str
) -> None:
    """A job's page reads `jobs(only=name)`: the same row as the full view, for a job that
    failed (a retry pending), one paused, one running (its lock held), one never run."""
    registry = load(["tests.own_jobs"])
    now: datetime = await db.fetchval("SELECT now()")
    flaky = registry["flaky"].schedule
    assert flaky is not None
    await seed_run(db, "flaky", slot=flaky.prev_tick(now), status="failed")
    await seed_run(db, "always-fails", slot=None, trigger="manual")
    await pause_state.pause(db, "cronlock", "heartbeat", by="test", note="why")
    holder = await asyncpg.connect(database_url)
    try:
        await holder.execute("SELECT pg_advisory_lock($1::bigint)", registry.key("tick"))
        full = {j.name: j for j in (await ops.jobs(db, registry, now=now)).jobs}
        held = await ops.locks(db, registry)
        for name in registry:
            one = await ops.jobs(db, registry, now=now, only=name)
            assert one.jobs == [full[name]]
            assert (await ops.jobs(db, registry, now=now, only=name, held=held)).jobs == one.jobs
    finally:
        await holder.close()
    assert full["flaky"].retry is not None
    assert full["heartbeat"].paused is not None
    assert full["tick"].running
    assert full["always-fails"].last_run is not None
    assert full["hourly-late"].last_run is None


async def test_overdue_in_the_api_follows_the_ledger(
    instance: Any, client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    hourly = load(["tests.jobs"])["hourly-grace"]
    assert hourly.schedule is not None
    now: datetime = await db.fetchval("SELECT now()")

    async def overdue() -> dict[str, bool]:
        view = await get_json(client, instance.url + "/cron/jobs")
        return {j["name"]: j["overdue"] for j in view["jobs"]}

    # A fresh install: its jobs' history starts now, no slot before it is overdue (minutely's
    # may be by now: the instance may have started a minute ago).
    fresh = await overdue()
    assert not fresh["hourly-grace"]
    assert not fresh["yearly"]
    view = await get_json(client, instance.url + "/cron/jobs")
    seen = {j["name"]: j["first_seen"] for j in view["jobs"]}
    started = datetime.fromisoformat(seen["yearly"])
    assert now - timedelta(minutes=1) < started <= now  # by the database's clock, at start-up
    assert set(seen.values()) == {seen["yearly"]}  # recorded together, once
    # An old deployment's jobs (first seen long ago) that never succeeded are overdue.
    await seen_since(db, "hourly-grace", "yearly", "minutely")
    before = await overdue()
    assert before["hourly-grace"]
    assert before["yearly"]
    assert before["minutely"]
    # A success two hours back is older than any due slot: still overdue, whatever the minute.
    await seed_run(db, "hourly-grace", slot=hourly.schedule.prev_tick(now) - timedelta(hours=2))
    assert (await overdue())["hourly-grace"]
    await seed_run(db, "hourly-grace", slot=hourly.schedule.prev_tick(now))
    assert not (await overdue())["hourly-grace"]
    await post(client, instance.url + "/cron/minutely")
    after = await overdue()
    assert not after["minutely"]
    assert after["yearly"]


# --- auth -----------------------------------------------------------------------------------


async def test_read_and_metrics_tokens_cannot_run_jobs(
    instance: Any, client: httpx.AsyncClient
) -> None:
    run_id = (await post(client, instance.url + "/cron/fast")).json()["run_id"]
    reads = ["/cron/jobs", "/cron/runs", f"/cron/runs/{run_id}", "/cron/locks", "/openapi.json"]
    for path in reads:
        assert (await client.get(instance.url + path, headers=READ)).status_code == 200, path
        assert (await client.get(instance.url + path, headers=AUTH)).status_code == 200, path
        assert (await client.get(instance.url + path, headers=SCRAPE)).status_code == 401, path
        assert (await client.get(instance.url + path)).status_code == 401, path
    for headers in (READ, SCRAPE):
        for method, path in (("POST", "/cron/fast"), ("POST", "/cron/slow?wait=false")):
            r = await client.request(method, instance.url + path, headers=headers)
            assert r.status_code == 401, (headers, path)
            assert r.json() == {"error": "Unauthorized"}
    for headers in (AUTH, READ, SCRAPE):
        assert (await client.get(instance.url + "/metrics", headers=headers)).status_code == 200
    assert (await client.get(instance.url + "/metrics")).status_code == 401
    assert (await client.get(instance.url + "/healthz")).status_code == 200
    runs_now = await get_json(client, instance.url + "/cron/runs")
    assert [r["id"] for r in runs_now["runs"]] == [run_id]  # the refused POSTs ran nothing


async def test_operator_routes_are_in_the_openapi_document(
    instance: Any, client: httpx.AsyncClient
) -> None:
    doc = await get_json(client, instance.url + "/openapi.json")
    for path in ("/cron/jobs", "/cron/runs", "/cron/runs/{run_id}", "/cron/locks", "/metrics"):
        assert "get" in doc["paths"][path], path
    params = {p["name"] for p in doc["paths"]["/cron/runs"]["get"]["parameters"]}
    assert params == {"job", "status", "key", "limit", "before"}
    assert "JobView" in doc["components"]["schemas"]


async def test_operator_routes_answer_503_while_the_database_is_down(
    start_app: StartApp, client: httpx.AsyncClient
) -> None:
    down = await start_app("down", database_url=DOWN_URL)
    for path in ("/cron/jobs", "/cron/runs", "/cron/runs/1", "/cron/locks"):
        r = await client.get(down.url + path, headers=AUTH)
        assert r.status_code == 503, (path, r.text)
        assert r.headers["retry-after"]
        assert r.json()["error"] == "database unavailable"


# --- logs -------------------------------------------------------------------------------------


async def test_logs_name_the_trigger_source_and_never_a_secret(
    start_instance: Starter, client: httpx.AsyncClient
) -> None:
    chatty = start_instance("chatty", {**TOKENS, "LOG_LEVEL": "DEBUG", "LOG_FORMAT": "json"})
    url = chatty.url
    await post(client, url + "/cron/fast")
    await post(client, url + "/cron/fails")
    await post(client, url + "/cron/fast", json={})
    await client.post(url + "/cron/fast", params={"token": TEST_SECRET}, headers=AUTH)
    await post(client, url + "/cron/no-such-job")
    await client.post(url + "/cron/fast", headers={"Authorization": "Bearer wrong-" + "x" * 40})
    await client.post(url + "/cron/fast", headers=READ)
    await client.get(url + "/cron/jobs", headers=READ)
    await client.get(url + "/cron/runs", headers=READ)
    await client.get(url + "/metrics", headers=SCRAPE)
    await asyncio.sleep(0.3)  # let the last lines reach the log file
    log = chatty.log()
    for secret in (TEST_SECRET, READ_TOKEN, METRICS_TOKEN):
        assert secret not in log
    events = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    ran = [e for e in events if e.get("event") == "run"]
    assert len(ran) == 4
    assert {(e["job"], e["outcome"]) for e in ran} == {("fast", "succeeded"), ("fails", "failed")}
    for e in ran:
        assert e["source"] == "http"
        assert e["instance"] == "chatty"
        assert e["run_id"] > 0
        assert e["duration_ms"] >= 0
        assert e["trigger"] == "manual"  # fast and fails have no schedule
