"""Outbox delivery against real PostgreSQL and a real local provider (tests/support/provider.py).

A few tests move a row's `next_attempt_at` to now() instead of sleeping through a backoff:
they check the schedule the sender wrote, then skip the wait.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import random
import resource
import signal
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from cronlock.db import pool as appdb
from cronlock.db.schema import notify_channel
from cronlock.delivery import outbox
from cronlock.delivery import sender as delivery
from cronlock.delivery.mailer import Email, HttpMailer, SendResult, SmtpMailer
from cronlock.demo.digest import DIGEST_SQL, SENDER
from cronlock.errors import DatabaseUnavailable
from cronlock.sql import qualify
from tests.support.delivery import (
    API_KEY,
    MakeSettings,
    counts,
    running,
    sender,
    start_worker,
    stop_workers,
    until,
    worker_env,
)
from tests.support.provider import Provider, Reply
from tests.support.smtp import SlowRelay

# Set-based, like the digest job: the idempotency key comes from the column's default.
QUEUE_SQL = """
INSERT INTO cronlock.email_outbox (job, slot, user_id, sender, recipient, subject, body)
SELECT 'test', '2026-01-01T07:00:00Z', g, 'cronlock <digest@example.com>',
       'user' || g || '@example.com', 'Digest ' || g, 'Hello user ' || g || E',\\nbye.\\n'
FROM generate_series($1::int, $2::int) AS g
"""


async def queue(conn: asyncpg.Connection, count: int, first: int = 1) -> list[str]:
    """Queue `count` emails; returns their keys."""
    await conn.execute(QUEUE_SQL, first, first + count - 1)
    rows = await conn.fetch(
        "SELECT idempotency_key FROM cronlock.email_outbox WHERE user_id BETWEEN $1 AND $2"
        " ORDER BY id",
        first,
        first + count - 1,
    )
    return [r["idempotency_key"] for r in rows]


async def row(conn: asyncpg.Connection, key: str) -> asyncpg.Record:
    found = await conn.fetchrow(
        """SELECT *, extract(epoch FROM next_attempt_at - clock_timestamp())::float8 AS due_in
           FROM cronlock.email_outbox WHERE idempotency_key = $1""",
        key,
    )
    assert found is not None
    return found


async def make_due(conn: asyncpg.Connection) -> None:
    await conn.execute(
        "UPDATE cronlock.email_outbox SET next_attempt_at = now() WHERE status = 'pending'"
    )


# --- enqueue --------------------------------------------------------------------------------


async def test_enqueue_belongs_to_the_callers_transaction(
    db: asyncpg.Connection, database_url: str
) -> None:
    """Rolled back with the job, notified only at commit, once per (job, slot, user)."""
    heard: list[str] = []
    listener = await asyncpg.connect(database_url)
    await listener.add_listener(notify_channel("cronlock"), lambda *a: heard.append(a[2]))
    try:
        email: dict[str, Any] = {
            "job": "digest",
            "slot": None,
            "user_id": 1,
            "recipient": "ada@example.com",
            "subject": "s",
            "body": "b",
            "sender": "cronlock <digest@example.com>",
        }
        tx = db.transaction()
        await tx.start()
        await outbox.enqueue(db, schema="cronlock", **email)
        await tx.rollback()
        assert await db.fetchval("SELECT count(*) FROM cronlock.email_outbox") == 0

        slot = await db.fetchval("SELECT date_trunc('day', now())")
        async with db.transaction():
            await outbox.enqueue(db, schema="cronlock", **{**email, "slot": slot})
            await asyncio.sleep(0.1)
            assert heard == []  # NOTIFY waits for the commit
        await until(lambda: heard, 2, "the notification")
        async with db.transaction():
            await outbox.enqueue(
                db, schema="cronlock", **{**email, "slot": slot}
            )  # the same slot again: no-op
        key = await db.fetchval("SELECT idempotency_key FROM cronlock.email_outbox")
        assert await db.fetchval("SELECT count(*) FROM cronlock.email_outbox") == 1
        assert key == outbox.stable_key("cronlock", "digest", None, slot, "user:1")
    finally:
        await listener.close()


async def test_enqueue_keys_survive_a_rerun_of_the_slot(db: asyncpg.Connection) -> None:
    """The key is derived from (job, key, slot, identity): a run of the same slot whose first
    commit was lost (a failover; here a rollback) queues the same keys again, so a provider
    that honours keys delivers once. Each run's key and each identity gets its own."""
    slot = await db.fetchval("SELECT date_trunc('day', now())")
    email: dict[str, Any] = {
        "job": "invoices",
        "slot": slot,
        "user_id": None,
        "recipient": "ada@example.com",
        "subject": "s",
        "body": "b",
        "sender": "cronlock <billing@example.com>",
    }

    async def run(keys: list[str | None], identities: list[str]) -> list[str | None]:
        queued = []
        for run_key in keys:
            for identity in identities:
                queued.append(
                    await outbox.enqueue(
                        db, schema="cronlock", **email, key=run_key, identity=identity
                    )
                )
        return queued

    tx = db.transaction()
    await tx.start()
    lost = await run(["acme", "globex"], ["invoice:1", "invoice:2"])
    await tx.rollback()  # the commit a failover lost
    async with db.transaction():
        again = await run(["acme", "globex"], ["invoice:1", "invoice:2"])
        # The same email twice in one run is one email.
        assert await run(["acme"], ["invoice:1"]) == [None]
    assert again == lost
    assert len(set(again)) == 4
    assert all(k is not None and k.startswith(f"invoices:{int(slot.timestamp())}:") for k in again)
    rows = await db.fetch("SELECT key, idempotency_key FROM cronlock.email_outbox ORDER BY id")
    assert [r["idempotency_key"] for r in rows] == again
    assert [r["key"] for r in rows] == ["acme", "acme", "globex", "globex"]
    # A keyed job's runs for two keys may each mail the same user in one slot.
    for run_key in ("acme", "globex"):
        assert await outbox.enqueue(db, schema="cronlock", **{**email, "user_id": 7}, key=run_key)
    # One identity to two users is two emails under two keys (the user is among the facts),
    # and the same again for one of them is a no-op.
    welcome = [
        await outbox.enqueue(db, schema="cronlock", **{**email, "user_id": u}, identity="welcome")
        for u in (8, 9, 8)
    ]
    assert welcome[0] is not None
    assert welcome[1] is not None
    assert welcome[0] != welcome[1]
    assert welcome[2] is None
    assert welcome[0] == outbox.stable_key("cronlock", "invoices", None, slot, "welcome", 8)
    # Without a slot nothing names the email: a random key each time.
    first = await outbox.enqueue(db, schema="cronlock", **{**email, "slot": None}, identity="x")
    second = await outbox.enqueue(db, schema="cronlock", **{**email, "slot": None}, identity="x")
    assert first is not None
    assert second is not None
    assert first != second
    assert uuid.UUID(first)


