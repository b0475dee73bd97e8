"""`overdue` alerts of dynamic jobs (cronlock/delivery/alerts.py `_raise_dynamic`): one per job
and episode, naming how many keys are late and the most overdue ones, raised once across
instances, and `overdue_resolved` once the keys ran."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import asyncpg
import pytest

from cronlock import Cronlock
from cronlock.delivery.alerts import WORST_KEYS, verify
from cronlock.settings import Settings
from tests.support.asgi import StartApp
from tests.support.receiver import Receiver
from tests.test_alerts import SECRET
from tests.test_schedules import EFFECTS_SQL

JOBS = "tests.dynamic_jobs"
LATE = 25


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    r.up()
    try:
        yield r
    finally:
        r.close()


@pytest.fixture
def cron(make_settings: Callable[..., Settings]) -> Cronlock:
    return Cronlock(make_settings(cron_jobs=JOBS), housekeeping=False)


def hooks(receiver: Receiver) -> list[dict[str, Any]]:
    found = []
    for r in receiver.requests():
        if r.path == "/hook":
            assert verify(SECRET, r.headers, r.body), r.headers
            found.append(json.loads(r.body))
    return found


def kinds(receiver: Receiver) -> Counter[str]:
    return Counter(h["type"] for h in hooks(receiver))


async def test_overdue_keys_one_alert_per_episode_then_resolved(
    start_app: StartApp, cron: Cronlock, receiver: Receiver, db: asyncpg.Connection
) -> None:
    """25 keys due two hours ago (grace 300 s) and 5 on time, no dispatcher: two instances
    raise one `overdue` for the job, counting 25 and naming the 10 most overdue; a paused key
    is not counted. A dispatcher then runs them: one `overdue_resolved`, nothing more. A key
    late again opens a new episode."""
    await db.execute(EFFECTS_SQL)
    for key in range(LATE + 5):
        await cron.schedules.set(db, "user-digest", f"u{key:02}", every=3600)
    await cron.schedules.set(db, "user-digest", "paused", every=3600, paused=True)
    # Key u<i> due 2 h + i minutes ago: as if no dispatcher had run since.
    await db.execute(
        "UPDATE cronlock.schedules SET next_at = now() - interval '2 hours'"
        " - make_interval(mins => substr(key, 2)::int), due_at = now() - interval '2 hours'"
        " - make_interval(mins => substr(key, 2)::int)"
        " WHERE job = 'user-digest' AND substr(key, 2)::int < $1 AND key <> 'paused'",
        LATE,
    )
    await db.execute(
        "UPDATE cronlock.schedules SET next_at = now() - interval '1 day',"
        " due_at = now() - interval '1 day' WHERE key = 'paused'"
    )
    settings = {
        "cron_jobs": JOBS,
        "alert_webhook_url": receiver.url + "/hook",
        "alert_webhook_secret": SECRET,
        "alert_poll_interval": 0.2,
    }
    await start_app("a", **settings)
    await start_app("b", **settings)

    def overdue(r: Receiver) -> bool:
        return kinds(r)["cronlock.overdue"] >= 1

    await asyncio.to_thread(receiver.wait, overdue, 15, "the overdue alert")
    await asyncio.sleep(1.0)  # more looks by both instances raise nothing new
    assert kinds(receiver) == Counter({"cronlock.overdue": 1})
    data = hooks(receiver)[0]["data"]
    assert data["job"] == "user-digest"
    assert data["keys_overdue"] == LATE
    assert data["grace"] == 300.0
    expected = [f"u{i:02}" for i in range(LATE - 1, LATE - 1 - WORST_KEYS, -1)]
    assert [w["key"] for w in data["worst"]] == expected
    assert set(data["worst"][0]) == {"key", "slot", "due_at"}

    await start_app("c", **settings, scheduler_enabled=True, scheduler_poll_interval=0.2)

    def resolved(r: Receiver) -> bool:
        return kinds(r)["cronlock.overdue_resolved"] >= 1

    await asyncio.to_thread(receiver.wait, resolved, 20, "the overdue_resolved alert")
    await asyncio.sleep(1.0)
    assert kinds(receiver) == Counter({"cronlock.overdue": 1, "cronlock.overdue_resolved": 1})
    ran = await db.fetchval(
        "SELECT count(DISTINCT key) FROM cronlock.runs WHERE job = 'user-digest'"
    )
    assert ran == LATE
    closing = hooks(receiver)[1]["data"]
    assert closing["job"] == "user-digest"
    assert closing["overdue_since"]

    # A new episode is a new alert: a key late again, claimed by a dispatcher that went away
    # (so that the running one leaves it alone for now).
    await db.execute(
        "UPDATE cronlock.schedules SET next_at = now() - interval '1 hour',"
        " due_at = now() - interval '1 hour', claimed_until = now() + interval '1 hour',"
        " claimed_by = 'gone' WHERE key = 'u00'"
    )

    def again(r: Receiver) -> bool:
        return kinds(r)["cronlock.overdue"] >= 2

    await asyncio.to_thread(receiver.wait, again, 15, "the second episode's alert")
    second = hooks(receiver)[2]["data"]
    assert (second["keys_overdue"], [w["key"] for w in second["worst"]]) == (1, ["u00"])
