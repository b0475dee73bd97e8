"""An operator's retry of a failed fan-out run's failed items (cronlock/core/fanout_retry.py):
through the API, the dashboard and the CLI, worked by the real workers of two instances; the
items that succeeded never redone, `done` once per settling, the attempts recorded, and every
retry that cannot be made refused with its reason."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import asyncpg
import httpx
import pytest

from tests.fanout_jobs import FANOUT_SETTINGS, create_effects
from tests.support import TEST_SECRET
from tests.support.ui import READ_TOKEN, User
from tests.test_fanout import begin, dones, effects, settled, start, view
from tests.util import AUTH, wait_for

Starter = Callable[..., Any]


@pytest.fixture
async def effects_table(db: asyncpg.Connection) -> asyncpg.Connection:
    await create_effects(db)
    return db


async def broken(db: asyncpg.Connection, *items: int) -> None:
    """Items that fail from now on, until `fixed`."""
    await db.executemany("INSERT INTO fanout_broken (item) VALUES ($1)", [(i,) for i in items])


async def fixed(db: asyncpg.Connection, *items: int) -> None:
    await db.execute("DELETE FROM fanout_broken WHERE item = ANY($1::int[])", list(items))


async def retry(
    client: httpx.AsyncClient, app: Any, run_id: int, item: int | str | None = None
) -> httpx.Response:
    path = f"/items/{item}/retry" if item is not None else "/items/retry"
    return await client.post(f"{app.url}/cron/runs/{run_id}{path}", headers=AUTH)


async def failed_run(
    client: httpx.AsyncClient, app: Any, db: asyncpg.Connection, n: int, *items: int
) -> int:
    await broken(db, *items)
    run_id = await begin(client, app, n=n, fixable=True)
    done = await settled(client, app, run_id)
    assert done["status"] == "failed", done
    assert done["items"]["failed"] == len(items)
    return run_id


async def test_retry_one_then_all_continues_the_run_and_never_redoes_finished_items(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    a = await start(start_app, "a")
    b = await start(start_app, "b")
    db = effects_table
    first = await failed_run(client, a, db, 30, 4, 9, 17)
    assert await effects(db) == {i: 1 for i in range(30) if i not in (4, 9, 17)}

    # One item, fixed: a new attempt continues the fan-out with it alone.
    await fixed(db, 4)
    r = await retry(client, a, first, 4)
    assert r.status_code == 202, r.text
    body = r.json()
    second = body["run_id"]
    assert body == {
        "job": "fan-items",
        "run_id": second,
        "retry_of": first,
        "attempt": 2,
        "slot": None,
        "retried": 1,
        "items": 30,
    }
    done = await settled(client, b, second)
    # The items not retried stay failed, and fail the new attempt again.
    assert done["status"] == "failed", done
    assert done["error"] == "2 of 30 items failed"
    assert done["items"] == {"total": 30, "done": 28, "failed": 2, "running": 0}
    assert await effects(db, second) == {4: 1}
    assert (await view(client, a, first))["items"] is None  # its fan-out is the retry's now

    # The first run was retried: its items are retried from the attempt that works them.
    again = await retry(client, a, first)
    assert again.status_code == 409
    assert again.json()["reason"] == (
        f"run {first} was retried already by run {second}: retry the items there"
    )

    # Every failed item, from the other instance: both instances' workers work them.
    await fixed(db, 9, 17)
    r = await retry(client, b, second)
    assert r.status_code == 202, r.text
    assert r.json()["retried"] == 2
    assert r.json()["attempt"] == 3
    third = r.json()["run_id"]
    done = await settled(client, a, third)
    assert done["status"] == "succeeded", done
    assert done["items"] == {"total": 30, "done": 30, "failed": 0, "running": 0}
    assert done["result"] == {"items": 30, "done": 30, "failed": 0, "result": {"seen": 30}}
    # Every item's effect exactly once over the three attempts: finished ones never redone.
    assert await effects(db) == {i: 1 for i in range(30)}
    assert await effects(db, third) == {9: 1, 17: 1}
    # `done` ran once per settling of the fan-out, the last one after the retry of all.
    assert [(d["run_id"], d["done"], d["failed"]) for d in await dones(db)] == [
        (first, 27, 3),
        (second, 28, 2),
        (third, 30, 0),
    ]
    # The attempts, in the ledger and on the items: a retried item starts again at 1.
    runs = await db.fetch(
        "SELECT id, attempt, retry_of, status, source FROM cronlock.runs ORDER BY id"
    )
    assert [tuple(r) for r in runs] == [
        (first, 1, None, "failed", "http"),
        (second, 2, first, "failed", "api"),
        (third, 3, second, "succeeded", "api"),
    ]
    items = await db.fetch(
        "SELECT n, status, attempts, error FROM cronlock.fanout_items WHERE n IN (0, 4, 9, 17) "
        "ORDER BY n"
    )
    assert [tuple(r) for r in items] == [
        (0, "succeeded", 1, None),
        (4, "succeeded", 1, None),
        (9, "succeeded", 1, None),
        (17, "succeeded", 1, None),
    ]


async def test_a_retry_that_cannot_be_made_is_refused_with_its_reason(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    from cronlock.core import pause

    a = await start_app("a", **{**FANOUT_SETTINGS, "cron_jobs": "tests.fanout_jobs,tests.jobs"})
    db = effects_table
    failed = await failed_run(client, a, db, 10, 3)

    async def refused(run_id: int | str, item: int | str | None, status: int, reason: str) -> None:
        r = await retry(client, a, run_id, item)  # type: ignore[arg-type]
        assert r.status_code == status, r.text
        assert "Traceback" not in r.text
        assert reason in r.json().get("reason", r.text), r.text

    await refused(failed, 999, 404, f"run {failed} has no item 999 (its items are 0 to 9)")
    await refused(failed, 0, 409, f"item 0 of run {failed} succeeded: only a failed one")
    await refused(123456, None, 404, "no run 123456")
    for bad in ("-1", "x", str(2**31)):
        await refused(failed, bad, 422, "")
    for bad_run in ("0", "abc", str(2**63)):
        await refused(bad_run, None, 422, "")

    plain = await client.post(f"{a.url}/cron/fast", headers=AUTH)
    await refused(plain.json()["run_id"], None, 409, "is not a fan-out run")
    succeeded = await begin(client, a, n=3)
    assert (await settled(client, a, succeeded))["status"] == "succeeded"
    await refused(succeeded, None, 409, f"run {succeeded} succeeded: only a failed run's")
    bad_plan = await client.post(f"{a.url}/cron/fan-bad-plan", headers=AUTH, json={})
    await refused(bad_plan.json()["run_id"], None, 409, "has no items (its planning failed")

    await pause.pause(db, "cronlock", "fan-items", by="a test")
    await refused(failed, 3, 409, "job 'fan-items' is paused: resume it first")
    await pause.resume(db, "cronlock", "fan-items")

    await fixed(db, 3)
    running = await begin(client, a, n=200, pause=0.05)
    await refused(running, None, 409, f"run {running} is still running")
    await refused(failed, 3, 409, f"job 'fan-items' is running run {running} now")
    cancelled = await client.post(
        f"{a.url}/cron/jobs/fan-items/pause", headers=AUTH, json={"note": "hold"}
    )
    assert cancelled.status_code == 200
    await db.execute(
        "UPDATE cronlock.runs SET cancel_requested_at = now(), cancel_requested_by = 'a test' "
        "WHERE id = $1",
        running,
    )
    await client.post(f"{a.url}/cron/jobs/fan-items/resume", headers=AUTH)
    assert (await settled(client, a, running, within=10))["status"] == "cancelled"
    await refused(running, None, 409, f"run {running} cancelled: only a failed run's")

    # Another method on the retry routes: 405, naming POST (not "unknown job").
    for path in (f"runs/{failed}/items/retry", f"runs/{failed}/items/3/retry"):
        r = await client.get(f"{a.url}/cron/{path}", headers=AUTH)
        assert r.status_code == 405, r.text
        assert r.headers["allow"] == "POST"
    # Without the secret: nothing to see; with the read token: not allowed either.
    for headers in ({}, {"Authorization": f"Bearer {READ_TOKEN}"}):
        r = await client.post(f"{a.url}/cron/runs/{failed}/items/retry", headers=headers)
        assert r.status_code == 401
    # None of these made an attempt: the failed run is retried now, once.
    r = await retry(client, a, failed, 3)
    assert r.status_code == 202, r.text
    assert (await settled(client, a, r.json()["run_id"]))["status"] == "succeeded"
    assert await db.fetchval("SELECT count(*) FROM cronlock.runs WHERE retry_of IS NOT NULL") == 1


async def test_the_run_page_retries_one_or_all_failed_items_with_its_forms(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    a = await start(start_app, "a", ui_cookie_secure=False, cron_read_token=READ_TOKEN)
    db = effects_table
    first = await failed_run(client, a, db, 12, 2, 5)
    async with User(a) as reader:
        await reader.login(READ_TOKEN)
        page = await reader.http.get(f"/ui/runs/{first}")
        assert "Failed items" in page.text
        assert '<form method="post" action="/ui/runs/' not in page.text  # no forms to see
        refused = await reader.act(f"/ui/runs/{first}/items/retry")
        assert refused.status_code == 403
    async with User(a) as user:
        await user.login(TEST_SECRET)
        page = await user.http.get(f"/ui/runs/{first}")
        assert f'action="/ui/runs/{first}/items/retry"' in page.text
        assert "Retry all 2 failed items" in page.text
        assert f'action="/ui/runs/{first}/items/5/retry"' in page.text
        # A form without the session's CSRF token changes nothing.
        forged = await user.http.post(f"/ui/runs/{first}/items/5/retry", data={})
        assert forged.status_code == 403
        bad = await user.act(f"/ui/runs/{first}/items/x/retry")
        assert bad.status_code == 422
        assert "Invalid item number" in bad.text
        missing = await user.act(f"/ui/runs/{first}/items/7/retry")
        assert missing.status_code == 409
        assert f"Not retried: item 7 of run {first} succeeded" in missing.text

        await fixed(db, 5)
        one = await user.act(f"/ui/runs/{first}/items/5/retry")
        assert one.status_code == 303, one.text
        second = int(one.headers["location"].split("/")[-1].split("?")[0])
        assert one.headers["location"] == f"/ui/runs/{second}?notice=items-retried"
        assert (await settled(client, a, second))["status"] == "failed"
        page = await user.http.get(f"/ui/runs/{second}")
        assert "Retry all 1 failed item<" in page.text
        assert f'continues <a href="/ui/runs/{first}">run {first}</a>' in page.text
        # The first run's page no longer shows the items (the retry works them): it says where.
        page = await user.http.get(f"/ui/runs/{first}")
        assert "Failed items" not in page.text
        assert f'retried by <a href="/ui/runs/{second}" data-retried-by>' in page.text

        await fixed(db, 2)
        all_ = await user.act(f"/ui/runs/{second}/items/retry")
        assert all_.status_code == 303
        third = int(all_.headers["location"].split("/")[-1].split("?")[0])
        assert (await settled(client, a, third))["status"] == "succeeded"
        page = await user.http.get(f"/ui/runs/{third}")
        assert '<progress max="12" value="12"' in page.text
        assert "Failed items" not in page.text
        # A retry of a run retried already: the problem page says why.
        stale = await user.act(f"/ui/runs/{first}/items/retry")
        assert stale.status_code == 409
        assert f"retried already by run {second}" in stale.text
    assert await effects(db) == {i: 1 for i in range(12)}
    assert len(await dones(db)) == 3
    actions = await db.fetch(
        "SELECT action, target FROM cronlock.ui_actions WHERE action = 'retry-items' ORDER BY id"
    )
    assert [tuple(r) for r in actions] == [
        ("retry-items", str(first)),
        ("retry-items", str(second)),
    ]


async def test_concurrent_retries_of_one_run_on_two_instances_make_one_attempt(
    start_app: Starter, client: httpx.AsyncClient, effects_table: asyncpg.Connection
) -> None:
    """Concurrent retries of one failed run, on two instances: one is made, the others are
    refused (its lock is busy, the run was retried already, or its retry runs); the items are
    worked once."""
    a = await start(start_app, "a")
    b = await start(start_app, "b")
    db = effects_table
    first = await failed_run(client, a, db, 20, 1, 2, 3)
    await fixed(db, 1, 2, 3)
    answers = await asyncio.gather(*(retry(client, app, first) for app in (a, b, a, b, a, b)))
    made = [r.json() for r in answers if r.status_code == 202]
    assert len(made) == 1, [r.text for r in answers]
    assert {r.status_code for r in answers} == {202, 409}
    assert (await settled(client, a, made[0]["run_id"]))["status"] == "succeeded"
    assert await effects(db) == {i: 1 for i in range(20)}
    assert len(await dones(db)) == 2


async def test_the_cli_retries_items_for_the_instances_to_work(
    start_app: Starter,
    client: httpx.AsyncClient,
    effects_table: asyncpg.Connection,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Any,
) -> None:
    """`python -m cronlock retry-items` records the new attempt; a serving instance's workers
    work its items. Refusals are one line: exit 2 for a wrong argument, 1 for a state."""
    from cronlock.cli import main as cli

    monkeypatch.chdir(tmp_path)
    for name, value in {
        "DATABASE_URL": database_url,
        "CRON_JOBS": "tests.fanout_jobs",
        "INSTANCE_NAME": "cli",
        "OUTBOX_ENABLED": "false",
    }.items():
        monkeypatch.setenv(name, value)
    a = await start(start_app, "a")
    db = effects_table
    first = await failed_run(client, a, db, 10, 6)

    async def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        try:
            code = await asyncio.to_thread(cli.main, ["retry-items", *args])
        except SystemExit as exc:  # argparse's refusal of an argument: its usage, exit 2
            code = int(exc.code or 0)
        out, err = capsys.readouterr()
        return code, out, err

    code, out, err = await run(str(first), "--item", "99")
    assert (code, out) == (2, "")
    assert err == f"cronlock: not retried: run {first} has no item 99 (its items are 0 to 9)\n"
    code, _, err = await run(str(first), "--item", "0")
    assert code == 1
    assert err == (
        f"cronlock: not retried: item 0 of run {first} succeeded: only a failed one is retried\n"
    )
    code, _, err = await run("x")
    assert code == 2
    assert "Traceback" not in err
    await fixed(db, 6)
    code, out, _ = await run(str(first), "--json")
    assert code == 0
    body = json.loads(out)
    assert body["retry_of"] == first
    assert body["retried"] == 1
    done = await settled(client, a, body["run_id"])
    assert done["status"] == "succeeded"
    assert done["source"] == "cli"
    assert await effects(db) == {i: 1 for i in range(10)}


@pytest.mark.parametrize("first_to_retry", ["operator", "loop"])
async def test_an_operators_retry_and_cronlocks_retry_loop_make_one_attempt(
    start_app: Starter,
    client: httpx.AsyncClient,
    effects_table: asyncpg.Connection,
    first_to_retry: str,
) -> None:
    """A scheduled fan-out run that failed is retried by cronlock's retry loop (every 0.2 s,
    0.2 s after the failure) and by an operator: whoever comes second finds it retried (or
    its retry running), and the slot gets one more attempt, not two."""
    from tests.test_fanout import clear_of_the_minutes_end

    a = await start(start_app, "a", retry_poll_interval=0.2)
    db = effects_table
    await clear_of_the_minutes_end()
    first = await begin(client, a, job="fan-slot", n=20, broken=[3, 8])
    assert (await settled(client, a, first))["status"] == "failed"

    async def loop_retried() -> bool:
        found = await db.fetchval("SELECT id FROM cronlock.runs WHERE retry_of = $1", first)
        return found is not None

    if first_to_retry == "loop":
        await wait_for(loop_retried, 10, "the retry loop's attempt")
    r = await retry(client, a, first)
    await wait_for(loop_retried, 10, "the slot's second attempt")
    second = await db.fetchval("SELECT id FROM cronlock.runs WHERE retry_of = $1", first)
    if r.status_code == 409:  # the loop came first (on a loaded machine, maybe even here)
        assert r.json()["reason"] in (
            f"run {first} was retried already by run {second}: retry the items there",
            f"job 'fan-slot' is running run {second} now: retry after it ends",
            # The loop held the job's lock at that moment, making its attempt.
            "job 'fan-slot' is busy (a trigger or a retry holds its lock): try again",
        )
    else:
        assert first_to_retry == "operator"
        assert r.status_code == 202, r.text
        assert r.json()["run_id"] == second
    assert (await settled(client, a, second))["status"] == "succeeded"
    await asyncio.sleep(1.0)  # passes of the retry loop: nothing left to retry
    runs = await db.fetch("SELECT id, attempt, retry_of, source FROM cronlock.runs ORDER BY id")
    source = "retry" if r.status_code == 409 else "api"
    assert [tuple(x) for x in runs] == [(first, 1, None, "http"), (second, 2, first, source)]
    assert await effects(db) == {i: 1 for i in range(20)}
    assert await effects(db, second) == {3: 1, 8: 1}
    assert [(d["run_id"], d["done"], d["failed"]) for d in await dones(db)] == [
        (first, 18, 2),
        (second, 20, 0),
    ]