async def test_set_based_inserts_get_distinct_keys(db: asyncpg.Connection) -> None:
    keys = await queue(db, 50)
    assert len(set(keys)) == 50


# --- claim, send, mark ----------------------------------------------------------------------


async def test_drain_delivers_and_marks_sent(
    db: asyncpg.Connection, outbox_settings: MakeSettings, provider: Provider
) -> None:
    keys = await queue(db, 30)
    async with sender(outbox_settings()) as s:
        handled = [await s.drain_once() for _ in range(3)]
    assert handled == [20, 10, 0]
    assert provider.delivered() == Counter(dict.fromkeys(keys, 1))
    rows = await db.fetch("SELECT * FROM cronlock.email_outbox ORDER BY id")
    ids = {r.key: r.message_id for r in provider.requests}
    for r in rows:
        assert r["status"] == "sent"
        assert r["attempts"] == 1
        assert r["provider_message_id"] == ids[r["idempotency_key"]]
        assert r["claim_token"] is None
        assert r["locked_until"] is None
        assert r["sent_at"] is not None


def test_backoff_grows_with_jitter_and_honours_retry_after() -> None:
    rng = random.Random(1)
    for attempt, step in [(1, 2.0), (2, 4.0), (3, 8.0), (4, 16.0), (10, 60.0)]:
        delays = [outbox.backoff_delay(attempt, base=2.0, cap=60.0, rng=rng) for _ in range(200)]
        assert step / 2 <= min(delays) < max(delays) <= step
    assert outbox.backoff_delay(1, base=2.0, cap=60.0, retry_after=30.0) == 30.0
    assert outbox.backoff_delay(5, base=2.0, cap=60.0, retry_after=0.5) >= 16.0


async def test_retry_schedule(
    db: asyncpg.Connection, outbox_settings: MakeSettings, provider: Provider
) -> None:
    """500 and 503 are retried with growing, jittered delays (Retry-After wins when longer);
    every attempt sends the same key and bytes; the fourth one lands."""
    [key] = await queue(db, 1)
    provider.script(key, Reply(500), Reply(503), Reply(503, retry_after="5"))
    expected = [(0.5, 1.0), (1.0, 2.0), (5.0, 5.0)]  # base 1: step/2 .. step; then Retry-After
    async with sender(outbox_settings(outbox_backoff_base=1.0)) as s:
        for attempt, (low, high) in enumerate(expected, start=1):
            assert await s.drain_once() == 1
            r = await row(db, key)
            assert (r["status"], r["attempts"]) == ("pending", attempt)
            assert low - 0.4 <= r["due_in"] <= high  # minus the time since the mark
            assert r["last_error"].startswith(f"HTTP {provider.requests[-1].status}")
            assert r["claim_token"] is None
            assert await s.drain_once() == 0  # not due yet
            await make_due(db)
        assert await s.drain_once() == 1
    r = await row(db, key)
    assert (r["status"], r["attempts"]) == ("sent", 4)
    requests = provider.for_key(key)
    assert [q.status for q in requests] == [500, 503, 503, 200]
    assert len({q.body for q in requests}) == 1


async def test_a_429_is_not_an_attempt_and_pauses_every_sender(
    db: asyncpg.Connection, outbox_settings: MakeSettings, provider: Provider
) -> None:
    """A 429 with Retry-After: the row is given back uncounted (no attempt, no backoff of
    its own, no error) and no sender of any pool claims anything until the Retry-After has
    passed; then it is sent once, its attempts those of the sends that were answered."""
    [key, other] = await queue(db, 2)
    provider.script(key, Reply(429, retry_after="2"))
    settings = outbox_settings(outbox_concurrency=1, outbox_batch_size=1)
    async with sender(settings, "A") as a, sender(settings, "B") as b:
        assert await a.drain_once() == 1
        r = await row(db, key)
        assert (r["status"], r["attempts"], r["claim_token"]) == ("pending", 0, None)
        assert r["last_error"] is None
        assert r["due_in"] <= 0  # due at once: the shared pause is what holds it back
        assert a.stats.throttled == 1
        started = time.monotonic()
        assert await b.drain_once() == 1  # another sender waits for the pause too
        assert time.monotonic() - started >= 1.5
        assert await b.drain_once() == 1
    assert [q.status for q in provider.for_key(key)] == [429, 200]
    assert [q.status for q in provider.for_key(other)] == [200]
    assert [(await row(db, k))["attempts"] for k in (key, other)] == [1, 1]


async def _drain_all_at_once(s: delivery.Sender, provider: Provider, count: int) -> int:
    """drain_once with every answer held back until all `count` requests are in, so the
    outcomes arrive together and share a group write."""
    provider.hold()
    drain = asyncio.create_task(s.drain_once())
    try:
        await until(lambda: provider.in_flight == count, 5, f"{count} requests in flight")
    finally:
        provider.release()
    return await asyncio.wait_for(drain, 10)


