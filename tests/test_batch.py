"""Batched delivery (EMAIL_BATCH_SIZE > 1) against real PostgreSQL and the provider stand-in's
`POST /emails/batch` (tests/support/provider.py, which follows Resend's documented semantics).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from cronlock.delivery import outbox
from cronlock.delivery.mailer import Email as Message
from cronlock.delivery.mailer import HttpMailer, batch_bytes, classify_batch, classify_response
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

# The subject names the slot: the provider counts accepted emails per (recipient, subject).
SLOT_SUBJECT = "Digest 2026-01-01"
QUEUE_SQL = """
INSERT INTO cronlock.email_outbox (job, slot, user_id, sender, recipient, subject, body)
SELECT 'test', '2026-01-01T07:00:00Z', g, 'cronlock <digest@example.com>',
       CASE WHEN g = ANY($3::int[]) THEN 'not an address ' || g
            ELSE 'user' || g || '@example.com' END,
       $4, 'Hello user ' || g
FROM generate_series($1::int, $2::int) AS g
"""


async def queue(
    conn: asyncpg.Connection, count: int, *, first: int = 1, bad: tuple[int, ...] = ()
) -> list[str]:
    """Queue `count` emails (users in `bad` get a malformed address); returns recipients."""
    await conn.execute(QUEUE_SQL, first, first + count - 1, list(bad), SLOT_SUBJECT)
    return [
        f"not an address {g}" if g in bad else f"user{g}@example.com"
        for g in range(first, first + count)
    ]


def each_once(provider: Provider, recipients: list[str]) -> bool:
    return provider.emails() == Counter({(r, SLOT_SUBJECT): 1 for r in recipients})


# --- the provider stand-in ------------------------------------------------------------------


def _post(provider: Provider, body: bytes, key: str, mode: str | None = None) -> httpx.Response:
    headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
    if mode:
        headers["x-batch-validation"] = mode
    return httpx.post(f"{provider.url}/emails/batch", content=body, headers=headers)


def _body(*recipients: str) -> bytes:
    return json.dumps(
        [{"from": "a@example.com", "to": r, "subject": "s"} for r in recipients]
    ).encode()


def test_provider_batch_keys_and_validation_modes() -> None:
    """Same key and body: the same answer, nothing sent again; same key, other body: 409
    invalid_idempotent_request; strict refuses a whole batch for one bad email, permissive
    sends the rest and reports the bad one by index."""
    with Provider() as provider:
        first = _post(provider, _body("a@x.io", "b@x.io"), "k1")
        again = _post(provider, _body("a@x.io", "b@x.io"), "k1")
        assert first.status_code == again.status_code == 200
        assert first.json() == again.json()
        assert len(first.json()["data"]) == 2
        other = _post(provider, _body("c@x.io"), "k1")
        assert other.status_code == 409
        assert other.json()["name"] == "invalid_idempotent_request"
        assert classify_response(other).status == "failed"  # permanent: never retried

        strict = _post(provider, _body("d@x.io", "nope"), "k2")
        assert strict.status_code == 422
        permissive = _post(provider, _body("d@x.io", "nope", "e@x.io"), "k3", "permissive")
        assert permissive.status_code == 200
        assert permissive.json()["errors"][0]["index"] == 1
        result = classify_batch(permissive, 3)
        assert [m.status for m in result.members] == ["sent", "failed", "sent"]
        assert result.members[2].message_id == permissive.json()["data"][1]["id"]
        assert provider.emails() == Counter(
            {("a@x.io", "s"): 1, ("b@x.io", "s"): 1, ("d@x.io", "s"): 1, ("e@x.io", "s"): 1}
        )


def test_provider_rate_limit_answers_429_with_retry_after() -> None:
    with Provider(rate=2.0) as provider:
        answers = [_post(provider, _body("a@x.io"), f"r{i}") for i in range(4)]
        assert [a.status_code for a in answers][:2] == [200, 200]
        assert 429 in [a.status_code for a in answers[2:]]
        limited = next(a for a in answers if a.status_code == 429)
        assert float(limited.headers["retry-after"]) >= 1


def test_a_concurrent_duplicate_is_retried() -> None:
    response = httpx.Response(409, json={"name": "concurrent_idempotent_requests"})
    assert classify_response(response).status == "retry"


def test_batch_bytes_and_key_depend_only_on_members() -> None:
    emails = [Message(f"k{i}", "a@x.io", f"u{i}@x.io", "s", "b") for i in range(3)]
    assert batch_bytes(emails) == batch_bytes(list(emails))
    assert outbox.batch_key(["k0", "k1"]) == outbox.batch_key(["k0", "k1"])
    assert outbox.batch_key(["k0", "k1"]) != outbox.batch_key(["k0", "k2"])


# --- in-process senders ---------------------------------------------------------------------


async def test_one_malformed_address_is_dead_alone(
    db: asyncpg.Connection, outbox_settings: MakeSettings, provider: Provider
) -> None:
    """A batch of 100 with one bad address: that one is dead-lettered on its own (with its
    batch shown by `dead_rows`), the other 99 are delivered once, in one request."""
    recipients = await queue(db, 100, bad=(37,))
    settings = outbox_settings(email_batch_size=100, outbox_batch_size=100)
    async with sender(settings) as s, running(s):
        await until(
            lambda: db.fetchval(
                "SELECT count(*) = 100 FROM cronlock.email_outbox WHERE status <> 'pending'"
            ),
            20,
            "the batch to be answered",
        )
    assert await counts(db) == {"sent": 99, "dead": 1}
    assert len(provider.batch_requests()) == 1
    assert each_once(provider, [r for r in recipients if r != "not an address 37"])
    [dead] = await outbox.dead_rows(db, schema="cronlock")
    assert dead.recipient == "not an address 37"
    assert dead.batch_key is not None
    assert dead.batch_key.startswith("batch-")
    assert "refused in its batch" in (dead.last_error or "")
    ids = await db.fetch(
        "SELECT provider_message_id FROM cronlock.email_outbox WHERE status = 'sent'"
    )
    assert len({r["provider_message_id"] for r in ids}) == 99  # each its own id

    # Re-queued, it leaves its (done) batch and is sent alone under its own key: the batch's
    # other members were delivered, and it was never sent under its own key.
    [requeued] = await outbox.requeue(db, [dead.id], schema="cronlock")
    assert requeued.batch_id is None
    assert await db.fetchval(
        "SELECT batch_id IS NULL FROM cronlock.email_outbox WHERE id = $1", requeued.id
    )


async def test_a_retried_batch_sends_the_same_bytes_under_the_same_key(
    db: asyncpg.Connection, outbox_settings: MakeSettings, provider: Provider
) -> None:
    """A 500, a 429 with Retry-After and a concurrent-duplicate 409: each attempt repeats
    the frozen batch exactly, and the emails are accepted once."""
    recipients = await queue(db, 30)
    provider.script(
        None,
        Reply(500),
        Reply(429, retry_after="0"),
        Reply(409, body=json.dumps({"name": "concurrent_idempotent_requests"})),
    )
    settings = outbox_settings(email_batch_size=30, outbox_batch_size=30)
    async with sender(settings) as s, running(s):
        await until(
            lambda: db.fetchval(
                "SELECT count(*) = 30 FROM cronlock.email_outbox WHERE status = 'sent'"
            ),
            30,
            "the batch to be sent",
        )
    requests = provider.batch_requests()
    assert [r.status for r in requests] == [500, 429, 409, 200]
    assert len({r.key for r in requests}) == 1
    assert len({r.body for r in requests}) == 1
    assert each_once(provider, recipients)
    batch = await db.fetchrow("SELECT * FROM cronlock.email_batch")
    assert batch is not None
    assert batch["status"] == "done"
    assert batch["attempts"] == 3  # the 429 is not an attempt
    assert bytes(batch["body"]) == requests[0].body


async def test_an_invalid_idempotent_request_is_dead_not_looped(
    db: asyncpg.Connection, outbox_settings: MakeSettings, provider: Provider
) -> None:
    await queue(db, 5)
    body = json.dumps({"name": "invalid_idempotent_request"})
    provider.script(None, Reply(409, body=body))
    settings = outbox_settings(email_batch_size=10)
    async with sender(settings) as s, running(s):
        await until(
            lambda: db.fetchval(
                "SELECT count(*) = 5 FROM cronlock.email_outbox WHERE status = 'dead'"
            ),
            20,
            "the batch to be dead",
        )
    assert len(provider.batch_requests()) == 1


# --- fencing, requeue and changing EMAIL_BATCH_SIZE --------------------------------------

# A single-row sender's claim as the code before batches had it (a rolling deploy's older
# instances): every due pending row, whatever batch_id says.
OLD_CLAIM_SQL = """
UPDATE cronlock.email_outbox SET claim_token = gen_random_uuid(), attempts = attempts + 1
WHERE id IN (SELECT id FROM cronlock.email_outbox
             WHERE status = 'pending' AND next_attempt_at <= now() FOR UPDATE SKIP LOCKED)
