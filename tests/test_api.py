"""The HTTP contract of an instance: auth first, then 404/405, 413, 422, then the run.

In-process (`start_app`): nothing here crosses a process boundary, except uvicorn's
--root-path, which a real process serves."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import asyncpg
import pytest

from tests.support import TEST_SECRET
from tests.support.asgi import InProcess, StartApp
from tests.util import AUTH, effects, lock_held, post, runs, wait_for

PREVIOUS = "p" * 40

Starter = Callable[..., Any]


@pytest.fixture
async def instance(start_app: StartApp) -> InProcess:
    return await start_app("api", cron_secret_previous=PREVIOUS, max_body_bytes=1024)


BAD_AUTH = [
    {},
    {"Authorization": ""},
    {"Authorization": "Bearer"},
    {"Authorization": f"Bearer  {TEST_SECRET}"},
    {"Authorization": f"Bearer {TEST_SECRET} extra"},
    {"Authorization": f"Basic {TEST_SECRET}"},
    {"Authorization": f"Bearer {TEST_SECRET}x"},
    {"Authorization": f"Bearer {TEST_SECRET[:-1]}"},
    {"Authorization": "Bearer " + "a" * 10_000},
    {"Authorization": TEST_SECRET},
]


async def test_bad_credentials_get_401_before_anything(instance: Any, client: Any) -> None:
    for headers in BAD_AUTH:
        for path in ("/cron/fast", "/cron/no-such-job", "/openapi.json", "/cron/jobs"):
            r = await client.post(instance.url + path, headers=headers)
            assert r.status_code == 401, (headers, path)
            assert r.json() == {"error": "Unauthorized"}
            assert r.headers["www-authenticate"] == "Bearer"


async def test_non_ascii_token_is_401_not_500(instance: Any, client: Any) -> None:
    raw = b"Bearer " + "é".encode() * 30
    r = await client.post(instance.url + "/cron/fast", headers={"Authorization": raw})
    assert r.status_code == 401


async def test_auth_holds_behind_a_root_path(start_instance: Starter, client: Any) -> None:
    # Behind a proxy that strips a path prefix, uvicorn --root-path puts the prefix back in
    # front of every path it hands the app; the app routes on what follows it.
    i = start_instance("rooted", {"UVICORN_ROOT_PATH": "/api"})
    for method, path in (("POST", "/cron/fast"), ("GET", "/cron/jobs"), ("GET", "/nope")):
        r = await client.request(method, i.url + path)
        assert r.status_code == 401, (method, path, r.text)
    assert (await client.get(i.url + "/healthz")).status_code == 200
    r = await post(client, i.url + "/cron/fast")
    assert r.status_code == 200
    assert r.json()["processed"] == 1


async def test_token_in_query_string_is_ignored(instance: Any, client: Any) -> None:
    r = await client.post(
        instance.url + "/cron/fast", params={"token": TEST_SECRET, "access_token": TEST_SECRET}
    )
    assert r.status_code == 401


async def test_scheme_is_case_insensitive_and_previous_secret_works(
    instance: Any, client: Any, db: asyncpg.Connection
) -> None:
    for header in (f"bearer {TEST_SECRET}", f"BEARER {TEST_SECRET}", f"Bearer {PREVIOUS}"):
        r = await client.post(instance.url + "/cron/fast", headers={"Authorization": header})
        assert r.status_code == 200, r.text
        assert r.json()["processed"] == 1
    assert await effects(db, "fast") == 3


async def test_unknown_job_404_and_wrong_method_405(instance: Any, client: Any) -> None:
    r = await post(client, instance.url + "/cron/no-such-job")
    assert r.status_code == 404
    assert r.json()["error"] == "unknown job"
    tricky_paths = (
        "fast;DROP TABLE cronlock.runs",
        "..%2F..%2Fetc%2Fpasswd",
        "fast'--",
        "a/b/c",
        "fast/",
    )
    for tricky in tricky_paths:
        r = await post(client, instance.url + "/cron/" + tricky)
        assert r.status_code == 404, tricky
    r = await client.get(instance.url + "/cron/fast", headers=AUTH)
    assert r.status_code == 405
    assert r.headers["allow"] == "POST"
    r = await client.delete(instance.url + "/cron/fast", headers=AUTH)
    assert r.status_code == 405


async def test_reserved_names_are_not_jobs(instance: Any, client: Any) -> None:
    for name in ("jobs", "runs", "locks"):
        r = await post(client, instance.url + "/cron/" + name)
        assert r.status_code in (404, 405), name


async def test_body_too_large_is_413_before_422(instance: Any, client: Any) -> None:
    big = b"{" * 2000  # too large and not JSON: the size answers first
    r = await client.post(instance.url + "/cron/slow", content=big, headers=AUTH)
    assert r.status_code == 413
    r = await client.post(
        instance.url + "/cron/slow?force=notabool", content=b"x" * 2000, headers=AUTH
    )
    assert r.status_code == 413


async def test_invalid_input_is_422_and_takes_no_lock(
    instance: Any, client: Any, db: asyncpg.Connection
) -> None:
    r = await client.post(instance.url + "/cron/slow", content=b"{not json", headers=AUTH)
    assert r.status_code == 422
    r = await post(client, instance.url + "/cron/slow", json={"seconds": "long"})
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["seconds"]
    r = await post(client, instance.url + "/cron/slow", json={"seconds": 99})
    assert r.status_code == 422
    r = await post(client, instance.url + "/cron/slow?force=perhaps")
    assert r.status_code == 422
    r = await post(client, instance.url + "/cron/yearly?slot=yesterday")
    assert r.status_code == 422
    # Valid date-times at the ends of the calendar: the schedule cannot step past them.
    for edge in ("0001-01-01T07:00:00Z", "9999-12-31T07:00:00Z"):
        r = await post(client, instance.url + f"/cron/yearly?slot={edge}")
        assert r.status_code == 422, (edge, r.text)
        assert r.json()["error"] == "invalid trigger", r.text
    # One whose instant in UTC is past year 9999 is no timestamp at all: the query is wrong.
    r = await post(client, instance.url + "/cron/yearly?slot=9999-12-31T23:59:00-01:00")
    assert r.status_code == 422, r.text
    assert r.json()["error"] == "invalid query parameters", r.text
    assert r.json()["detail"][0]["loc"] == ["slot"]
    assert await runs(db, "slow") == []


async def test_openapi_lists_jobs_behind_auth(instance: Any, client: Any) -> None:
    r = await client.get(instance.url + "/openapi.json")
    assert r.status_code == 401
    r = await client.get(instance.url + "/openapi.json", headers=AUTH)
    assert r.status_code == 200
    paths = r.json()["paths"]
    for name in ("fast", "slow", "yearly", "minutely"):
        assert "post" in paths[f"/cron/{name}"]
    slow = paths["/cron/slow"]["post"]
    assert slow["requestBody"]["content"]["application/json"]["schema"]["properties"]["seconds"]


async def test_health_is_open(instance: Any, client: Any) -> None:
    assert (await client.get(instance.url + "/healthz")).json() == {"status": "ok"}
    r = await client.get(instance.url + "/readyz")
    assert r.status_code == 200
    assert r.json()["status"] == "ready"


async def test_get_trigger_is_opt_in(start_app: StartApp, client: Any) -> None:
    i = await start_app("get", cron_allow_get=True)
    r = await client.get(i.url + "/cron/fast", headers=AUTH)
    assert r.status_code == 200
    assert r.json()["processed"] == 1
    r = await client.get(i.url + "/cron/fast")
    assert r.status_code == 401


async def test_job_failure_is_500_with_run_id_and_leaves_nothing(
    instance: Any, client: Any, db: asyncpg.Connection
) -> None:
    for job in ("fails", "sql-fails", "bad-result", "nan-result", "cancels-itself"):
        first = await post(client, instance.url + f"/cron/{job}")
        assert first.status_code == 500
        body = first.json()
        assert body == {"error": "job failed", "job": job, "run_id": body["run_id"]}
        assert "Traceback" not in first.text
        # The lock went with the rollback: the next trigger runs (and fails) again.
        second = await post(client, instance.url + f"/cron/{job}")
        assert second.status_code == 500
        assert second.json()["run_id"] != body["run_id"]
        assert await effects(db, job) == 0
        rows = await runs(db, job)
        assert [r["status"] for r in rows] == ["failed", "failed"]
        assert rows[0]["error"]
        assert not await lock_held(db, job)


async def test_a_commit_the_server_refuses_is_a_sure_failure(
    start_app: StartApp, client: Any, db: asyncpg.Connection
) -> None:
    """A deferred constraint refused at COMMIT: the server answered, nothing landed, so the
    answer is the plain job failure (no `commit: unknown`)."""
    instance = await start_app("refused", cron_jobs="tests.jobs,tests.commit_jobs")
    r = await post(client, instance.url + "/cron/commit-refused")
    assert r.status_code == 500
    assert r.json() == {
        "error": "job failed",
        "job": "commit-refused",
        "run_id": r.json()["run_id"],
    }
    [row] = await runs(db, "commit-refused")
    assert row["status"] == "failed"
    assert "commit failed" in row["error"]
    assert await effects(db, "commit-refused") == 0


async def test_a_commit_cut_off_midway_is_answered_commit_unknown(
    start_app: StartApp, client: Any, db: asyncpg.Connection
) -> None:
    """The COMMIT outlasts DB_QUERY_TIMEOUT (a deferred trigger sleeping in it): the runner
    closes the connection mid-commit and cannot know whether it landed, and says so. The
    server, finding its client gone, rolls back; the run's row then says `failed`."""
    instance = await start_app(
        "cut-off", cron_jobs="tests.jobs,tests.commit_jobs", db_query_timeout=0.5
    )
    r = await post(client, instance.url + "/cron/slow-commit", json={"seconds": 3})
    assert r.status_code == 500
    body = r.json()
    assert body == {
        "error": "job failed",
        "job": "slow-commit",
        "run_id": body["run_id"],
        "commit": "unknown",
    }
    assert "Traceback" not in r.text

    async def recorded() -> bool:
        return [row["status"] for row in await runs(db, "slow-commit")] == ["failed"]

    await wait_for(recorded, 10, "the run recorded failed")
    assert await effects(db, "slow-commit") == 0
    assert not await lock_held(db, "slow-commit")