async def test_a_bad_answer_cannot_keep_the_others_from_being_recorded(
    db: asyncpg.Connection, outbox_settings: MakeSettings, provider: Provider
) -> None:
    """A provider answer with a NUL in its body (PostgreSQL text cannot hold it) and one with
    `Retry-After: inf`, written together with successful sends: every success is marked sent
    once (before, the whole group write failed until the lease ended, and the sent rows were
    sent again), and the bad ones are retried after a sane, finite delay."""
    keys = await queue(db, 6)
    nul, endless = keys[1], keys[4]
    provider.script(nul, Reply(502, body="<html>bad\x00gateway</html>"))
    provider.script(endless, Reply(503, retry_after="inf"))
    settings = outbox_settings(outbox_concurrency=6, outbox_lease=5.0, outbox_backoff_base=1.0)
    async with sender(settings) as s:
        started = time.monotonic()
        assert await _drain_all_at_once(s, provider, 6) == 6
        assert time.monotonic() - started < 3  # no write retried until the lease ended
        assert Counter(r.key for r in provider.requests) == Counter(dict.fromkeys(keys, 1))
        for key in keys:
            r = await row(db, key)
            assert r["claim_token"] is None
            assert r["attempts"] == 1
            if key in (nul, endless):
                assert r["status"] == "pending"
                assert 0 <= r["due_in"] <= 1.0  # backoff base 1: 0.5 .. 1 s from the mark
            else:
                assert r["status"] == "sent"
        assert (await row(db, nul))["last_error"] == "HTTP 502: <html>badgateway</html>"
        assert (await row(db, endless))["last_error"].startswith("HTTP 503")
        assert (s.stats.sent, s.stats.retried, s.stats.unwritten) == (4, 2, 0)
        await make_due(db)
        assert await s.drain_once() == 2
    assert provider.delivered() == Counter(dict.fromkeys(keys, 1))
    assert await counts(db) == {"sent": 6}


async def test_mark_makes_values_postgresql_would_refuse_writable(
    db: asyncpg.Connection,
) -> None:
    """`mark` itself never sends PostgreSQL a NUL or an interval out of range; a delay past
    the retry window is the end of the window (the row is dead, as it would be anyway)."""
    await queue(db, 5)
    batch = await outbox.claim(db, schema="cronlock", limit=10, lease=60.0)
    ids = [r.id for r in batch.rows]
    outcomes = [
        outbox.Mark("sent", message_id="msg\x00_1"),
        outbox.Mark("retry", delay=1.0, error="HTTP 502: bad\x00gateway"),
        outbox.Mark("retry", delay=math.inf, error="HTTP 429"),
        outbox.Mark("retry", delay=1e13, error="HTTP 429"),
        outbox.Mark("retry", delay=math.nan, error="HTTP 503"),
    ]
    written = await outbox.mark(
        db,
        batch.token,
        list(zip(ids, outcomes, strict=True)),
        schema="cronlock",
        max_attempts=12,
        retry_window=3600,
    )
    assert [written[i] for i in ids] == ["sent", "pending", "dead", "dead", "dead"]
    rows = {r["id"]: r for r in await db.fetch("SELECT * FROM cronlock.email_outbox")}
    assert rows[ids[0]]["provider_message_id"] == "msg_1"
    assert rows[ids[1]]["last_error"] == "HTTP 502: badgateway"
    assert rows[ids[2]]["last_error"] == "HTTP 429 (retry window ended)"


