"""Fan-out runs, in process: the 202 answer, every item's effects exactly once across
instances, retries with attempts recorded, `done` exactly once, the run's counts, continuing a
failed run's slot, cancel, pause, retention, and the declarations and plans refused. The
proofs with real processes, PgBouncer and signals are in tests/test_fanout_faults.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import asyncpg
import httpx
import pytest

from cronlock import Cronlock, DoneContext, ItemContext, JobContext
from cronlock.core.jobs import job, load
from cronlock.errors import JobDefinitionError
from cronlock.settings import Settings
from tests.fanout_jobs import FANOUT_SETTINGS, create_effects
from tests.util import AUTH, wait_for

Starter = Callable[..., Any]


@pytest.fixture
async def effects_table(db: asyncpg.Connection) -> asyncpg.Connection:
    await create_effects(db)
    return db


async def start(start_app: Starter, name: str = "a", **overrides: Any) -> Any:
    return await start_app(name, cron_jobs="tests.fanout_jobs", **{**FANOUT_SETTINGS, **overrides})


async def view(client: httpx.AsyncClient, app: Any, run_id: int) -> dict[str, Any]:
    r = await client.get(f"{app.url}/cron/runs/{run_id}", headers=AUTH)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


async def settled(client: httpx.AsyncClient, app: Any, run_id: int, within: float = 30) -> Any:
    async def done() -> bool:
        return bool((await view(client, app, run_id))["status"] != "running")

    await wait_for(done, within, f"run {run_id} to end")
    return await view(client, app, run_id)


async def begin(client: httpx.AsyncClient, app: Any, job: str = "fan-items", **params: Any) -> int:
    r = await client.post(f"{app.url}/cron/{job}", headers=AUTH, json=params)
    assert r.status_code == 202, r.text
    run_id: int = r.json()["run_id"]
    return run_id


async def effects(db: asyncpg.Connection, run_id: int | None = None) -> dict[int, int]:
    rows = await db.fetch(
        "SELECT item, count(*) AS n FROM fanout_effects WHERE $1::bigint IS NULL OR run_id = $1 "
        "GROUP BY item",
        run_id,
    )
    return {r["item"]: r["n"] for r in rows}


async def dones(db: asyncpg.Connection) -> list[dict[str, Any]]:
    return [dict(r) for r in await db.fetch("SELECT * FROM fanout_done ORDER BY run_id")]


async def test_a_fanout_run_answers_202_and_every_item_is_done_once(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    a = await start(start_app, "a")
    b = await start(start_app, "b")
    r = await client.post(f"{a.url}/cron/fan-items", headers=AUTH, json={"n": 300, "pause": 0.01})
    assert r.status_code == 202, r.text
    body = r.json()
    assert set(body) == {"job", "run_id", "slot", "items"}
    assert body["job"] == "fan-items"
    assert body["items"] == 300
    assert body["slot"] is None
    run_id = body["run_id"]

    running = await view(client, b, run_id)
    assert running["status"] == "running"
    assert running["running"] is True
    assert running["items"]["total"] == 300

    done = await settled(client, a, run_id)
    assert done["status"] == "succeeded", done
    assert done["items"] == {"total": 300, "done": 300, "failed": 0, "running": 0}
    assert done["result"] == {"items": 300, "done": 300, "failed": 0, "result": {"seen": 300}}
    assert await effects(effects_table) == {i: 1 for i in range(300)}
    by = await effects_table.fetch("SELECT DISTINCT instance FROM fanout_effects")
    assert {r["instance"] for r in by} == {"a", "b"}  # both instances worked
    assert [
        (d["run_id"], d["total"], d["done"], d["failed"]) for d in await dones(effects_table)
    ] == [(run_id, 300, 300, 0)]
    # One structured run, one success in the ledger.
    statuses = await effects_table.fetch("SELECT status FROM cronlock.runs WHERE job = 'fan-items'")
    assert [r["status"] for r in statuses] == ["succeeded"]


async def test_failing_items_are_retried_then_fail_the_run_with_counts(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    a = await start(start_app, "a")
    run_id = await begin(client, a, n=30, flaky=[3, 7], fail_times=2, broken=[11])
    done = await settled(client, a, run_id)
    assert done["status"] == "failed"
    assert done["error"] == "1 of 30 items failed"
    assert done["items"] == {"total": 30, "done": 29, "failed": 1, "running": 0}
    # Failed attempts rolled their effects back: each item's effect once, the broken one none.
    assert await effects(effects_table) == {i: 1 for i in range(30) if i != 11}
    attempts = {
        r["n"]: (r["status"], r["attempts"])
        for r in await effects_table.fetch(
            "SELECT n, status, attempts FROM cronlock.fanout_items WHERE n IN (3, 7, 11, 12)"
        )
    }
    assert attempts == {
        3: ("succeeded", 3),
        7: ("succeeded", 3),
        11: ("failed", 4),
        12: ("succeeded", 1),
    }
    # The effect of the flaky items' third attempt is the one that committed.
    third = await effects_table.fetch(
        "SELECT item, attempt FROM fanout_effects WHERE item IN (3, 7)"
    )
    assert sorted((r["item"], r["attempt"]) for r in third) == [(3, 3), (7, 3)]
    assert [(d["done"], d["failed"]) for d in await dones(effects_table)] == [(29, 1)]
    failed = await effects_table.fetchval("SELECT error FROM cronlock.fanout_items WHERE n = 11")
    assert failed == "RuntimeError: item 11 always fails"


async def test_an_item_past_its_timeout_is_rolled_back_and_the_others_go_on(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    a = await start(start_app, "a")
    run_id = await begin(client, a, job="fan-slow")
    done = await settled(client, a, run_id)
    assert done["status"] == "failed"
    assert done["items"] == {"total": 40, "done": 39, "failed": 1, "running": 0}
    assert await effects(effects_table) == {i: 1 for i in range(1, 40)}
    error = await effects_table.fetchval("SELECT error FROM cronlock.fanout_items WHERE n = 0")
    assert error == "TimeoutError: exceeded its timeout of 0.5 s"


async def test_done_that_fails_fails_the_run_once_and_items_stay_committed(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    a = await start(start_app, "a")
    run_id = await begin(client, a, n=10, done="raise")
    done = await settled(client, a, run_id)
    assert done["status"] == "failed"
    assert done["error"] == "done failed: RuntimeError: done fails on purpose"
    assert await effects(effects_table) == {i: 1 for i in range(10)}
    assert await dones(effects_table) == []  # its savepoint rolled back


async def test_zero_items_end_the_run_at_once_with_done(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    a = await start(start_app, "a")
    r = await client.post(f"{a.url}/cron/fan-items", headers=AUTH, json={"n": 0})
    assert r.status_code == 202
    assert r.json()["items"] == 0
    done = await view(client, a, r.json()["run_id"])
    assert done["status"] == "succeeded"
    assert len(await dones(effects_table)) == 1


async def test_while_a_fanout_runs_every_trigger_is_already_running(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    a = await start(start_app, "a")
    b = await start(start_app, "b")
    run_id = await begin(client, a, n=40, pause=0.05)
    for app in (a, b):
        for query in ("", "?force=true"):
            skip = await client.post(f"{app.url}/cron/fan-items{query}", headers=AUTH, json={})
            assert skip.status_code == 200, skip.text
            assert skip.json() == {"job": "fan-items", "skipped": True, "reason": "already running"}
    assert (await settled(client, a, run_id))["status"] == "succeeded"
    # Ended: force plans a new run, with new items.
    again = await begin(client, b, n=5)
    assert again != run_id
    assert (await settled(client, a, again))["status"] == "succeeded"
    assert await effects(effects_table, again) == {i: 1 for i in range(5)}


async def test_two_triggers_for_one_slot_make_one_run_and_one_set_of_items(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    a = await start(start_app, "a")
    b = await start(start_app, "b")
    await clear_of_the_minutes_end()
    answers = await asyncio.gather(
        *(
            client.post(f"{app.url}/cron/fan-slot", headers=AUTH, json={"n": 50})
            for app in (a, b, a, b)
        )
    )
    accepted = [r.json() for r in answers if r.status_code == 202]
    assert len(accepted) == 1, [r.text for r in answers]
    assert all(r.status_code in (200, 202) for r in answers)
    run_id = accepted[0]["run_id"]
    assert (await settled(client, a, run_id))["status"] == "succeeded"
    assert await fanout_count(effects_table) == 1
    assert await effects(effects_table) == {i: 1 for i in range(50)}
    after = await client.post(f"{b.url}/cron/fan-slot", headers=AUTH, json={"n": 50})
    assert after.json()["reason"] == "already done"


async def clear_of_the_minutes_end(margin: float = 8.0) -> None:
    """Until the current minute has `margin` seconds left (one slot for what follows)."""
    left = 60 - datetime.now(UTC).second - datetime.now(UTC).microsecond / 1e6
    if left < margin:
        await asyncio.sleep(left + 0.2)


async def fanout_count(db: asyncpg.Connection) -> int:
    return int(await db.fetchval("SELECT count(*) FROM cronlock.fanouts"))


async def test_a_retry_of_a_failed_run_continues_its_items_and_never_redoes_finished_ones(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    a = await start(start_app, "a", retry_poll_interval=0.2)
    await clear_of_the_minutes_end()
    first = await begin(client, a, job="fan-slot", n=30, broken=[4, 9])
    failed = await settled(client, a, first)
    assert failed["status"] == "failed"
    assert failed["items"]["failed"] == 2

    async def retried() -> bool:
        row = await effects_table.fetchrow(
            "SELECT id, status FROM cronlock.runs WHERE retry_of = $1", first
        )
        return row is not None and row["status"] == "succeeded"

    await wait_for(retried, 20, "the retry to succeed")
    second = await effects_table.fetchval("SELECT id FROM cronlock.runs WHERE retry_of = $1", first)
    done = await view(client, a, second)
    assert done["attempt"] == 2
    assert done["items"] == {"total": 30, "done": 30, "failed": 0, "running": 0}
    # The first attempt's 28 items were not redone: the retry worked the two that failed.
    assert await effects(effects_table) == {i: 1 for i in range(30)}
    assert await effects(effects_table, second) == {4: 1, 9: 1}
    # The slot has one fan-out, the retry's now; done ran once, for the run that settled it.
    assert await fanout_count(effects_table) == 1
    # `done` ran once per settling: the first attempt's (2 failed), then the retry's.
    assert [(d["run_id"], d["done"], d["failed"]) for d in await dones(effects_table)] == [
        (first, 28, 2),
        (second, 30, 0),
    ]


async def test_cancel_stops_claiming_and_ends_the_run_cancelled(
    start_app: Starter,
    client: httpx.AsyncClient,
    effects_table: asyncpg.Connection,
    make_settings: Callable[..., Settings],
) -> None:
    from cronlock.ops import views

    a = await start(start_app, "a")
    run_id = await begin(client, a, n=400, pause=0.05)

    async def some() -> bool:
        return len(await effects(effects_table)) >= 10

    await wait_for(some, 10, "some items")
    # What `python -m cronlock cancel fan-items` does.
    cancelled = await views.cancel(
        effects_table,
        load(["tests.fanout_jobs"]),
        make_settings(cron_jobs="tests.fanout_jobs"),
        "fan-items",
        terminate=False,
        wait=10,
        by="a test",
    )
    assert cancelled is not None
    assert cancelled.holder.kind == "fanout"
    assert cancelled.released
    done = await settled(client, a, run_id, within=10)
    assert done["status"] == "cancelled"
    assert done["error"] == "cancelled by a test"
    await asyncio.sleep(0.6)
    count = len(await effects(effects_table))
    await asyncio.sleep(0.6)
    assert len(await effects(effects_table)) == count < 400  # no claims after the cancel
    assert await dones(effects_table) == []
    assert set((await effects(effects_table)).values()) == {1}


async def test_pause_holds_the_items_and_resume_lets_them_go(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    from cronlock.core import pause

    a = await start(start_app, "a")
    run_id = await begin(client, a, n=200, pause=0.03)
    await pause.pause(effects_table, "cronlock", "fan-items", by="a test")
    await asyncio.sleep(1.0)  # the workers see the pause within a poll interval
    held = len(await effects(effects_table))
    await asyncio.sleep(0.8)
    assert len(await effects(effects_table)) == held < 200
    assert (await view(client, a, run_id))["status"] == "running"
    await pause.resume(effects_table, "cronlock", "fan-items")
    done = await settled(client, a, run_id)
    assert done["status"] == "succeeded"
    assert await effects(effects_table) == {i: 1 for i in range(200)}


async def test_retention_removes_a_runs_items_with_it(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    from cronlock.core import ledger

    a = await start(start_app, "a")
    run_id = await settled(client, a, await begin(client, a, n=20))
    assert run_id["status"] == "succeeded"
    await effects_table.execute("UPDATE cronlock.runs SET started_at = now() - interval '91 days'")
    assert await ledger.prune(effects_table, "cronlock", 90 * 86400) == 1
    for table in ("fanouts", "fanout_shards", "fanout_items", "fanout_workers"):
        assert await effects_table.fetchval(f"SELECT count(*) FROM cronlock.{table}") == 0


@pytest.mark.parametrize(
    ("what", "reason"),
    [
        ("nan", "item 1: float 'nan' is not JSON"),
        ("object", "item 0: object"),
        ("many", "more than FANOUT_MAX_ITEMS (1000) items"),
        ("raise", "RuntimeError: the planner fails"),
    ],
)
async def test_a_plan_that_cannot_be_one_fails_the_run_with_the_reason(
    start_app: Starter,
    client: httpx.AsyncClient,
    effects_table: asyncpg.Connection,
    what: str,
    reason: str,
) -> None:
    a = await start(start_app, "a", fanout_max_items=1000)
    r = await client.post(f"{a.url}/cron/fan-bad-plan", headers=AUTH, json={"what": what})
    assert r.status_code == 500
    body = r.json()
    assert body["error"] == "job failed"
    assert "Traceback" not in r.text
    run = await view(client, a, body["run_id"])
    assert run["status"] == "failed"
    assert reason in run["error"]
    assert await effects_table.fetchval("SELECT count(*) FROM cronlock.fanout_items") == 0


def test_declarations_are_checked_up_front(make_settings: Callable[..., Settings]) -> None:
    cron = Cronlock(make_settings(cron_jobs="tests.jobs"), housekeeping=False)

    @cron.job("no-each", fanout=True)
    async def plan(ctx: JobContext) -> list[int]:
        return [1]

    with pytest.raises(JobDefinitionError, match="without an item function"):
        _ = cron.jobs

    @job("plain-for-each")
    async def plain(ctx: JobContext) -> None: ...

    with pytest.raises(JobDefinitionError, match="not a fan-out job"):

        @plain.each(timeout=5)  # type: ignore[attr-defined, untyped-decorator]
        async def item(ctx: ItemContext) -> None: ...

    with pytest.raises(JobDefinitionError, match="not both"):
        job("both-modes", fanout=True, lease=30)

    @job("fan-checked", fanout=True)
    async def checked(ctx: JobContext) -> list[int]:
        return []

    with pytest.raises(JobDefinitionError, match="positive"):
        checked.each(timeout=0)
    with pytest.raises(JobDefinitionError, match="from 0 to"):
        checked.each(retries=-1)
    with pytest.raises(JobDefinitionError, match="async def"):
        checked.each()(lambda ctx: None)  # type: ignore[type-var]

    @checked.done
    async def finished(ctx: DoneContext) -> None: ...

    with pytest.raises(JobDefinitionError, match="without an item function"):
        load([checked.__module__])


async def test_the_fanout_digest_queues_one_email_per_enabled_user_across_instances(
    start_app: Starter, client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """The demo's fan-out job end to end: ranges of users worked by two instances, one email
    per enabled user for the slot, `done` counting them, and the slot "already done" after."""
    a = await start_app("a", cron_jobs="cronlock.demo.fanout", **FANOUT_SETTINGS)
    b = await start_app("b", cron_jobs="cronlock.demo.fanout", **FANOUT_SETTINGS)
    await db.execute(
        "INSERT INTO cronlock_demo.users (email, digest_enabled) "
        "SELECT 'user' || g || '@example.com', g % 5 <> 0 FROM generate_series(1, 250) AS g"
    )
    r = await client.post(f"{a.url}/cron/fanout-digest", headers=AUTH, json={"size": 20})
    assert r.status_code == 202, r.text
    assert r.json()["items"] == 13  # ids 1..250 in ranges of 20
    done = await settled(client, b, r.json()["run_id"])
    assert done["status"] == "succeeded"
    assert done["result"]["result"] == {"queued": 200, "ranges": 13, "failed_ranges": 0}
    rows = await db.fetch(
        "SELECT user_id, count(*) FROM cronlock.email_outbox WHERE job = 'fanout-digest' "
        "GROUP BY user_id"
    )
    assert len(rows) == 200
    assert {x["count"] for x in rows} == {1}
    again = await client.post(f"{a.url}/cron/fanout-digest", headers=AUTH)
    assert again.json()["reason"] == "already done"


async def test_the_dashboard_run_page_shows_progress_and_failed_items(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    from tests.support import TEST_SECRET
    from tests.support.ui import User

    a = await start(start_app, "a", ui_cookie_secure=False)
    run_id = await begin(client, a, n=12, broken=[5])
    assert (await settled(client, a, run_id))["status"] == "failed"
    async with User(a) as user:
        await user.login(TEST_SECRET)
        page = await user.http.get(f"/ui/runs/{run_id}")
    assert page.status_code == 200
    assert '<progress max="12" value="12"' in page.text
    assert "Failed items" in page.text
    assert "RuntimeError: item 5 always fails" in page.text
