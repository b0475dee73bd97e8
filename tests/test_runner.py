"""Exactly once across several real instances (OS processes) sharing one database.

The module's tests share one database and one trio of instances, started once; each test
begins with an empty ledger, no effects, no users and no emails."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from typing import Any

import asyncpg
import httpx
import pytest

from tests.support.asgi import StartApp
from tests.support.cluster import Instance
from tests.support.faults import reset
from tests.support.instances import Instances
from tests.util import effects, lock_free, lock_held, post, runs, wait_for

Starter = Callable[..., Any]


@pytest.fixture
def database_url(module_database_url: str) -> str:
    """The module's database, which its trio of instances serves."""
    return module_database_url


@pytest.fixture(scope="module")
def module_trio(
    module_database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Instance]]:
    trio = Instances(module_database_url, tmp_path_factory.mktemp("trio"))
    try:
        yield trio.start_many(["i1", "i2", "i3"])
    finally:
        trio.stop()


@pytest.fixture
def trio(
    module_trio: list[Instance], report_logs: Callable[[Iterable[Instance]], None]
) -> list[Instance]:
    report_logs(module_trio)
    return module_trio


@pytest.fixture(autouse=True)
async def _fresh(db: asyncpg.Connection) -> None:
    await reset(db)
    await db.execute("TRUNCATE cronlock_demo.users, cronlock.email_outbox RESTART IDENTITY")


async def test_concurrent_triggers_over_three_instances_run_once(
    trio: list[Any], client: Any, db: asyncpg.Connection
) -> None:
    urls = [trio[n % 3].url + "/cron/slow" for n in range(50)]
    answers = await asyncio.gather(*(post(client, u, json={"seconds": 1.5}) for u in urls))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    bodies = [a.json() for a in answers]
    ran = [b for b in bodies if "processed" in b]
    skipped = [b for b in bodies if b.get("skipped")]
    assert len(ran) == 1
    assert len(skipped) == 49
    assert {b["reason"] for b in skipped} == {"already running"}
    assert await effects(db, "slow") == 1
    assert [r["status"] for r in await runs(db, "slow")] == ["succeeded"]


async def test_once_per_slot_across_retries_and_instances(
    trio: list[Any], client: Any, db: asyncpg.Connection
) -> None:
    slot = datetime(datetime.now(UTC).year, 1, 1, tzinfo=UTC)
    answers = []
    for _ in range(3):
        answers += await asyncio.gather(*(post(client, i.url + "/cron/yearly") for i in trio))
    bodies = [a.json() for a in answers]
    assert all(a.status_code == 200 for a in answers)
    ran = [b for b in bodies if "processed" in b]
    assert len(ran) == 1
    assert ran[0]["slot"] == slot.isoformat()
    # Once the first round is over, every answer is "already done".
    assert [b["reason"] for b in bodies[3:]] == ["already done"] * 6
    assert all(b["slot"] == slot.isoformat() for b in bodies if b.get("reason") == "already done")
    assert await effects(db, "yearly") == 1


async def test_force_runs_again_as_manual_and_does_not_count(
    trio: list[Any], client: Any, db: asyncpg.Connection
) -> None:
    url = trio[0].url + "/cron/yearly"
    assert "processed" in (await post(client, url)).json()
    forced = (await post(client, url + "?force=true")).json()
    assert forced["processed"] == 1
    assert (await post(client, trio[1].url + "/cron/yearly")).json()["reason"] == "already done"
    rows = await runs(db, "yearly")
    assert [(r["trigger"], r["status"]) for r in rows] == [
        ("scheduled", "succeeded"),
        ("manual", "succeeded"),
    ]
    assert rows[0]["slot"] == rows[1]["slot"]
    assert await effects(db, "yearly") == 2


async def test_max_lateness_skips_too_late(trio: list[Any], client: Any) -> None:
    r = await post(client, trio[0].url + "/cron/late-minutely")
    assert r.status_code == 200
    assert r.json()["skipped"] is True
    assert r.json()["reason"] == "too late"


async def test_unscheduled_job_is_protected_against_overlap_only(
    trio: list[Any], client: Any, db: asyncpg.Connection
) -> None:
    for instance in trio:
        assert (await post(client, instance.url + "/cron/fast")).json()["processed"] == 1
    assert await effects(db, "fast") == 3


async def test_killed_holder_frees_the_lock(
    start_instance: Starter, client: Any, db: asyncpg.Connection
) -> None:
    victim, other = start_instance("victim"), start_instance("other")
    running = asyncio.create_task(post(client, victim.url + "/cron/slow-sql", json={"seconds": 30}))
    await wait_for(lambda: lock_held(db, "slow-sql"), 10, "the victim to take the lock")
    victim.kill()
    freed = await wait_for(lambda: lock_free(db, "slow-sql"), 10, "the lock to free")
    with pytest.raises(httpx.HTTPError):
        await running
    r = await post(client, other.url + "/cron/slow-sql", json={"seconds": 0})
    assert r.json()["processed"] == 1, r.text
    # The victim's effect rolled back with its transaction: one effect, the survivor's.
    assert await effects(db, "slow-sql") == 1
    assert freed < 5