async def test_an_outcome_the_database_refuses_is_left_to_its_lease(
    db: asyncpg.Connection,
    outbox_settings: MakeSettings,
    provider: Provider,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Should the database still refuse one row's outcome (here a CHECK constraint refuses
    its error text), the group is written one row at a time: the others are recorded, and
    the refused row is logged once, loudly, and left to its lease, not written again every
    second until the lease ends."""
    keys = await queue(db, 4)
    poisoned = keys[2]
    await db.execute(
        """ALTER TABLE cronlock.email_outbox ADD CONSTRAINT no_poison
           CHECK (last_error IS NULL OR last_error NOT LIKE '%poison%')"""
    )
    provider.script(poisoned, Reply(500, body="poison"))
    settings = outbox_settings(outbox_concurrency=4, outbox_lease=5.0)
    caplog.set_level(logging.WARNING, logger="cronlock.outbox")
    async with sender(settings) as s:
        started = time.monotonic()
        assert await _drain_all_at_once(s, provider, 4) == 4
        assert time.monotonic() - started < 3
        assert (s.stats.sent, s.stats.unwritten) == (3, 1)
    rows = {r["idempotency_key"]: r for r in await db.fetch("SELECT * FROM cronlock.email_outbox")}
    assert {k: rows[k]["status"] for k in keys} == {
        **dict.fromkeys(keys, "sent"),
        poisoned: "pending",
    }
    assert rows[poisoned]["claim_token"] is not None  # comes back when its lease ends
    refused = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(refused) == 1
    message = refused[0].getMessage()
    assert f"outbox row {rows[poisoned]['id']}: its outcome retry cannot be written" in message
    assert "no_poison" in message
    assert "example.com" not in message  # the server's DETAIL quotes the row: not logged
    assert Counter(r.key for r in provider.requests) == Counter(dict.fromkeys(keys, 1))


class _OddIdMailer:
    """A backend (a third-party one, say) whose message ids are not text."""

    async def send(self, message: Email) -> SendResult:
        return SendResult("sent", message_id=message.recipient.count("1"))  # type: ignore[arg-type]

    async def aclose(self) -> None:
        return None


async def test_an_outcome_that_cannot_be_encoded_is_left_to_its_lease(
    db: asyncpg.Connection, outbox_settings: MakeSettings
) -> None:
    """A backend's answer the outcome write cannot even encode fails that row only: it is
    left to its lease at once (not given back due at once, nor retried until the lease
    ends)."""
    await queue(db, 2)
    settings = outbox_settings(outbox_lease=5.0)
    pool = await appdb.create_pool(settings)
    try:
        s = delivery.Sender(pool, settings, _OddIdMailer(), "odd")
        started = time.monotonic()
        assert await s.drain_once() == 2
        assert time.monotonic() - started < 3
        assert s.stats.unwritten == 2
    finally:
        await pool.close()


class _BrokenRecorder(delivery.Sender):
    """A sender whose outcome write fails with a bug (not a database error)."""

    async def _record(self, token: uuid.UUID, row_id: int, outcome: outbox.Mark) -> str | None:
        raise RuntimeError("a bug in the outcome write")


async def test_a_send_whose_outcome_cannot_be_recorded_is_not_due_again_at_once(
    db: asyncpg.Connection, outbox_settings: MakeSettings, provider: Provider
) -> None:
    """The email went out but recording it failed with something other than a database
    error: the row keeps its claim until the lease ends (its backoff), instead of being given
    back due at once and sent again straight away."""
    [key] = await queue(db, 1)
    settings = outbox_settings(outbox_lease=30.0)
    pool = await appdb.create_pool(settings)
    mailer = HttpMailer(settings.email_api_url, API_KEY, timeout=2.0)
    try:
        s = _BrokenRecorder(pool, settings, mailer, "broken")
        assert await s.drain_once() == 1
        assert await s.drain_once() == 0
        assert s.stats.unwritten == 1
    finally:
        await mailer.aclose()
        await pool.close()
    r = await row(db, key)
    assert (r["status"], r["attempts"]) == ("pending", 1)
    assert r["claim_token"] is not None
    assert r["due_in"] > 25
    assert len(provider.requests) == 1


async def test_permanent_failure_is_dead_at_once(
    db: asyncpg.Connection, outbox_settings: MakeSettings, provider: Provider
) -> None:
    [key, other] = await queue(db, 2)
    provider.script(key, Reply(422, body='{"message": "invalid to"}'))
    async with sender(outbox_settings()) as s:
        assert await s.drain_once() == 2
    r = await row(db, key)
    assert (r["status"], r["attempts"]) == ("dead", 1)
    assert r["last_error"] == 'HTTP 422: {"message": "invalid to"}'
    assert (await row(db, other))["status"] == "sent"
    assert len(provider.for_key(key)) == 1
    stats = await outbox.outbox_stats(db, "cronlock")
    assert (stats["pending"], stats["dead"]) == (0, 1)


async def test_dead_after_max_attempts(
    db: asyncpg.Connection, outbox_settings: MakeSettings, provider: Provider
) -> None:
    [key] = await queue(db, 1)
    provider.script(key, *[Reply(500)] * 5)
    async with sender(outbox_settings(outbox_max_attempts=3)) as s:
        for _ in range(3):
            assert await s.drain_once() == 1
            await make_due(db)
        assert await s.drain_once() == 0
    r = await row(db, key)
    assert (r["status"], r["attempts"]) == ("dead", 3)
    assert r["last_error"].endswith("(gave up after 3 attempts)")
    assert len(provider.for_key(key)) == 3


async def test_dead_when_the_retry_window_ends(
    db: asyncpg.Connection, outbox_settings: MakeSettings, provider: Provider
) -> None:
    """A retry may not fall after the key's window; a key already past it is never sent."""
    [closing, expired] = await queue(db, 2)
    await db.execute(
        """UPDATE cronlock.email_outbox SET key_created_at = now() - CASE idempotency_key
               WHEN $1 THEN interval '59 seconds' ELSE interval '61 seconds' END""",
        closing,
    )
    provider.script(closing, Reply(503))
    async with sender(outbox_settings(outbox_retry_window=60.0, outbox_backoff_base=4.0)) as s:
        assert await s.drain_once() == 2
    r = await row(db, closing)
    assert r["status"] == "dead"
    assert (
        r["last_error"] == 'HTTP 503: {"name": "scripted", "statusCode": 503} (retry window ended)'
    )
    r = await row(db, expired)
    assert r["status"] == "dead"
    assert "retry window ended" in r["last_error"]
    assert provider.for_key(expired) == []


async def test_a_row_that_keeps_killing_its_sender_goes_dead(
    db: asyncpg.Connection, outbox_settings: MakeSettings, provider: Provider
) -> None:
    """Claims count as attempts: a row claimed max_attempts times without an outcome (its
    senders died) is dead-lettered instead of sent again."""
    [key] = await queue(db, 1)
    await db.execute("UPDATE cronlock.email_outbox SET attempts = 3")
    async with sender(outbox_settings(outbox_max_attempts=3)) as s:
        assert await s.drain_once() == 1
    r = await row(db, key)
    assert r["status"] == "dead"
    assert r["last_error"] == "claimed 3 times without an outcome; gave up"
    assert provider.requests == []


async def test_requeue(
    db: asyncpg.Connection, outbox_settings: MakeSettings, provider: Provider
) -> None:
    """Dead rows go back to the queue; a key past the window is replaced, and it says so."""
    [recent, old, untouched] = await queue(db, 3)
    await db.execute(
        """UPDATE cronlock.email_outbox
           SET status = 'dead', attempts = 12, last_error = 'HTTP 500: x',
                  key_created_at = now() - CASE WHEN idempotency_key = $1
                      THEN interval '2 hours' ELSE interval '1 minute' END""",
        old,
    )
    dead = await outbox.dead_rows(db, schema="cronlock", limit=10)
    assert [d.idempotency_key for d in dead] == [recent, old, untouched]
    assert dead[0].last_error == "HTTP 500: x"
    ids = {d.idempotency_key: d.id for d in dead}

    done = await outbox.requeue(db, [ids[recent], ids[old]], schema="cronlock", retry_window=3600.0)
    assert [(r.id, r.previous_key, r.new_key) for r in done] == [
        (ids[recent], recent, False),
        (ids[old], old, True),
    ]
    assert done[0].idempotency_key == recent
    fresh = done[1].idempotency_key
    assert fresh != old
    rows = {
        r["id"]: r
        for r in await db.fetch(
            "SELECT *, now() - key_created_at < interval '10 seconds' AS new"
            " FROM cronlock.email_outbox"
        )
    }
    assert rows[ids[old]]["new"]
    assert not rows[ids[recent]]["new"]
    assert [(rows[i]["status"], rows[i]["attempts"]) for i in (ids[recent], ids[old])] == [
        ("pending", 0),
        ("pending", 0),
    ]
    assert rows[ids[untouched]]["status"] == "dead"
    assert await outbox.requeue(db, [ids[recent]], schema="cronlock") == []  # not dead any more

    async with sender(outbox_settings()) as s:
        assert await s.drain_once() == 2
    assert set(provider.delivered()) == {recent, fresh}
    assert [r.id for r in await outbox.requeue(db, "all", schema="cronlock")] == [ids[untouched]]


