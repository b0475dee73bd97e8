"""Alerts (cronlock/delivery/alerts.py): Standard Webhooks signatures, the events, once per (job,
slot) across instances, and the proof with real processes: the receiver down for a while and an
instance killed mid-send, every alert arrives, each id accepted once."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import asyncpg
import pytest

from cronlock.core.jobs import load
from cronlock.db.pool import connect
from cronlock.delivery.alerts import raise_events, sign, verify, webhook_key
from cronlock.settings import Settings, SettingsError
from tests.lease_jobs import LEASE_SETTINGS, create_effects
from tests.support.asgi import StartApp
from tests.support.cluster import Instance
from tests.support.receiver import Receiver
from tests.util import post, seen_since, wait_for

SECRET = "whsec_" + base64.b64encode(b"k" * 32).decode()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    r.up()
    try:
        yield r
    finally:
        r.close()


def alert_settings(receiver: Receiver) -> dict[str, Any]:
    return {
        "cron_jobs": "tests.own_jobs",
        "alert_webhook_url": receiver.url + "/hook",
        "alert_webhook_secret": SECRET,
        "alert_ping_url": receiver.url + "/ping/{job}",
        "alert_poll_interval": 0.2,
        "alert_backoff_base": 0.2,
        "alert_backoff_max": 1.0,
        "retry_poll_interval": 0.2,
    }


def test_signature_is_the_standard_webhooks_one() -> None:
    """The test vector of the Standard Webhooks reference libraries."""
    key = webhook_key("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    signature = sign(key, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, b'{"test": 2432232314}')
    assert signature == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def test_verify_checks_signature_and_window() -> None:
    body, now = b'{"a":1}', int(time.time())
    good = {
        "webhook-id": "m1",
        "webhook-timestamp": str(now),
        "webhook-signature": "v1,bogus " + sign(webhook_key(SECRET), "m1", now, body),
    }
    assert verify(SECRET, good, body)
    assert not verify(SECRET, good, body + b" ")
    assert not verify(SECRET, {**good, "webhook-id": "m2"}, body)
    old = now - 600
    stale = {**good, "webhook-timestamp": str(old)}
    stale["webhook-signature"] = sign(webhook_key(SECRET), "m1", old, body)
    assert not verify(SECRET, stale, body)  # outside the 5-minute replay window
    with pytest.raises(SettingsError):
        webhook_key("whsec_short")


def events(receiver: Receiver) -> Counter[str]:
    return Counter(json.loads(r.body)["type"] for r in receiver.requests() if r.path == "/hook")


async def test_events_once_each_across_instances(
    start_app: StartApp, client: Any, receiver: Receiver
) -> None:
    """Two instances raise from the same ledger: failed twice then recovered (flaky), overdue
    once per (job, slot), paused too long once per pause; pings start/fail/success; every
    webhook verifies."""
    settings = alert_settings(receiver) | {"alert_paused_too_long": 0.5}
    a = await start_app("a", **settings)
    await start_app("b", **settings)
    assert (await post(client, a.url + "/cron/flaky")).status_code == 500
    await post(client, a.url + "/cron/jobs/tick/pause")

    def all_in(r: Receiver) -> bool:
        found = events(r)
        return (
            found["cronlock.failed"] >= 2
            and found["cronlock.recovered"] >= 1
            and found["cronlock.paused_too_long"] >= 1
            and found["cronlock.overdue"] >= 1
        )

    await asyncio.to_thread(receiver.wait, all_in, 20, "the alerts")
    await asyncio.sleep(1.0)  # a second look by both instances raises nothing new
    found = events(receiver)
    assert found["cronlock.failed"] == 2
    assert found["cronlock.recovered"] == 1
    assert found["cronlock.paused_too_long"] == 1
    overdue = [
        json.loads(r.body)["data"]
        for r in receiver.requests()
        if r.path == "/hook" and json.loads(r.body)["type"] == "cronlock.overdue"
    ]
    assert Counter((d["job"], d["slot"]) for d in overdue).most_common(1)[0][1] == 1
    assert all(receiver.deliveries[i] == 1 for i in receiver.accepted)
    for r in receiver.requests():
        if r.path == "/hook":
            assert verify(SECRET, r.headers, r.body), r.headers
    failed = [json.loads(r.body)["data"] for r in receiver.requests() if r.path == "/hook"]
    first = next(d for d in failed if d.get("attempt") == 1 and d["job"] == "flaky")
    assert set(first) >= {"job", "key", "run_id", "slot", "outcome", "error", "instance", "attempt"}
    pings = Counter(r.path for r in receiver.requests() if r.path.startswith("/ping/flaky"))
    assert pings == {"/ping/flaky/start": 3, "/ping/flaky/fail": 2, "/ping/flaky": 1}


async def test_receiver_down_then_up_and_a_sender_killed_mid_send(
    start_instances: Callable[..., list[Instance]],
    receiver: Receiver,
    client: Any,
    db: asyncpg.Connection,
) -> None:
    """Real processes: alerts raised while the receiver refuses connections wait in the
    queue; a sender killed with SIGKILL while its request is in flight leaves its claim to
    expire and the other instance sends again with the same webhook-id; every alert arrives,
    each id accepted once, every signature verifies."""
    env = {k.upper(): str(v) for k, v in alert_settings(receiver).items()} | {
        "ALERT_LEASE": "1.5",
        "OUTBOX_ENABLED": "false",
    }
    receiver.down()
    i1, i2 = start_instances(["i1", "i2"], env=env)
    assert (await post(client, i1.url + "/cron/always-fails")).status_code == 500

    async def three_failures() -> bool:
        n = await db.fetchval(
            "SELECT count(*) FROM cronlock.alerts WHERE event = 'failed' AND attempts > 0"
        )
        return bool(n == 3)

    await wait_for(three_failures, 15, "three failed alerts, tried against a receiver that is down")
    receiver.hold()
    receiver.up()
    await asyncio.to_thread(receiver.wait, lambda r: bool(r.accepted), 15, "a first delivery")

    async def claimed_by() -> str | None:
        by: str | None = await db.fetchval(
            "SELECT claimed_by FROM cronlock.alerts WHERE status = 'pending'"
            " AND claimed_until > now() AND kind = 'webhook' LIMIT 1"
        )
        return by

    sender = await claimed_by()
    assert sender in ("i1", "i2")
    victim, survivor = (i1, i2) if sender == "i1" else (i2, i1)
    victim.kill()  # its requests are in flight, held by the receiver
    receiver.release()

    async def all_sent() -> bool:
        left = await db.fetchval(
            "SELECT count(*) FROM cronlock.alerts WHERE status <> 'sent' AND kind = 'webhook'"
        )
        return bool(left == 0)

    await wait_for(all_sent, 20, f"every webhook sent by {survivor.name}")
    ids = {
        r["msg_id"]
        for r in await db.fetch("SELECT msg_id FROM cronlock.alerts WHERE kind = 'webhook'")
    }
    assert ids == receiver.accepted
    assert sum(receiver.deliveries.values()) > len(ids)  # the killed sender's were sent again
    for r in receiver.requests():
        if "webhook-id" in r.headers:
            assert verify(SECRET, r.headers, r.body)
    # Pings past their job's grace were given up (a late ping lies): only the every=1 jobs'
    # (grace 1 s, run by catch-up at start-up while the receiver was down); the others came.
    dead = await db.fetch("SELECT job FROM cronlock.alerts WHERE status = 'dead'")
    assert {r["job"] for r in dead} <= {"tick", "tick-latest", "heartbeat"}
    pings = Counter(r.path for r in receiver.requests() if r.path.startswith("/ping/always"))
    assert pings["/ping/always-fails/fail"] >= 3


async def test_timed_out_and_lease_lost_are_raised_once_each(
    start_app: StartApp, client: Any, receiver: Receiver, db: asyncpg.Connection
) -> None:
    """The two events the test above does not reach: a run ended by its timeout, and a lease
    attempt closed by its takeover (its holder alive and unaware, the lease run out under it,
    as after a long pause)."""
    await create_effects(db)
    settings = alert_settings(receiver) | LEASE_SETTINGS
    settings |= {"cron_jobs": "tests.jobs,tests.lease_jobs", "lease_poll_interval": 600}
    a = await start_app("a", **settings)
    b = await start_app("b", **settings)
    timed_out = await post(client, a.url + "/cron/times-out", json={"seconds": 5})
    assert timed_out.status_code == 504, timed_out.text

    started = await post(
        client, a.url + "/cron/lease-items", json={"n": 12, "batch": 2, "pause": 0.3}
    )
    assert started.status_code == 202, started.text
    first = started.json()["run_id"]

    async def a_step_done() -> bool:
        return bool(await db.fetchval("SELECT count(*) FROM lease_effects") >= 2)

    await wait_for(a_step_done, 10, "a first step")
    await db.execute(
        "UPDATE cronlock.runs SET lease_expires_at = now() - interval '1 second' WHERE id = $1",
        first,
    )
    for _ in range(40):  # "already running" while the old holder has the row for a moment
        taken = await post(client, b.url + "/cron/lease-items", json={"n": 1})
        if taken.status_code == 202:
            break
        assert taken.json()["reason"] == "already running", taken.text
        await asyncio.sleep(0.05)
    assert taken.status_code == 202, taken.text

    def both_in(r: Receiver) -> bool:
        found = events(r)
        return found["cronlock.timed_out"] >= 1 and found["cronlock.lease_lost"] >= 1

    await asyncio.to_thread(receiver.wait, both_in, 20, "timed_out and lease_lost")
    await asyncio.sleep(1.0)  # a second look by both instances raises nothing new
    found = events(receiver)
    assert (found["cronlock.timed_out"], found["cronlock.lease_lost"]) == (1, 1)
    # Once each in the queue too, whatever either instance looks at later (its id is the
    # event and the run).
    queued = await db.fetch(
        "SELECT msg_id FROM cronlock.alerts WHERE event IN ('timed_out', 'lease_lost')"
    )
    timed_out_id = timed_out.json()["run_id"]
    assert sorted(r["msg_id"] for r in queued) == [
        f"lease_lost:{first}",
        f"timed_out:{timed_out_id}",
    ]
    data = {
        json.loads(r.body)["type"]: json.loads(r.body)["data"]
        for r in receiver.requests()
        if r.path == "/hook"
    }
    assert (data["cronlock.timed_out"]["job"], data["cronlock.timed_out"]["outcome"]) == (
        "times-out",
        "timed_out",
    )
    lost = data["cronlock.lease_lost"]
    assert (lost["job"], lost["run_id"], lost["outcome"]) == ("lease-items", first, "abandoned")
    assert f"taken over by run {taken.json()['run_id']}" in lost["error"]
    for r in receiver.requests():
        if r.path == "/hook":
            assert verify(SECRET, r.headers, r.body), r.headers


async def test_overdue_is_raised_only_for_slots_after_the_job_was_first_seen(
    make_settings: Callable[..., Settings], db: asyncpg.Connection
) -> None:
    """A job never seen, or seen after its due slot (a fresh install), raises no `overdue`;
    the same job first seen long ago does, once for that slot."""
    settings = make_settings(
        cron_jobs="tests.own_jobs",
        alert_webhook_url="http://127.0.0.1:9/hook",
        alert_webhook_secret=SECRET,
    )
    registry = load(settings.job_modules)
    conn = await connect(settings)  # with the pool's codecs: the alert's body is jsonb

    async def overdue() -> list[str]:
        now: datetime = await conn.fetchval("SELECT now()")
        await raise_events(conn, registry, settings, now)
        rows = await db.fetch("SELECT msg_id FROM cronlock.alerts WHERE event = 'overdue'")
        return sorted(r["msg_id"] for r in rows if ":hourly-late:" in r["msg_id"])

    try:
        assert await overdue() == []  # never seen
        await db.execute("INSERT INTO cronlock.jobs_seen (job) VALUES ('hourly-late')")
        assert await overdue() == []  # seen now: its due slot was before
        await seen_since(db, "hourly-late")
        [raised] = await overdue()
        assert raised.startswith("overdue:hourly-late:")
        assert await overdue() == [raised]  # once per slot
    finally:
        await conn.close()