async def test_session_state_a_job_leaves_is_cleared_with_its_commit(
    start_app: StartApp, client: Any, db: asyncpg.Connection
) -> None:
    """A plain SET, a session advisory lock, a LISTEN: committed with the run, they would stay
    on the pooled connection (behind PgBouncer: on a server connection other clients get)."""
    instance = await start_app("state", db_pool_max_size=2)
    r = await post(client, instance.url + "/cron/leaves-session-state")
    assert r.status_code == 200, r.text
    careless_pid = r.json()["processed"]
    assert [r["status"] for r in await runs(db, "leaves-session-state")] == ["succeeded"]
    held = await db.fetchval(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = 777"
    )
    assert held == 0
    seen = []
    for _ in range(20):  # two pooled connections: soon one run lands on the careless one
        r = await post(client, instance.url + "/cron/session-state")
        assert r.status_code == 200, r.text
        seen.append(r.json()["processed"])
        if seen[-1]["pid"] == careless_pid:
            break
    found = [s for s in seen if s["pid"] == careless_pid]
    assert found, f"no run on backend {careless_pid}: {seen}"
    defaults = await db.fetchrow(
        "SELECT current_setting('work_mem') AS w, current_setting('search_path') AS p"
    )
    assert defaults is not None
    assert found[0]["work_mem"] == defaults["w"]
    assert found[0]["search_path"] == defaults["p"]
    assert found[0]["channels"] == []
    assert found[0]["cursors"] == []