async def test_expired_lease_cannot_overwrite_the_new_claim(
    db: asyncpg.Connection, outbox_settings: MakeSettings, provider: Provider
) -> None:
    """Sender A's send outlives its lease; B claims the row; A's answer arrives and its
    mark matches nothing, so B's claim (and then B's outcome) stands."""
    [key] = await queue(db, 1)
    provider.slow(key, 1.2)
    settings = outbox_settings(outbox_lease=0.5, outbox_send_timeout=3.0)
    async with sender(settings, "A") as a:
        slow_send = asyncio.create_task(a.drain_once())
        await until(lambda: provider.in_flight == 1, 2, "A's request")
        await until(
            lambda: db.fetchval("SELECT locked_until < now() FROM cronlock.email_outbox"),
            2,
            "the lease",
        )
        b_claim = await outbox.claim(db, schema="cronlock", limit=10, lease=30.0)
        assert [r.email.idempotency_key for r in b_claim.rows] == [key]
        assert await slow_send == 1  # A got its 200 and tried to mark the row sent
        assert a.stats.lost == 1
        assert a.stats.sent == 0
    r = await row(db, key)
    assert r["claim_token"] == b_claim.token
    assert (r["status"], r["provider_message_id"], r["attempts"]) == ("pending", None, 2)

    written = await outbox.mark(
        db,
        b_claim.token,
        [(r["id"], outbox.Mark("sent", message_id="from-b"))],
        schema="cronlock",
        max_attempts=12,
        retry_window=3600.0,
    )
    assert written == {r["id"]: "sent"}
    assert (await row(db, key))["provider_message_id"] == "from-b"


@pytest.mark.slow  # seconds of timers or loops by design: not in --fast
async def test_a_slow_smtp_relay_gets_no_overlapping_attempts(
    db: asyncpg.Connection, outbox_settings: MakeSettings
) -> None:
    """A tarpit relay (every reply takes 0.4 s, the send timeout is 1 s): each attempt ends at
    its timeout and sends nothing after it, so the next attempt never overlaps a previous one
    that could still deliver (before, the worker thread went on and the relay got copies)."""
    [key] = await queue(db, 1)
    settings = outbox_settings(
        email_backend="smtp",
        outbox_send_timeout=1.0,
        outbox_lease=10.0,
        outbox_backoff_base=0.05,
        outbox_max_attempts=3,
    )
    with SlowRelay(delay=0.4) as relay:
        pool = await appdb.create_pool(settings)
        mailer = SmtpMailer("127.0.0.1", relay.port, timeout=settings.outbox_send_timeout)
        try:
            s = delivery.Sender(pool, settings, mailer, "smtp")
            started = time.monotonic()
            async with running(s):
                await until(
                    lambda: db.fetchval("SELECT status = 'dead' FROM cronlock.email_outbox"),
                    10,
                    "three attempts",
                )
            elapsed = time.monotonic() - started
            await asyncio.sleep(1.0)  # anything still on its way to the relay arrives
        finally:
            await mailer.aclose()
            await pool.close()
        connections = relay.connections
    assert len(connections) == 3
    for earlier, later in itertools.pairwise(connections):
        assert all(at < later.opened for at, _ in earlier.commands), (earlier, later)
    assert relay.delivered() == []
    assert elapsed < 3 * 2.0 + 1.0
    r = await row(db, key)
    assert r["last_error"] == "timed out after 1s (gave up after 3 attempts)"