RETURNING id
"""


async def _members(db: asyncpg.Connection) -> list[asyncpg.Record]:
    return await db.fetch(
        "SELECT id, recipient, status, batch_id, claim_token FROM cronlock.email_outbox ORDER BY id"
    )


async def test_requeue_reopens_a_dead_batch_and_each_email_is_delivered_once(
    db: asyncpg.Connection, outbox_settings: MakeSettings, provider: Provider
) -> None:
    """A batch times out until dead, but the provider did create its emails. `requeue --all`
    re-opens that batch (same key, bytes and key age) with all its members, and an email
    queued meanwhile is formed into a batch of its own: each email is delivered once (before,
    the re-queued rows joined a new batch under a new key and were delivered again)."""
    first = await queue(db, 2)
    provider.script(None, Reply(200, delay=1.0))  # created, but the answer comes too late
    settings = outbox_settings(
        email_batch_size=10, outbox_max_attempts=1, outbox_send_timeout=0.3, outbox_lease=5.0
    )
    async with sender(settings) as s:
        assert await s.drain_once() == 2
        assert await counts(db) == {"dead": 2}
        await until(lambda: provider.in_flight == 0, 5, "the provider's late answer")
        [dead_batch] = await db.fetch("SELECT * FROM cronlock.email_batch")
        assert dead_batch["status"] == "dead"
        later = await queue(db, 1, first=3)
        dead = await outbox.dead_rows(db, schema="cronlock")
        # Naming one member brings the other back with it, in the same batch.
        requeued = await outbox.requeue(db, [dead[0].id], schema="cronlock")
        assert [(r.id, r.batch_id, r.new_key) for r in requeued] == [
            (d.id, dead_batch["id"], False) for d in dead
        ]
        assert await s.drain_once() == 3
    assert await counts(db) == {"sent": 3}
    assert each_once(provider, first + later)
    reopened = await db.fetchrow(
        "SELECT * FROM cronlock.email_batch WHERE id = $1", dead_batch["id"]
    )
    assert reopened is not None
    assert (reopened["status"], reopened["attempts"]) == ("done", 1)
    assert reopened["key_created_at"] == dead_batch["key_created_at"]
    keys = [r.key for r in provider.batch_requests()]
    assert keys.count(dead_batch["idempotency_key"]) == 2  # sent again, under the same key
    assert len(keys) == 3


async def test_requeue_of_a_dead_batch_past_the_window_gives_its_members_fresh_keys(
    db: asyncpg.Connection, outbox_settings: MakeSettings, provider: Provider
) -> None:
    """A dead batch whose key is older than the retry window: its members leave it with
    fresh keys (and say so), and are each delivered once, alone."""
    recipients = await queue(db, 2)
    [batch] = await outbox.form_batches(db, schema="cronlock", batches=1, size=10, lease=5.0)
    marked = await outbox.mark_batch(
        db,
        batch,
        outbox.BatchMark("dead", error="x"),
        schema="cronlock",
        max_attempts=5,
        retry_window=3600.0,
    )
    assert marked is not None
    assert marked.status == "dead"
    await db.execute("UPDATE cronlock.email_batch SET key_created_at = now() - interval '2 hours'")
    requeued = await outbox.requeue(db, "all", schema="cronlock", retry_window=3600.0)
    assert [(r.new_key, r.batch_id) for r in requeued] == [(True, None), (True, None)]
    assert all(r.idempotency_key != r.previous_key for r in requeued)
    async with sender(outbox_settings(email_batch_size=10)) as s:
        assert await s.drain_once() == 2
    assert each_once(provider, recipients)
    assert provider.batch_requests() == []  # sent alone: re-queued rows are never re-batched
    assert set(provider.delivered()) == {r.idempotency_key for r in requeued}


async def test_a_row_already_attempted_alone_is_never_formed_into_a_batch(
    db: asyncpg.Connection, outbox_settings: MakeSettings, provider: Provider
) -> None:
    """A row a single-row sender claimed (its send may have gone through) whose lease ran out:
    a batch sender sends it alone under its own key, and the stale sender's mark writes
    nothing (before, the row joined a batch under another key, and the stale mark could
    still make it dead inside that batch)."""
    recipients = await queue(db, 3)
    stale = await outbox.claim(db, schema="cronlock", limit=1, lease=0.1)
    [retried] = stale.rows
    await asyncio.sleep(0.2)
    async with sender(outbox_settings(email_batch_size=10)) as s:
        assert await s.drain_once() == 3
    written = await outbox.mark(
        db,
        stale.token,
        [(retried.id, outbox.Mark("dead", error="stale"))],
        schema="cronlock",
        max_attempts=12,
        retry_window=3600.0,
    )
    assert written == {}
    assert await counts(db) == {"sent": 3}
    assert each_once(provider, recipients)
    [request] = provider.batch_requests()
    assert request.emails == 2
    assert provider.delivered()[retried.email.idempotency_key] == 1  # alone, its own key
    rows = {r["id"]: r for r in await _members(db)}
    assert rows[retried.id]["batch_id"] is None


async def test_batch_members_are_never_due_to_single_row_senders(
    db: asyncpg.Connection,
) -> None:
    """While their batch is pending, members hold no claim and are never due: an older
    single-row sender (no batch_id filter) cannot take them, neither when the batch's lease
    ran out nor while it waits out a retry; `due` in the stats follows the batch."""
    await queue(db, 2)
    [batch] = await outbox.form_batches(db, schema="cronlock", batches=1, size=10, lease=0.2)
    assert all(r["claim_token"] is None for r in await _members(db))
    await asyncio.sleep(0.3)
    assert await db.fetch(OLD_CLAIM_SQL) == []
    assert (await outbox.outbox_stats(db, "cronlock"))["due"] == 2  # the batch is due
    [again] = await outbox.claim_batches(db, schema="cronlock", limit=5, lease=5.0)
    assert (await outbox.outbox_stats(db, "cronlock"))["due"] == 0
    marked = await outbox.mark_batch(
        db,
        again,
        outbox.BatchMark("retry", delay=60.0, error="HTTP 500"),
        schema="cronlock",
        max_attempts=5,
        retry_window=3600.0,
    )
    assert marked is not None
    assert marked.status == "pending"
    assert await db.fetch(OLD_CLAIM_SQL) == []
    stats = await outbox.outbox_stats(db, "cronlock")
    assert (stats["pending"], stats["due"]) == (2, 0)
    assert batch.id == again.id


async def test_a_stale_mark_batch_after_a_takeover_writes_nothing(
    db: asyncpg.Connection,
) -> None:
    await queue(db, 2)
    [old] = await outbox.form_batches(db, schema="cronlock", batches=1, size=10, lease=0.1)
    await asyncio.sleep(0.2)
    [new] = await outbox.claim_batches(db, schema="cronlock", limit=5, lease=5.0)
    assert (new.id, new.key, new.body) == (old.id, old.key, old.body)
    assert new.token != old.token
    sent = outbox.BatchMark("done", members=(outbox.Mark("sent", message_id="m"),) * 2)
    options: dict[str, Any] = {"schema": "cronlock", "max_attempts": 5, "retry_window": 3600.0}
    assert await outbox.mark_batch(db, old, sent, **options) is None
    assert await outbox.mark_batch(db, old, outbox.BatchMark("dead"), **options) is None
    assert await counts(db) == {"pending": 2}
    marked = await outbox.mark_batch(db, new, sent, **options)
    assert marked is not None
    assert marked.status == "done"
    assert await counts(db) == {"sent": 2}


async def test_batch_size_one_still_delivers_batches_formed_earlier(
    db: asyncpg.Connection, outbox_settings: MakeSettings, provider: Provider
) -> None:
    """EMAIL_BATCH_SIZE back to 1: a batch formed before (its lease ended) is still claimed and
    sent under its key, and rows never batched go one per request."""
    first = await queue(db, 3)
    [batch] = await outbox.form_batches(db, schema="cronlock", batches=1, size=10, lease=0.1)
    later = await queue(db, 2, first=4)
    await asyncio.sleep(0.2)
    async with sender(outbox_settings(email_batch_size=1)) as s:
        assert await s.drain_once() == 5
    assert await counts(db) == {"sent": 5}
    assert each_once(provider, first + later)
    assert [r.key for r in provider.batch_requests()] == [batch.key]
    assert len(provider.requests) == 3


@pytest.mark.slow  # starts processes (an outbox worker): not in --fast
async def test_drain_once_waits_for_a_batch_in_backoff(
    db: asyncpg.Connection, database_url: str, provider: Provider, tmp_path: Path
) -> None:
    """`drain --once` (here with EMAIL_BATCH_SIZE=1) does not exit while a batch nobody holds
    is due within OUTBOX_BACKOFF_MAX: it waits, then delivers it."""
    recipients = await queue(db, 2)
    [batch] = await outbox.form_batches(db, schema="cronlock", batches=1, size=10, lease=5.0)
    marked = await outbox.mark_batch(
        db,
        batch,
        outbox.BatchMark("retry", delay=1.5, error="HTTP 500"),
        schema="cronlock",
        max_attempts=5,
        retry_window=3600.0,
    )
    assert marked is not None
    assert marked.status == "pending"
    log = tmp_path / "worker.log"
    env = worker_env(database_url, provider, email_batch_size=1, outbox_backoff_max=5)
    worker = start_worker(env, log, "--once")
    try:
        await until(lambda: worker.poll() is not None, 30, "the --once worker to exit")
    finally:
        stop_workers([worker], log)
    assert worker.returncode == 0, log.read_text()
    assert await counts(db) == {"sent": 2}
    assert each_once(provider, recipients)


async def test_a_failed_formation_gives_back_the_batches_claimed_before_it(
    db: asyncpg.Connection, outbox_settings: MakeSettings
) -> None:
    """Batches due again are claimed, then forming new ones fails (here a trigger refuses the
    insert): the claimed batches are released at once, not counted as an attempt and left
    to their lease."""
    await queue(db, 2)
    [batch] = await outbox.form_batches(db, schema="cronlock", batches=1, size=10, lease=0.1)
    await asyncio.sleep(0.2)
    await queue(db, 2, first=3)
    await db.execute(
        """CREATE FUNCTION cronlock.refuse() RETURNS trigger LANGUAGE plpgsql
           AS $$ BEGIN RAISE EXCEPTION 'no new batches'; END $$;
           CREATE TRIGGER refuse BEFORE INSERT ON cronlock.email_batch
           FOR EACH ROW EXECUTE FUNCTION cronlock.refuse()"""
    )
    async with sender(outbox_settings(email_batch_size=10, outbox_batch_size=20)) as s:
        with pytest.raises(asyncpg.RaiseError, match="no new batches"):
            await s.drain_once()
        assert s._held == 0
    row = await db.fetchrow(
        "SELECT *, next_attempt_at <= now() AS due FROM cronlock.email_batch WHERE id = $1",
        batch.id,
    )
    assert row is not None
    assert (row["claim_token"], row["attempts"], row["due"]) == (None, 1, True)


# --- several OS processes -------------------------------------------------------------------

# The figures at the provider's request limit (2 and 5 requests/s, batches of 100, a sender
# killed): tests/test_pacing.py, against a provider enforcing a strict one-second window.


@pytest.mark.slow  # starts processes (outbox workers, one killed): not in --fast
async def test_sender_killed_mid_batch_each_email_once(
    db: asyncpg.Connection, database_url: str, tmp_path: Path
) -> None:
    """kill -9 a sender while its batches are at the provider: after the lease another
    sender sends those batches again, the same members, bytes and key, and the provider
    answers without sending; each email is accepted once."""
    total = 1000
    recipients = await queue(db, total)
    lease = 2.0
    with Provider() as provider:
        env = worker_env(
            database_url,
            provider,
            email_batch_size=50,
            outbox_batch_size=100,
            outbox_concurrency=2,
            outbox_lease=lease,
            outbox_send_timeout=1.0,
        )
        log = tmp_path / "workers.log"
        victim = start_worker(env, log)
        workers = [victim]
        try:
            await until(lambda: provider.received() >= 3, 20, "the victim to be sending")
            provider.hold()
            await until(lambda: provider.in_flight >= 1, 5, "a batch in flight")
            os.kill(victim.pid, signal.SIGKILL)
            victim.wait(5)
            killed_at = time.monotonic()
            provider.release()
            workers += [start_worker(env, log) for _ in range(2)]
            await until(
                lambda: db.fetchval(
                    "SELECT count(*) = $1 FROM cronlock.email_outbox WHERE status = 'sent'", total
                ),
                40,
                "every email to be sent",
            )
            assert time.monotonic() - killed_at >= lease * 0.9
        finally:
            codes = stop_workers(workers, log)
    assert codes == [-signal.SIGKILL, 0, 0]
    assert each_once(provider, recipients)
    by_key: dict[str | None, list[Any]] = {}
    for r in provider.batch_requests():
        by_key.setdefault(r.key, []).append(r)
    repeated = {k: rs for k, rs in by_key.items() if len(rs) > 1}
    assert repeated  # the victim's batches in flight were sent again
    for rs in repeated.values():
        assert len({r.body for r in rs}) == 1  # the same bytes every time
        assert sum(r.emails for r in rs) == len(json.loads(rs[0].body))  # sent once
    assert (
        await db.fetchval("SELECT count(*) FROM cronlock.email_batch WHERE status <> 'done'") == 0
    )


async def test_http_mailer_sends_permissive_batches(provider: Provider) -> None:
    mailer = HttpMailer(provider.url, API_KEY, timeout=2.0)
    try:
        emails = [Message(f"k{i}", "a@x.io", f"u{i}@x.io", "s", "b") for i in range(2)]
        result = await mailer.send_batch("bk", batch_bytes(emails), 2)
    finally:
        await mailer.aclose()
    assert result.request.status == "sent"
    assert [m.status for m in result.members] == ["sent", "sent"]
    [request] = provider.requests
    assert request.headers["x-batch-validation"] == "permissive"
    assert request.headers["idempotency-key"] == "bk"
    await asyncio.sleep(0)