async def test_unexpected_error_is_500_without_a_trace(
    instance: Any, client: Any, db: asyncpg.Connection
) -> None:
    # A bug in a job's params model raises before the runner is reached.
    r = await post(client, instance.url + "/cron/buggy-params", json={})
    assert r.status_code == 500
    assert r.json() == {"error": "internal error"}
    assert await runs(db, "buggy-params") == []
    assert not await lock_held(db, "buggy-params")

    async def logged() -> bool:
        return "a bug in the params model" in instance.log()

    await wait_for(logged, 5, "the error's log line")
    # The instance goes on answering.
    assert (await post(client, instance.url + "/cron/fast")).status_code == 200


async def test_timeout_is_504_lock_released_nothing_persisted(
    instance: Any, client: Any, db: asyncpg.Connection
) -> None:
    r = await post(client, instance.url + "/cron/times-out", json={"seconds": 5})
    assert r.status_code == 504
    body = r.json()
    assert body["error"] == "job timed out"
    assert isinstance(body["run_id"], int)
    assert not await lock_held(db, "times-out")
    assert await effects(db, "times-out") == 0
    (row,) = await runs(db, "times-out")
    assert row["status"] == "timed_out"
    assert row["id"] == body["run_id"]
    # And it can run again at once.
    r = await post(client, instance.url + "/cron/times-out", json={"seconds": 5})
    assert r.status_code == 504


async def test_success_answer_and_ledger(
    instance: Any, client: Any, db: asyncpg.Connection
) -> None:
    r = await post(client, instance.url + "/cron/slow", json={"seconds": 0.01})
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"job", "processed", "run_id", "slot", "duration_ms"}
    assert body["processed"] == {"slept": 0.01}
    assert body["slot"] is None
    (row,) = await runs(db, "slow")
    assert row["status"] == "succeeded"
    assert row["result"] == {"slept": 0.01}
    assert row["params"] == {"seconds": 0.01}
    assert row["instance"] == "api"
    assert row["finished_at"] >= row["started_at"]


async def test_every_trigger_is_logged_skips_included(
    instance: Any, client: Any, start_app: StartApp
) -> None:
    await post(client, instance.url + "/cron/yearly")
    await post(client, instance.url + "/cron/yearly")

    async def logged() -> bool:
        return '"reason": "already done"' in instance.log()

    await wait_for(logged, 5, "the skip's log line")
    lines = [line for line in instance.log().splitlines() if '"job": "yearly"' in line]
    assert [json.loads(line)["outcome"] for line in lines] == ["succeeded", "skipped"]
    quiet = await start_app("quiet", log_skips=False)
    await post(client, quiet.url + "/cron/yearly")
    await post(client, quiet.url + "/cron/fast")

    async def fast_logged() -> bool:  # after the skip's line, had there been one
        return '"job": "fast"' in quiet.log()

    await wait_for(fast_logged, 5, "the quiet instance's run line")
    assert '"reason": "already done"' not in quiet.log()