def test_the_lease_warning_knows_the_backends_real_send_time(
    outbox_settings: MakeSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """SMTP may take its timeout plus a grace: a lease between the two is too short."""
    settings = outbox_settings(email_backend="smtp", outbox_send_timeout=1.0, outbox_lease=1.5)
    caplog.set_level(logging.WARNING, logger="cronlock.outbox")
    mailer = SmtpMailer("127.0.0.1", 25, timeout=settings.outbox_send_timeout)
    s = delivery.Sender(None, settings, mailer)  # type: ignore[arg-type]  # no pool needed
    assert s.max_send_time == 2.0
    [warning] = caplog.records
    assert "OUTBOX_LEASE (1.5s) is not longer than a send may take (2s" in warning.getMessage()


async def test_listener_survives_an_error_that_is_not_an_outage(
    db: asyncpg.Connection,
    outbox_settings: MakeSettings,
    provider: Provider,
    database_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A direct URL the server refuses with an ordinary error (an unknown setting) is logged
    once and retried at the poll cadence; once it works, NOTIFY wakes the sender again."""
    bad = database_url + ("&" if "?" in database_url else "?") + "no_such_setting=1"
    settings = outbox_settings(outbox_poll_interval=0.2, database_direct_url=bad)
    caplog.set_level(logging.WARNING, logger="cronlock.outbox")
    listening = (
        "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN%' "
        "AND pid <> pg_backend_pid()"
    )
    async with sender(settings) as s, running(s):
        await asyncio.sleep(0.8)  # a few attempts
        warnings = [r.getMessage() for r in caplog.records if "listener" in r.getMessage()]
        assert len(warnings) == 1, warnings
        assert warnings[0].startswith("outbox listener cannot connect: 42704: "), warnings
        assert warnings[0].endswith("; polling goes on, retrying"), warnings
        s.settings = settings.model_copy(update={"database_direct_url": database_url})
        await until(lambda: db.fetchval(listening), 3, "the listener")
        s.settings = settings.model_copy(
            update={"database_direct_url": database_url, "outbox_poll_interval": 30.0}
        )
        await asyncio.sleep(0.5)  # the loop is now in a 30 s wait: only NOTIFY wakes it
        async with db.transaction():
            await queue(db, 1)
            await outbox.notify(db, "cronlock")
        await until(lambda: len(provider.requests) == 1, 3, "delivery after NOTIFY")


@pytest.mark.slow  # seconds of timers or loops by design: not in --fast
async def test_rate_limit_is_shared_by_senders(
    db: asyncpg.Connection, outbox_settings: MakeSettings, provider: Provider
) -> None:
    """Two senders on separate pools stay under one budget: 20 in any window (pace.py)."""
    rate, total = 20.0, 60
    await queue(db, total)
    settings = outbox_settings(outbox_rate_limit=rate, outbox_poll_interval=0.05)
    async with sender(settings, "A") as a, sender(settings, "B") as b, running(a), running(b):
        await until(lambda: len(provider.requests) == total, 10, "every email to be delivered")
    times = sorted(r.received for r in provider.requests)
    elapsed = times[-1] - times[0]
    assert elapsed >= (total - rate) / rate * 0.9
    for i, t in enumerate(times):
        # Never more than the burst plus what the rate refilled since the first send.
        assert i + 1 <= rate + rate * (t - times[0]) + 2
    assert a.stats.sent > 0
    assert b.stats.sent > 0
    assert a.stats.sent + b.stats.sent == total


async def test_notify_wakes_an_idle_sender(
    db: asyncpg.Connection, outbox_settings: MakeSettings, provider: Provider
) -> None:
    """With a 30 s poll, only LISTEN/NOTIFY can deliver within a second of the commit."""
    async with sender(outbox_settings(outbox_poll_interval=30.0)) as s, running(s):
        await asyncio.sleep(0.5)  # idle: the first poll found nothing
        async with db.transaction():
            await queue(db, 3)
            await outbox.notify(db, "cronlock")
        took = await until(lambda: len(provider.requests) == 3, 5, "delivery after NOTIFY")
    assert took < 1.5


async def test_listener_comes_back_after_its_connection_is_killed(
    db: asyncpg.Connection, outbox_settings: MakeSettings, provider: Provider
) -> None:
    settings = outbox_settings(outbox_poll_interval=30.0, migrate_retry_interval=0.2)
    listening = (
        "SELECT pid FROM pg_stat_activity WHERE query LIKE 'LISTEN%' AND pid <> pg_backend_pid()"
    )
    async with sender(settings) as s, running(s):
        await until(lambda: db.fetchval(listening), 5, "the listener")
        old = await db.fetchval(listening)
        assert await db.fetchval("SELECT pg_terminate_backend($1)", old)
        await until(lambda: _other_listener(db, listening, old), 5, "a new listener connection")
        await asyncio.sleep(0.3)  # its catch-up poll found nothing
        async with db.transaction():
            await queue(db, 2)
            await outbox.notify(db, "cronlock")
        took = await until(lambda: len(provider.requests) == 2, 5, "delivery after NOTIFY")
    assert took < 1.5


async def _other_listener(db: asyncpg.Connection, sql: str, old: int) -> bool:
    pid = await db.fetchval(sql)
    return pid is not None and pid != old


async def test_graceful_stop_finishes_in_flight_and_gives_back_the_rest(
    db: asyncpg.Connection, outbox_settings: MakeSettings, provider: Provider
) -> None:
    await queue(db, 10)
    provider.delay = 0.4
    settings = outbox_settings(outbox_concurrency=2, outbox_batch_size=10)
    async with sender(settings) as s:
        stop = asyncio.Event()
        task = asyncio.create_task(s.run(stop))
        await until(lambda: provider.in_flight == 2, 2, "two sends in flight")
        stop.set()
        await asyncio.wait_for(task, settings.outbox_shutdown_timeout + 1)
    rows = await db.fetch("SELECT * FROM cronlock.email_outbox ORDER BY id")
    assert Counter(r["status"] for r in rows) == {"sent": 2, "pending": 8}
    for r in rows:
        assert r["claim_token"] is None
        if r["status"] == "pending":
            assert r["attempts"] == 0  # given back unsent: not an attempt
    assert len(provider.requests) == 2


async def test_stop_cuts_off_hung_sends_and_releases_them(
    db: asyncpg.Connection, outbox_settings: MakeSettings, provider: Provider
) -> None:
    """Sends still hanging at the shutdown timeout are cut off and their rows released at once
    (not after the lease); the next sender sends the same key and the provider replays."""
    await queue(db, 4)
    provider.hold()
    settings = outbox_settings(outbox_concurrency=2, outbox_lease=30.0, outbox_shutdown_timeout=0.5)
    async with sender(settings) as s:
        stop = asyncio.Event()
        task = asyncio.create_task(s.run(stop))
        await until(lambda: provider.in_flight == 2, 2, "two sends in flight")
        stop.set()
        await asyncio.wait_for(task, 2)
    rows = await db.fetch("SELECT *, next_attempt_at <= now() AS due FROM cronlock.email_outbox")
    assert all(r["status"] == "pending" and r["due"] and r["claim_token"] is None for r in rows)
    assert sorted(r["attempts"] for r in rows) == [0, 0, 1, 1]
    provider.release()
    await until(lambda: provider.in_flight == 0, 2, "the held answers")
    async with sender(settings) as s:
        assert await s.drain_once() == 4
    assert await counts(db) == {"sent": 4}
    assert max(provider.delivered().values()) == 1


async def test_a_claim_that_never_answers_gives_up_after_the_query_timeout(
    db: asyncpg.Connection, outbox_settings: MakeSettings, provider: Provider
) -> None:
    """A claim that does not come back (here it queues behind a lock; as often a frozen
    pooler) fails after DB_QUERY_TIMEOUT instead of stalling delivery; once the database
    answers, everything is delivered once. The abandoned claim may still run on the server
    when the lock goes: its rows come back after their lease."""
    keys = await queue(db, 5)
    settings = outbox_settings(db_query_timeout=1.0, outbox_lease=2.0, outbox_send_timeout=1.0)
    async with sender(settings) as s:
        async with db.transaction():
            await db.execute("LOCK TABLE cronlock.email_outbox IN ACCESS EXCLUSIVE MODE")
            started = time.monotonic()
            with pytest.raises(DatabaseUnavailable, match="no answer from the database within 1 s"):
                await s.drain_once()
            assert time.monotonic() - started < 3
        async with running(s):
            await until(lambda: len(provider.delivered()) == 5, 10, "every email")
    assert provider.delivered() == Counter(dict.fromkeys(keys, 1))
    assert await counts(db) == {"sent": 5}


async def test_prune_deletes_only_old_sent_rows(db: asyncpg.Connection) -> None:
    await queue(db, 6)
    await db.execute(
        """UPDATE cronlock.email_outbox SET status = 'sent', sent_at = now() - interval '8 days'
           WHERE user_id <= 3"""
    )
    await db.execute(
        "UPDATE cronlock.email_outbox SET status = 'sent', sent_at = now() - interval '6 days' "
        "WHERE user_id = 4"
    )
    await db.execute("UPDATE cronlock.email_outbox SET status = 'dead' WHERE user_id = 5")
    assert await outbox.prune_sent(db, 7.0, schema="cronlock", chunk=2) == 3
    left = await db.fetch("SELECT user_id FROM cronlock.email_outbox ORDER BY user_id")
    assert [r["user_id"] for r in left] == [4, 5, 6]


@pytest.mark.slow  # seconds of timers or loops by design: not in --fast
async def test_prune_is_bounded_and_runs_one_at_a_time(
    db: asyncpg.Connection, outbox_settings: MakeSettings
) -> None:
    """While the table is locked (as a database that stops answering), each prune gives up
    after DB_QUERY_TIMEOUT, a new one never starts while one still runs, and stopping the
    sender does not wait for the prune."""
    timeout = 0.5
    settings = outbox_settings(db_query_timeout=timeout, outbox_shutdown_timeout=1.0)
    pool = await appdb.create_pool(settings)
    mailer = HttpMailer(settings.email_api_url, API_KEY, timeout=1.0)
    s = delivery.Sender(pool, settings, mailer, prune_interval=0.05)
    started: dict[asyncio.Task[None], float] = {}
    ended: dict[asyncio.Task[None], float] = {}
    most_at_once = 0
    try:
        stop = asyncio.Event()
        task = asyncio.create_task(s.run(stop))
        async with db.transaction():
            await db.execute("LOCK TABLE cronlock.email_outbox IN ACCESS EXCLUSIVE MODE")
            end = time.monotonic() + 2.0
            while time.monotonic() < end:
                now = time.monotonic()
                if s._prune_task is not None and s._prune_task not in started:
                    started[s._prune_task] = now
                for t in started:
                    if t.done() and t not in ended:
                        ended[t] = now
                most_at_once = max(most_at_once, sum(not t.done() for t in started))
                await asyncio.sleep(0.01)
            stopping = time.monotonic()
            stop.set()
            await asyncio.wait_for(task, 5)
            stopped_in = time.monotonic() - stopping
    finally:
        await mailer.aclose()
        await pool.close()
    assert len(ended) >= 2  # prunes came and went while the lock was held
    assert most_at_once == 1
    assert max(ended[t] - started[t] for t in ended) < timeout + 0.5
    assert stopped_in < settings.outbox_shutdown_timeout + 0.5
    assert all(t.done() for t in started)


async def test_an_early_digest_run_stamps_its_slot(db: asyncpg.Connection) -> None:
    """A trigger that comes a little before its slot (within the early tolerance) stamps the
    users with the slot, not the earlier now(): they are not due for that slot any more, and a
    forced rerun of the slot finds nobody instead of failing on the unique key."""
    await db.execute(
        "INSERT INTO cronlock_demo.users (email) VALUES ('a@example.com'), ('b@example.com')"
    )
    slot = await db.fetchval("SELECT date_trunc('second', now()) + interval '3 seconds'")
    assert await db.fetchval(qualify(DIGEST_SQL, "cronlock"), slot, "daily-digest", SENDER) == 2
    stamps = await db.fetch("SELECT last_digest_at FROM cronlock_demo.users")
    assert all(r["last_digest_at"] == slot for r in stamps)
    assert (
        await db.fetchval(qualify(DIGEST_SQL, "cronlock"), slot, "daily-digest", SENDER) == 0
    )  # forced rerun
    assert await db.fetchval("SELECT count(*) FROM cronlock.email_outbox") == 2
    later = await db.fetchval("SELECT $1::timestamptz + interval '1 day'", slot)
    assert (
        await db.fetchval(qualify(DIGEST_SQL, "cronlock"), later, "daily-digest", SENDER) == 2
    )  # next slot


async def test_stats_use_the_database_clock(db: asyncpg.Connection) -> None:
    assert await outbox.outbox_stats(db, "cronlock") == {
        "pending": 0,
        "due": 0,
        "oldest_pending_seconds": 0.0,
        "dead": 0,
    }
    await queue(db, 3)
    await db.execute("UPDATE cronlock.email_outbox SET created_at = now() - interval '90 seconds'")
    await db.execute("UPDATE cronlock.email_outbox SET status = 'dead' WHERE user_id = 1")
    await db.execute(
        "UPDATE cronlock.email_outbox SET next_attempt_at = now() + interval '1 hour'"
        " WHERE user_id = 2"
    )
    stats = await outbox.outbox_stats(db, "cronlock")
    assert (stats["pending"], stats["due"], stats["dead"]) == (2, 1, 1)
    assert 90 <= stats["oldest_pending_seconds"] < 100


# --- several OS processes -------------------------------------------------------------------


@pytest.mark.slow
async def test_ten_thousand_emails_three_processes(
    db: asyncpg.Connection, database_url: str, provider: Provider, tmp_path: Path
) -> None:
    """Three sender processes share 10,000 emails: each key is requested and delivered
    exactly once, and nothing is left behind."""
    total = 10_000
    keys = await queue(db, total)
    env = worker_env(
        database_url,
        provider,
        outbox_batch_size=200,
        outbox_concurrency=8,
        outbox_lease=60,
    )
    # A load test: coverage (the other outbox tests measure this code) would trace 10,000
    # sends and take half the time the senders have.
    env.pop("COVERAGE_PROCESS_CONFIG", None)
    log = tmp_path / "workers.log"
    workers = [start_worker(env, log) for _ in range(3)]
    try:
        await until(
            lambda: db.fetchval(
                "SELECT count(*) = $1 FROM cronlock.email_outbox WHERE status = 'sent'", total
            ),
            150,
            "all 10,000 to be sent",
            every=0.5,  # counting 10,000 rows is not free: leave the CPU to the senders
        )
    finally:
        codes = stop_workers(workers, log)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"\nworkers' CPU: {usage.ru_utime + usage.ru_stime:.1f} s for {total} emails")
    assert codes == [0, 0, 0]  # SIGTERM is a clean stop
    requests = Counter(r.key for r in provider.requests)
    assert len(requests) == total
    assert set(requests) == set(keys)
    assert max(requests.values()) == 1  # never sent twice: no key even reached the provider twice
    assert provider.delivered() == Counter(dict.fromkeys(keys, 1))
    assert await counts(db) == {"sent": total}
    mismatched = await db.fetchval(
        """SELECT count(*) FROM cronlock.email_outbox o
           JOIN unnest($1::text[], $2::text[]) AS p(key, id) ON p.key = o.idempotency_key
           WHERE o.provider_message_id IS DISTINCT FROM p.id""",
        [r.key for r in provider.requests],
        [r.message_id for r in provider.requests],
    )
    assert mismatched == 0
    senders = await db.fetchval("SELECT count(DISTINCT attempts) FROM cronlock.email_outbox")
    assert senders == 1  # every row went out on its first claim


@pytest.mark.slow
async def test_drain_process_with_once_exits_when_nothing_is_due(
    db: asyncpg.Connection, database_url: str, provider: Provider, tmp_path: Path
) -> None:
    keys = await queue(db, 25)
    log = tmp_path / "worker.log"
    env = worker_env(database_url, provider, outbox_batch_size=10)
    done = start_worker(env, log, "--once")
    await until(lambda: done.poll() is not None, 60, "the --once worker to exit")
    assert done.returncode == 0, log.read_text()
    assert provider.delivered() == Counter(dict.fromkeys(keys, 1))
    assert await counts(db) == {"sent": 25}


@pytest.mark.slow
async def test_drain_once_stops_at_sigterm(
    db: asyncpg.Connection, database_url: str, provider: Provider, tmp_path: Path
) -> None:
    """`drain --once` told to stop sends what is in flight and claims nothing more; the rest
    of the batch in hand is given back unsent, due at once."""
    await queue(db, 10)
    provider.delay = 0.5
    log = tmp_path / "worker.log"
    env = worker_env(
        database_url, provider, outbox_batch_size=10, outbox_concurrency=1, outbox_lease=30
    )
    worker = start_worker(env, log, "--once")
    try:
        await until(lambda: provider.in_flight == 1, 30, "the first send")
        worker.send_signal(signal.SIGTERM)
        stopping = time.monotonic()
        await until(lambda: worker.poll() is not None, 5, "the worker to exit")
        stopped_in = time.monotonic() - stopping
    finally:
        stop_workers([worker], log)
    assert worker.returncode == 0, log.read_text()
    assert stopped_in < 3.0  # the send in flight (0.5 s), not the batch (10 x 0.5 s)
    assert len(provider.requests) == 1
    rows = await db.fetch("SELECT *, next_attempt_at <= now() AS due FROM cronlock.email_outbox")
    assert Counter(r["status"] for r in rows) == {"sent": 1, "pending": 9}
    for r in rows:
        assert r["claim_token"] is None
        if r["status"] == "pending":
            assert r["due"]
            assert r["attempts"] == 0


@pytest.mark.slow
async def test_sender_killed_mid_batch(
    db: asyncpg.Connection, database_url: str, provider: Provider, tmp_path: Path
) -> None:
    """`kill -9` a sender while its requests are in flight: after the lease the rest are
    delivered by other senders, and the only repeats are requests with the same key and the
    same bytes, which the provider answers without delivering again."""
    total = 400
    keys = await queue(db, total)
    lease = 2.0
    env = worker_env(
        database_url,
        provider,
        outbox_batch_size=50,
        outbox_concurrency=8,
        outbox_lease=lease,
        outbox_send_timeout=1.0,
    )
    log = tmp_path / "workers.log"
    victim = start_worker(env, log)
    workers = [victim]
    try:
        await until(lambda: provider.received() >= 60, 20, "the victim to be sending")
        provider.hold()  # its next requests are accepted, but no answer comes back
        await until(lambda: provider.in_flight == 8, 5, "8 requests in flight")
        in_flight = provider.accepted_keys() - {r.key for r in provider.requests}
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(5)
        killed_at = time.monotonic()
        provider.release()
        claimed = await db.fetchval(
            "SELECT count(*) FROM cronlock.email_outbox"
            " WHERE status = 'pending' AND claim_token IS NOT NULL"
        )
        assert claimed >= len(in_flight)  # the victim's batch is stranded until its lease ends

        workers += [start_worker(env, log) for _ in range(2)]
        await until(
            lambda: db.fetchval(
                "SELECT count(*) = $1 FROM cronlock.email_outbox WHERE status = 'sent'", total
            ),
            30,
            "every email to be sent",
        )
        assert time.monotonic() - killed_at >= lease * 0.9
    finally:
        codes = stop_workers(workers, log)
    assert codes == [-signal.SIGKILL, 0, 0]

    delivered = provider.delivered()
    assert delivered == Counter(dict.fromkeys(keys, 1))  # each email delivered exactly once
    by_key: dict[str, list[Any]] = {}
    for r in provider.requests:
        assert r.key is not None
        by_key.setdefault(r.key, []).append(r)
    repeated = {k: rs for k, rs in by_key.items() if len(rs) > 1}
    # The requests the victim never heard back from were sent again (and perhaps a few it had
    # its answer for but had not recorded yet): the same key with the same bytes each time.
    assert in_flight <= set(repeated)
    for k, rs in repeated.items():
        assert len({r.body for r in rs}) == 1, f"{k}: a repeat with different bytes"
        assert len({r.message_id for r in rs if r.status == 200}) == 1
        assert sum(r.delivered for r in rs) == 1
    example = next(iter(repeated.values()))
    print(
        f"\n{len(repeated)} keys were requested twice after the kill, each with identical "
        f"bytes, delivered once; e.g. {example[0].key}: "
        + ", ".join(f"{r.status} delivered={r.delivered}" for r in example)
        + f"\n  body {example[0].body!r}"
    )
