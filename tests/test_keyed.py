"""Keyed jobs: one run at a time per key, different keys at once, once per (job, key, slot);
declared and validated up front, shown by the operator views. Real instances, real database."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import asyncpg
import pytest
from pydantic import BaseModel

from cronlock.core import jobs as jobs_module
from cronlock.core.jobs import job, key_text, load
from cronlock.core.params import parse_params
from cronlock.db.lock import lock_key, lock_text
from cronlock.errors import InvalidTrigger, JobDefinitionError
from tests.util import AUTH, lock_free, post, wait_for

Starter = Callable[..., Any]


@pytest.fixture
def trio(start_instance: Starter) -> list[Any]:
    # Room for every key's run at once on one instance (a lock transaction per run, plus the
    # ledger's second connection for a moment): the test is about locks, not pool sizing.
    return [start_instance(f"k{n}", {"DB_POOL_MAX_SIZE": "25"}) for n in range(1, 4)]


async def keyed_runs(db: asyncpg.Connection, job_name: str) -> list[asyncpg.Record]:
    return await db.fetch(
        "SELECT * FROM cronlock.runs WHERE job = $1 ORDER BY started_at, id", job_name
    )


async def effects_by_key(db: asyncpg.Connection, job_name: str) -> dict[str, int]:
    """Committed effects of `job_name` per run key (through the run that wrote each)."""
    rows = await db.fetch(
        """SELECT r.key, count(*) AS n FROM job_effects e JOIN cronlock.runs r ON r.id = e.run_id
           WHERE e.job = $1 GROUP BY r.key""",
        job_name,
    )
    return {r["key"]: r["n"] for r in rows}


def overlapping(runs: list[asyncpg.Record]) -> bool:
    """Every run was in progress at one same instant: the latest start before the first end."""
    return bool(max(r["started_at"] for r in runs) < min(r["finished_at"] for r in runs))


# --- declaration and canonical text ----------------------------------------------------------


class Params(BaseModel):
    customer_id: int
    name: str = ""
    ratio: float = 1.0
    flag: bool = False
    maybe: int | None = None


async def _noop(ctx: Any) -> int:
    return 1


@pytest.mark.parametrize(
    ("key", "params", "problem"),
    [
        ("customer_id", None, "needs params="),
        ("nope", Params, "is not a field"),
        ("name", Params, "has a default"),
        ("ratio", Params, "has a default"),
    ],
)
def test_a_key_must_be_a_required_field(key: str, params: Any, problem: str) -> None:
    with pytest.raises(JobDefinitionError, match=problem):
        job("bad-key", key=key, params=params)


class Typed(BaseModel):
    ratio: float
    flag: bool
    maybe: int | None
    when: datetime


def test_a_keyed_job_cannot_catch_up() -> None:
    """A catch-up run has no trigger, so no key to run for."""
    with pytest.raises(JobDefinitionError, match="cannot catch_up"):
        job("bad-key", schedule="0 * * * *", catch_up=True, key="customer_id", params=Params)
    for policy in ("latest", "all"):
        with pytest.raises(JobDefinitionError, match="cannot catch_up"):
            job("bad-key", schedule="0 * * * *", missed=policy, key="customer_id", params=Params)


@pytest.mark.parametrize("key", ["ratio", "flag", "maybe", "when"])
def test_a_key_needs_a_type_with_one_stable_text(key: str) -> None:
    """A float, a bool, an optional value or a datetime has no one text a client agrees on."""
    with pytest.raises(JobDefinitionError, match="must be str or int"):
        job("bad-key", key=key, params=Typed)


def test_the_key_text_is_the_validated_value() -> None:
    registry = load(["tests.jobs"])
    keyed = registry["keyed"]
    # "42" is validated into the int 42: one customer, one text, however the client spelled it.
    for body in (b'{"customer_id": 42}', b'{"customer_id": "42"}', b'{"customer_id": 42.0}'):
        assert keyed.key_of(parse_params(keyed, body)) == "42"
    assert key_text("a:b c") == "a:b c"
    with pytest.raises(TypeError):
        key_text(True)


def test_a_key_less_job_keeps_its_lock_text_and_a_keyed_run_adds_its_key() -> None:
    assert lock_text("cronlock", "fast") == "cronlock:fast"  # as before keys: no upgrade change
    assert lock_text("cronlock", "keyed", "42") == "cronlock:keyed:42"
    registry = load(["tests.jobs"])
    assert registry.lock("keyed", "42") == lock_key("cronlock:keyed:42", 0)
    assert registry.lock("keyed", "42") != registry.lock("keyed", "43")


def test_a_key_the_ledger_cannot_take_is_refused_naming_its_field() -> None:
    class Free(BaseModel):
        k: str

    job("free-key", key="k", params=Free)(_noop)
    free = jobs_module._DECLARED["free-key"]
    for body, words in (
        (b'{"k": ""}', "is empty"),
        (json.dumps({"k": "x" * 201}).encode(), "longer than 200"),
        (b'{"k": "a\\u0000b"}', "NUL"),
    ):
        with pytest.raises(InvalidTrigger) as caught:
            parse_params(free, body)
        (problem,) = caught.value.args[0]
        assert problem["loc"] == ["k"], problem
        assert words in problem["msg"], problem
    del jobs_module._DECLARED["free-key"]


async def test_the_mirror_hashes_keyed_texts_as_the_server_does(db: asyncpg.Connection) -> None:
    for text in ("cronlock:keyed:42", "cronlock:keyed:ü €", "cronlock:keyed:" + "z" * 200):
        server = await db.fetchval("SELECT hashtextextended($1, 7)", text)
        assert lock_key(text, 7).key == server


# --- the ledger's guarantee (migration 0005) -------------------------------------------------


INSERT_SUCCESS = """
INSERT INTO cronlock.runs (job, key, slot, status, trigger, instance)
VALUES ($1, $2, '2026-01-01T00:00Z', 'succeeded', 'scheduled', 'test')
"""


async def test_once_per_job_key_and_slot_is_a_database_fact(db: asyncpg.Connection) -> None:
    """Without NULLS NOT DISTINCT (PostgreSQL 15+): two key-less successes of one slot still
    collide, as two of one key do; different keys do not."""
    await db.execute(INSERT_SUCCESS, "keyed-yearly", "1")
    await db.execute(INSERT_SUCCESS, "keyed-yearly", "2")
    with pytest.raises(asyncpg.UniqueViolationError):
        await db.execute(INSERT_SUCCESS, "keyed-yearly", "1")
    await db.execute(INSERT_SUCCESS, "yearly", None)
    with pytest.raises(asyncpg.UniqueViolationError):
        await db.execute(INSERT_SUCCESS, "yearly", None)


async def test_the_previous_probe_still_answers_during_a_rolling_deploy(
    db: asyncpg.Connection,
) -> None:
    """An instance of the previous release calls the five-argument probe until replaced."""
    key = lock_key("cronlock:yearly", 0)
    row = await db.fetchrow(
        "SELECT * FROM cronlock.probe('yearly', $1, $2, true, NULL)", key.classid, key.objid
    )
    assert row is not None
    assert (row["standby"], row["running"]) == (False, False)


# --- real instances ----------------------------------------------------------------------


async def test_200_triggers_for_20_keys_over_3_instances_run_once_per_key_and_slot(
    trio: list[Any], client: Any, db: asyncpg.Connection
) -> None:
    slot = datetime(datetime.now(UTC).year, 1, 1, tzinfo=UTC).isoformat()
    requests = [
        (trio[n % 3].url + "/cron/keyed-yearly", {"customer_id": n % 20 + 1, "seconds": 2})
        for n in range(200)
    ]
    answers = await asyncio.gather(*(post(client, url, json=body) for url, body in requests))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    ran = [a.json() for a in answers if "processed" in a.json()]
    skipped = [(body, a.json()) for (_, body), a in zip(requests, answers, strict=True)]
    skipped = [(body, answer) for body, answer in skipped if answer.get("skipped")]
    assert sorted(int(b["key"]) for b in ran) == list(range(1, 21))
    assert all(b["processed"] == {"key": b["key"]} and b["slot"] == slot for b in ran)
    assert len(skipped) == 180
    # Every skip names its own key, and says why.
    assert all(a["key"] == str(b["customer_id"]) for b, a in skipped)
    assert {a["reason"] for _, a in skipped} <= {"already running", "already done"}
    runs = await keyed_runs(db, "keyed-yearly")
    assert [r["status"] for r in runs] == ["succeeded"] * 20
    assert sorted(r["key"] for r in runs) == sorted(str(k) for k in range(1, 21))
    assert await effects_by_key(db, "keyed-yearly") == {str(k): 1 for k in range(1, 21)}
    # Different keys ran at once (on whichever instances won their locks: under load one
    # instance may win them all, which is as correct).
    assert overlapping(runs), [(r["started_at"], r["finished_at"]) for r in runs]
    # The slot is done per key: every later trigger says so, with its key.
    again = await asyncio.gather(
        *(
            post(client, trio[k % 3].url + "/cron/keyed-yearly", json={"customer_id": k})
            for k in (1, 20)
        )
    )
    assert [a.json() for a in again] == [
        {
            "job": "keyed-yearly",
            "skipped": True,
            "reason": "already done",
            "key": str(k),
            "slot": slot,
        }
        for k in (1, 20)
    ]
    # A key with no run yet in this slot still runs.
    fresh = await post(client, trio[0].url + "/cron/keyed-yearly", json={"customer_id": 21})
    assert fresh.json()["key"] == "21"
    assert "processed" in fresh.json()


async def test_200_triggers_for_20_keys_of_an_unscheduled_job_run_one_per_key_at_once(
    trio: list[Any], client: Any, db: asyncpg.Connection
) -> None:
    requests = [
        (trio[n % 3].url + "/cron/keyed", {"customer_id": n % 20 + 1, "seconds": 4})
        for n in range(200)
    ]
    answers = await asyncio.gather(*(post(client, url, json=body) for url, body in requests))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    bodies = [a.json() for a in answers]
    ran = [b for b in bodies if "processed" in b]
    assert sorted(int(b["key"]) for b in ran) == list(range(1, 21))
    for (_, body), answer in zip(requests, answers, strict=True):
        if answer.json().get("skipped"):
            assert answer.json() == {
                "job": "keyed",
                "skipped": True,
                "reason": "already running",
                "key": str(body["customer_id"]),
            }
    runs = await keyed_runs(db, "keyed")
    assert len(runs) == 20
    assert {r["status"] for r in runs} == {"succeeded"}
    assert overlapping(runs), [(r["started_at"], r["finished_at"]) for r in runs]
    assert await effects_by_key(db, "keyed") == {str(k): 1 for k in range(1, 21)}


async def test_a_key_missing_or_wrong_is_a_422_naming_the_field(
    start_instance: Starter, client: Any, db: asyncpg.Connection
) -> None:
    instance = start_instance("k1")
    url = instance.url + "/cron/keyed"
    for body in (None, {}, {"seconds": 1}):
        answer = await post(client, url, json=body)
        assert answer.status_code == 422, answer.text
        assert [d["loc"] for d in answer.json()["detail"]] == [["customer_id"]]
    wrong = await post(client, url, json={"customer_id": "forty-two"})
    assert wrong.status_code == 422
    assert wrong.json()["detail"][0]["loc"] == ["customer_id"]
    # The OpenAPI document says the body (with its key) is required.
    doc = (await client.get(instance.url + "/openapi.json", headers=AUTH)).json()
    body = doc["paths"]["/cron/keyed"]["post"]["requestBody"]
    assert body["required"] is True
    assert doc["paths"]["/cron/fast"]["post"].get("requestBody") is None
    assert await db.fetchval("SELECT count(*) FROM cronlock.runs") == 0


async def test_the_same_key_twice_at_once_runs_once_other_keys_go_on(
    start_instance: Starter, client: Any, db: asyncpg.Connection
) -> None:
    """On one instance (its local map is per key) and across two (the database's lock)."""
    one, two = start_instance("k1"), start_instance("k2")
    first = asyncio.create_task(
        post(client, one.url + "/cron/keyed", json={"customer_id": 7, "seconds": 2})
    )
    await wait_for(lambda: _running(db, "keyed", "7"), 10, "key 7's run")
    same_here, same_there, other = await asyncio.gather(
        post(client, one.url + "/cron/keyed", json={"customer_id": 7}),
        post(client, two.url + "/cron/keyed", json={"customer_id": 7}),
        post(client, one.url + "/cron/keyed", json={"customer_id": 8, "seconds": 0.5}),
    )
    skip = {"job": "keyed", "skipped": True, "reason": "already running", "key": "7"}
    assert same_here.json() == skip
    assert same_there.json() == skip
    assert other.json()["key"] == "8"
    assert "processed" in other.json()
    done = (await first).json()
    assert (done["key"], done["processed"]) == ("7", {"key": "7"})
    runs = await keyed_runs(db, "keyed")
    assert [(r["key"], r["status"]) for r in runs] == [("7", "succeeded"), ("8", "succeeded")]
    assert overlapping(runs)


async def test_two_keys_whose_lock_keys_collide_take_turns_and_each_runs(
    start_app: Starter, client: Any, db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What cronlock/db/lock.py `lock_text` says of a 64-bit collision, made on purpose: keys 7
    and 8 get one lock text, so one key on the server. 8 answers "already running" while 7 runs
    (never both at once), then runs in its turn; each key's run is its own, once."""
    from cronlock.core import runner as runner_module

    def colliding(schema: str, job: str, key: str | None = None) -> str:
        return lock_text(schema, job, "7" if key in ("7", "8") else key)

    monkeypatch.setattr(runner_module, "lock_text", colliding)  # the lock statement's text
    monkeypatch.setattr(jobs_module, "lock_text", colliding)  # the probe's pg_locks look
    a = await start_app("a")
    first = asyncio.create_task(
        post(client, a.url + "/cron/keyed", json={"customer_id": 7, "seconds": 1})
    )
    await wait_for(lambda: _running(db, "keyed", "7"), 10, "key 7's run")
    turn = await post(client, a.url + "/cron/keyed", json={"customer_id": 8})
    assert turn.json() == {"job": "keyed", "skipped": True, "reason": "already running", "key": "8"}
    assert (await first).json()["processed"] == {"key": "7"}
    mine = await post(client, a.url + "/cron/keyed", json={"customer_id": 8})
    assert mine.json()["processed"] == {"key": "8"}, mine.text
    runs = await keyed_runs(db, "keyed")
    assert [(r["key"], r["status"]) for r in runs] == [("7", "succeeded"), ("8", "succeeded")]


async def _running(db: asyncpg.Connection, job_name: str, key: str) -> bool:
    return bool(
        await db.fetchval(
            "SELECT EXISTS (SELECT 1 FROM cronlock.runs WHERE job = $1 AND key = $2"
            " AND status = 'running')",
            job_name,
            key,
        )
    )


async def test_the_operator_views_show_which_keys_run_where(
    start_instance: Starter, client: Any, db: asyncpg.Connection
) -> None:
    one, two = start_instance("k1"), start_instance("k2")
    tasks = [
        asyncio.create_task(
            post(client, i.url + "/cron/keyed", json={"customer_id": k, "seconds": 3})
        )
        for i, k in ((one, 41), (two, 42))
    ]
    for k in ("41", "42"):
        await wait_for(lambda k=k: _running(db, "keyed", k), 10, f"key {k}'s run")  # type: ignore[misc]

    async def get(path: str) -> Any:
        answer = await client.get(two.url + path, headers=AUTH)
        assert answer.status_code == 200, answer.text
        return answer.json()

    locks = [lk for lk in (await get("/cron/locks"))["locks"] if lk["job"] == "keyed"]
    assert sorted((lk["job_key"], lk["instance"]) for lk in locks) == [("41", "k1"), ("42", "k2")]
    assert all(lk["run_id"] is not None for lk in locks)
    view = next(j for j in (await get("/cron/jobs"))["jobs"] if j["name"] == "keyed")
    assert view["key_field"] == "customer_id"
    assert view["running"] is True
    assert sorted((h["key"], h["instance"]) for h in view["running_keys"]) == [
        ("41", "k1"),
        ("42", "k2"),
    ]
    # The sweep of /cron/jobs (rows whose lock is gone) left the live keyed runs alone.
    page = await get("/cron/runs?job=keyed&key=42")
    assert [(r["key"], r["status"], r["running"]) for r in page["runs"]] == [
        ("42", "running", True)
    ]
    single = await get(f"/cron/runs/{page['runs'][0]['id']}")
    assert (single["key"], single["running"]) == ("42", True)
    for task in tasks:
        assert "processed" in (await task).json()
    assert [r["key"] for r in (await get("/cron/runs?key=41"))["runs"]] == ["41"]
    assert (await get("/cron/runs?job=fast&key=41"))["runs"] == []
    refused = await client.get(two.url + "/cron/runs?key=a%00b", headers=AUTH)
    assert refused.status_code == 422
    assert refused.json()["detail"][0]["loc"] == ["query", "key"]


async def test_a_keyed_run_whose_instance_died_is_closed_as_abandoned(
    start_instance: Starter, client: Any, db: asyncpg.Connection
) -> None:
    """The sweep finds a keyed run's lock by its key: gone -> abandoned; held -> left alone."""
    instance = start_instance("k1")
    task = asyncio.create_task(
        post(client, instance.url + "/cron/keyed", json={"customer_id": 5, "seconds": 30})
    )
    await wait_for(lambda: _running(db, "keyed", "5"), 10, "key 5's run")
    await asyncio.sleep(1.1)  # past the sweep's minimum age
    await client.get(instance.url + "/cron/jobs", headers=AUTH)
    assert await _running(db, "keyed", "5")
    instance.kill()
    task.cancel()
    key = lock_key(lock_text("cronlock", "keyed", "5"), 0)
    await wait_for(lambda: _lock_gone(db, key.classid, key.objid), 10, "the lock to go")
    other = start_instance("k2")
    await client.get(other.url + "/cron/jobs", headers=AUTH)
    status = await db.fetchval("SELECT status FROM cronlock.runs WHERE key = '5'")
    assert status == "abandoned"
    assert await lock_free(db, "keyed")


async def _lock_gone(db: asyncpg.Connection, classid: int, objid: int) -> bool:
    return not await db.fetchval(
        "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND classid = $1"
        " AND objid = $2 AND objsubid = 1)",
        classid,
        objid,
    )


# --- the CLI -------------------------------------------------------------------------------


async def test_the_cli_runs_a_key_and_lists_its_runs(
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from cronlock.cli import main as cli

    monkeypatch.chdir(tmp_path)
    for name in list(os.environ):
        if name.startswith(("CRON_", "DATABASE_", "CRONLOCK_")):
            monkeypatch.delenv(name)
    for name, value in {
        "DATABASE_URL": database_url,
        "CRON_JOBS": "tests.jobs",
        "INSTANCE_NAME": "cli",
        "OUTBOX_ENABLED": "false",
    }.items():
        monkeypatch.setenv(name, value)

    async def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = await asyncio.to_thread(cli.main, list(args))
        out, err = capsys.readouterr()
        return code, out, err

    for customer in (3, 4):
        code, out, err = await run("run", "keyed", "--params", f'{{"customer_id": {customer}}}')
        assert code == 0, err
        assert f"key={customer}" in out.split(), out
    code, out, err = await run("run", "keyed", "--json", "--params", "{}")
    assert code == 2
    assert "customer_id" in err
    code, out, err = await run("runs", "--job", "keyed", "--key", "4", "--json")
    assert code == 0, err
    assert [(r["key"], r["status"]) for r in json.loads(out)["runs"]] == [("4", "succeeded")]
    code, out, err = await run("runs", "--key", "3")
    assert code == 0, err
    assert "keyed [3]" in out
    assert "keyed [4]" not in out
    code, out, err = await run("cancel", "keyed", "--key", "3")
    assert code == 1
    assert "keyed key 3 is not running" in err