async def test_frozen_holder_loses_the_lock_and_commits_nothing(
    start_instance: Starter, client: Any, db: asyncpg.Connection
) -> None:
    env = {"DB_TIMEOUT_MARGIN": "0.5"}  # `held` has timeout 2: the database gives up at 2.5 s
    frozen, other = start_instance("frozen", env), start_instance("other", env)
    pending = asyncio.create_task(post(client, frozen.url + "/cron/held", json={"seconds": 4}))
    await wait_for(lambda: lock_held(db, "held"), 10, "the lock to be taken")
    frozen.freeze()
    started = time.monotonic()
    try:
        await wait_for(lambda: lock_free(db, "held"), 10, "the database to free the lock")
        freed_after = time.monotonic() - started
        r = await post(client, other.url + "/cron/held", json={"seconds": 0})
        assert r.json()["processed"] == 1, r.text
    finally:
        frozen.thaw()
    answer = await pending
    assert answer.status_code in (500, 503, 504), answer.text
    assert await effects(db, "held") == 1
    statuses = [r["status"] for r in await runs(db, "held")]
    assert sorted(statuses) == ["succeeded", "timed_out"] or sorted(statuses) == [
        "failed",
        "succeeded",
    ]
    assert freed_after < 2.5 + 3


async def test_digest_one_outbox_row_per_user_per_slot(
    start_instances: Callable[..., list[Instance]], client: Any, db: asyncpg.Connection
) -> None:
    trio = start_instances(["d0", "d1", "d2"], {"CRON_JOBS": "cronlock.demo.digest"})
    await db.execute(
        """INSERT INTO cronlock_demo.users (email, digest_enabled)
           SELECT 'u' || g || '@example.com', g % 10 <> 0 FROM generate_series(1, 500) g"""
    )
    answers = []
    for _ in range(4):
        answers += await asyncio.gather(
            *(post(client, i.url + "/cron/daily-digest") for i in trio for _ in range(3))
        )
    assert all(a.status_code == 200 for a in answers)
    processed = [a.json()["processed"] for a in answers if "processed" in a.json()]
    assert processed == [450]
    per_user = await db.fetch(
        "SELECT user_id, count(*) AS n FROM cronlock.email_outbox GROUP BY user_id"
    )
    assert len(per_user) == 450
    assert {r["n"] for r in per_user} == {1}
    disabled = await db.fetchval(
        """SELECT count(*) FROM cronlock.email_outbox o
           JOIN cronlock_demo.users u ON u.id = o.user_id
           WHERE NOT u.digest_enabled"""
    )
    assert disabled == 0
    stamped = await db.fetchval(
        "SELECT count(*) FROM cronlock_demo.users WHERE last_digest_at IS NOT NULL"
    )
    assert stamped == 450


async def test_digest_refuses_a_second_email_for_a_slot_loudly(
    start_app: StartApp, client: Any, db: asyncpg.Connection
) -> None:
    """A user whose last digest was moved back by hand is due again, but already has this
    slot's email: the unique index fails the whole run, which commits nothing."""
    i = await start_app("d", cron_jobs="cronlock.demo.digest")
    await db.execute(
        "INSERT INTO cronlock_demo.users (email)"
        " SELECT 'u' || g || '@example.com' FROM generate_series(1, 5) g"
    )
    first = await post(client, i.url + "/cron/daily-digest")
    assert first.json()["processed"] == 5
    stamps = await db.fetch("SELECT id, last_digest_at FROM cronlock_demo.users ORDER BY id")
    await db.execute(
        "UPDATE cronlock_demo.users SET last_digest_at = NULL WHERE id = $1", stamps[0]["id"]
    )
    await db.execute("INSERT INTO cronlock_demo.users (email) VALUES ('new@example.com')")
    again = await post(client, i.url + "/cron/daily-digest?force=true")
    assert again.status_code == 500
    assert again.json()["error"] == "job failed"
    assert await db.fetchval("SELECT count(*) FROM cronlock.email_outbox") == 5
    # Nothing of the failed run stuck: the newcomer is still due, the others keep their stamp.
    after = await db.fetch("SELECT id, last_digest_at FROM cronlock_demo.users ORDER BY id")
    assert [r["last_digest_at"] for r in after[1:5]] == [r["last_digest_at"] for r in stamps[1:]]
    assert after[0]["last_digest_at"] is None
    assert after[5]["last_digest_at"] is None
    [failed] = [r for r in await runs(db, "daily-digest") if r["status"] == "failed"]
    assert failed["error"].startswith("UniqueViolationError: duplicate key value"), failed
