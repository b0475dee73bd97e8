"""The delivery backends against real local servers: the provider stand-in and aiosmtpd."""

from __future__ import annotations

import asyncio
import email
import email.policy
import logging
import socket
import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import AuthResult

from cronlock.delivery.mailer import (
    Email,
    HttpMailer,
    LogMailer,
    SmtpMailer,
    classify_batch,
    create_mailer,
    error_text,
    max_send_time,
    message_id,
    parse_retry_after,
    payload_bytes,
)
from cronlock.settings import Settings, SettingsError
from tests.support.delivery import API_KEY
from tests.support.provider import Provider, Reply
from tests.support.smtp import SlowRelay


def an_email(key: str = "key-1", recipient: str = "ada@example.com") -> Email:
    return Email(
        idempotency_key=key,
        sender="cronlock <digest@example.com>",
        recipient=recipient,
        subject="Your digest ✓",
        body="Hello Ada,\n\nnothing happened.\n",
        created_at=datetime(2026, 1, 2, 7, 0, tzinfo=UTC),
    )


# --- http -----------------------------------------------------------------------------------


async def test_http_sends_a_resend_request(provider: Provider) -> None:
    """POST /emails with the bearer key, the idempotency key and the frozen JSON body."""
    mailer = HttpMailer(provider.url, API_KEY, timeout=2)
    try:
        result = await mailer.send(an_email())
    finally:
        await mailer.aclose()
    [request] = provider.requests
    assert result.status == "sent"
    assert result.message_id == request.message_id
    assert (request.method, request.path) == ("POST", "/emails")
    assert request.headers["authorization"] == f"Bearer {API_KEY}"
    assert request.headers["idempotency-key"] == "key-1"
    assert request.headers["content-type"] == "application/json"
    assert request.body == payload_bytes(an_email())
    assert request.json() == {
        "from": "cronlock <digest@example.com>",
        "to": "ada@example.com",
        "subject": "Your digest ✓",
        "text": "Hello Ada,\n\nnothing happened.\n",
    }


async def test_http_every_attempt_sends_the_same_bytes(provider: Provider) -> None:
    provider.script("key-1", Reply(500), Reply(429, retry_after="3"))
    mailer = HttpMailer(provider.url, API_KEY, timeout=2)
    try:
        results = [await mailer.send(an_email()) for _ in range(4)]
    finally:
        await mailer.aclose()
    assert [r.status for r in results] == ["retry", "retry", "sent", "sent"]
    requests = provider.for_key("key-1")
    assert len({r.body for r in requests}) == 1
    # The fourth is a replay: the provider answers with the first delivery's id.
    assert results[2].message_id == results[3].message_id
    assert sum(r.delivered for r in requests) == 1


@pytest.mark.parametrize(
    ("reply", "status", "retry_after"),
    [
        (Reply(500), "retry", None),
        (Reply(503, retry_after="2"), "retry", 2.0),
        (Reply(429, retry_after="7"), "retry", 7.0),
        (Reply(409), "retry", None),
        (Reply(408), "retry", None),
        (Reply(400), "failed", None),
        (Reply(401), "retry", None),  # our key, not the email: fixed by an operator
        (Reply(403), "retry", None),
        (Reply(404), "failed", None),
        (Reply(422), "failed", None),
    ],
)
async def test_http_classifies_answers(
    provider: Provider, reply: Reply, status: str, retry_after: float | None
) -> None:
    provider.script(None, reply)
    mailer = HttpMailer(provider.url, API_KEY, timeout=2)
    try:
        result = await mailer.send(an_email())
    finally:
        await mailer.aclose()
    assert result.status == status
    assert result.retry_after == retry_after
    assert result.error is not None
    assert f"HTTP {reply.status}" in result.error


async def test_http_timeout_is_retryable(provider: Provider) -> None:
    provider.slow("key-1", 2.0)
    mailer = HttpMailer(provider.url, API_KEY, timeout=0.3)
    started = time.monotonic()
    try:
        result = await mailer.send(an_email())
    finally:
        await mailer.aclose()
    assert result.status == "retry"
    assert result.error is not None
    assert "timed out" in result.error
    assert time.monotonic() - started < 1.5


async def test_http_connection_refused_is_retryable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before the send: nobody listens there
    mailer = HttpMailer(f"http://127.0.0.1:{port}", API_KEY, timeout=2)
    try:
        result = await mailer.send(an_email())
    finally:
        await mailer.aclose()
    assert result.status == "retry"
    assert result.error is not None
    assert "connection error" in result.error


def test_parse_retry_after() -> None:
    now = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC).timestamp()
    assert parse_retry_after("5", now=now) == 5.0
    assert parse_retry_after(" 1.5 ", now=now) == 1.5
    assert parse_retry_after("-3", now=now) == 0.0
    assert parse_retry_after("Thu, 01 Jan 2026 12:00:30 GMT", now=now) == 30.0
    assert parse_retry_after("Thu, 01 Jan 2026 11:00:00 GMT", now=now) == 0.0
    assert parse_retry_after("soon", now=now) is None
    assert parse_retry_after(None) is None
    # Not a number of seconds anyone can wait: ignored (the outbox keeps its own schedule);
    # a huge finite one is capped by the outbox at OUTBOX_RETRY_WINDOW.
    for endless in ("inf", "Infinity", "-inf", "nan", "1e400"):
        assert parse_retry_after(endless, now=now) is None, endless
    assert parse_retry_after("1e13", now=now) == 1e13


def test_error_text_is_storable_and_short() -> None:
    """No NUL (PostgreSQL text cannot hold it) nor lone surrogates (cannot be encoded)."""
    assert error_text("bad\x00 gateway\ud800 \n\t x") == "bad gateway x"
    long = error_text("x" * 1000)
    assert len(long) == 300
    assert long.endswith("…")
    assert len(error_text("y" * 1000, 50)) == 50


async def test_http_error_body_with_a_nul_is_made_storable(provider: Provider) -> None:
    provider.script(None, Reply(502, body="<html>bad\x00gateway</html>"))
    mailer = HttpMailer(provider.url, API_KEY, timeout=2)
    try:
        result = await mailer.send(an_email())
    finally:
        await mailer.aclose()
    assert result.status == "retry"
    assert result.error == "HTTP 502: <html>badgateway</html>"


def test_payload_is_deterministic() -> None:
    assert payload_bytes(an_email()) == payload_bytes(an_email())
    assert payload_bytes(an_email()).startswith(b'{"from":')
    assert "✓".encode() in payload_bytes(an_email())


# --- smtp -----------------------------------------------------------------------------------


class Sink:
    """An aiosmtpd handler: keeps what it accepts; refuses recipients by their local part."""

    def __init__(self) -> None:
        self.messages: list[Any] = []

    async def handle_RCPT(
        self, server: Any, session: Any, envelope: Any, address: str, options: list[str]
    ) -> str:
        if address.startswith("reject"):
            return "550 5.1.1 no such user"
        if address.startswith("later"):
            return "451 4.3.0 try again later"
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        self.messages.append(envelope)
        return "250 Message accepted for delivery"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def test_smtp_bad_credentials_are_retried_not_dead() -> None:
    """A relay refusing our login (rotated password) is our fault, not the email's."""
    port = _free_port()
    controller = Controller(
        Sink(),
        hostname="127.0.0.1",
        port=port,
        auth_require_tls=False,
        authenticator=lambda *args: AuthResult(success=False, handled=False),
    )
    controller.start()
    mailer = SmtpMailer("127.0.0.1", port, timeout=5, username="app", password="old")
    try:
        result = await mailer.send(an_email())
    finally:
        await mailer.aclose()
        controller.stop()
    assert result.status == "retry", result
    assert result.error is not None
    assert "535" in result.error


@pytest.fixture
def smtp_server() -> Iterator[tuple[Sink, int]]:
    sink = Sink()
    port = _free_port()
    controller = Controller(sink, hostname="127.0.0.1", port=port)
    controller.start()
    try:
        yield sink, port
    finally:
        controller.stop()


async def test_smtp_delivers_with_a_message_id_from_the_key(
    smtp_server: tuple[Sink, int],
) -> None:
    sink, port = smtp_server
    mailer = SmtpMailer("127.0.0.1", port, timeout=5)
    try:
        first = await mailer.send(an_email("digest:1767337200:42"))
        again = await mailer.send(an_email("digest:1767337200:42"))
    finally:
        await mailer.aclose()
    assert first.status == again.status == "sent"
    assert first.message_id == "<digest-1767337200-42@example.com>"
    # SMTP cannot de-duplicate: the relay took both (at-least-once), with one Message-ID.
    assert len(sink.messages) == 2
    parsed = [
        email.message_from_bytes(m.content, policy=email.policy.default) for m in sink.messages
    ]
    assert {p["Message-ID"] for p in parsed} == {first.message_id}
    assert parsed[0]["Date"] == parsed[1]["Date"] == "Fri, 02 Jan 2026 07:00:00 +0000"
    assert parsed[0]["Subject"] == "Your digest ✓"
    assert parsed[0].get_content().replace("\r\n", "\n") == an_email().body
    assert sink.messages[0].rcpt_tos == ["ada@example.com"]
    assert message_id(an_email("a b/c")) == "<a-b-c@example.com>"


async def test_smtp_classifies_refusals(smtp_server: tuple[Sink, int]) -> None:
    _, port = smtp_server
    mailer = SmtpMailer("127.0.0.1", port, timeout=5)
    try:
        permanent = await mailer.send(an_email(recipient="reject@example.com"))
        transient = await mailer.send(an_email(recipient="later@example.com"))
    finally:
        await mailer.aclose()
    assert permanent.status == "failed"
    assert permanent.error is not None
    assert "550" in permanent.error
    assert transient.status == "retry"
    assert transient.error is not None
    assert "451" in transient.error


async def test_smtp_unreachable_relay_is_retryable() -> None:
    mailer = SmtpMailer("127.0.0.1", _free_port(), timeout=2)
    try:
        result = await mailer.send(an_email())
    finally:
        await mailer.aclose()
    assert result.status == "retry"


@pytest.mark.slow  # seconds of timers or loops by design: not in --fast
async def test_smtp_timeout_bounds_the_whole_send() -> None:
    """A tarpit relay that answers every command within the timeout but is slow overall: the
    send gives up at its timeout, and nothing reaches the relay after it said "retry" (before,
    the worker thread went on and delivered a copy the outbox would send again)."""
    with SlowRelay(delay=0.4) as relay:
        mailer = SmtpMailer("127.0.0.1", relay.port, timeout=1.0)
        started = time.monotonic()
        try:
            result = await mailer.send(an_email())
            returned = time.monotonic()
            await asyncio.sleep(2.0)  # the whole exchange would be over by now
        finally:
            await mailer.aclose()
        [conn] = relay.connections
    assert result.status == "retry"
    assert result.error == "timed out after 1s"
    assert returned - started < 1.5
    assert relay.delivered() == []
    assert all(at <= returned for at, _ in conn.commands), conn.commands
    assert max_send_time(mailer, 0.0) == 2.0  # the timeout and the grace for a name lookup


async def test_smtp_a_slow_goodbye_after_the_message_is_still_sent() -> None:
    """The relay took the message but hangs on QUIT: that is a delivery ("sent"), not a
    failure to retry, which would deliver a second copy."""
    with SlowRelay(delays={"QUIT": 5.0}) as relay:
        mailer = SmtpMailer("127.0.0.1", relay.port, timeout=1.0)
        started = time.monotonic()
        try:
            result = await mailer.send(an_email())
        finally:
            await mailer.aclose()
        elapsed = time.monotonic() - started
        delivered = relay.delivered()
    assert result.status == "sent", result
    assert len(delivered) == 1
    assert elapsed < 2.0


# --- log and the choice of backend ----------------------------------------------------------


async def test_log_backend_writes_one_structured_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="cronlock.mail")
    result = await LogMailer().send(an_email())
    assert result.status == "sent"
    assert result.message_id == "log:key-1"
    [record] = [r for r in caplog.records if r.name == "cronlock.mail"]
    assert record.__dict__["event"] == "email"
    assert record.__dict__["idempotency_key"] == "key-1"
    assert record.__dict__["to"] == "ada@example.com"
    assert record.__dict__["text"] == an_email().body


async def test_backend_is_chosen_by_settings() -> None:
    def make(**values: Any) -> Settings:
        return Settings(_env_file=None, **values)

    chosen = [
        create_mailer(make()),
        create_mailer(make(email_backend="smtp")),
        create_mailer(make(email_backend="http", email_api_key=API_KEY)),
    ]
    try:
        assert [type(m) for m in chosen] == [LogMailer, SmtpMailer, HttpMailer]
        assert isinstance(chosen[2], HttpMailer)
        assert chosen[2].url == "https://api.resend.com/emails"
    finally:
        for mailer in chosen:
            await mailer.aclose()
    with pytest.raises(SettingsError, match="EMAIL_API_KEY"):
        create_mailer(make(email_backend="http"))


class DroppingSink(Sink):
    """Takes every message, but hangs up right after every `every`-th one, before its
    answer: the message in flight has reached the relay, the client cannot know it."""

    def __init__(self, every: int) -> None:
        super().__init__()
        self.every = every
        self.dropped: list[str] = []

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        self.messages.append(envelope)
        if self.every and len(self.messages) % self.every == 0:
            self.dropped.append(_message_id(envelope))
            server.transport.close()
        return "250 Message accepted for delivery"


def _message_id(envelope: Any) -> str:
    return str(email.message_from_bytes(envelope.content)["Message-ID"])


async def _send_all(mailer: SmtpMailer, emails: list[Email], *, tries: int = 1) -> list[str]:
    """Send with OUTBOX_CONCURRENCY-like bounds (4 at once), retrying a retryable answer
    like the outbox does; returns each email's final status."""
    slots = asyncio.Semaphore(4)

    async def one(message: Email) -> str:
        async with slots:
            for _ in range(tries):
                result = await mailer.send(message)
                if result.status != "retry":
                    return result.status
            return result.status

    return await asyncio.gather(*(one(m) for m in emails))


def _controller(sink: Sink) -> tuple[Controller, int]:
    port = _free_port()
    controller = Controller(sink, hostname="127.0.0.1", port=port)
    controller.start()
    return controller, port


# Unmeasured: the other SMTP tests cover its lines, and measuring 2,000 messages took 38 s
# of a full run instead of about 10.
@pytest.mark.slow  # scale by design (2,000 emails, 20 connections): 5-15 s
@pytest.mark.no_cover
async def test_smtp_reuses_connections_for_many_messages() -> None:
    """2,000 emails over a few connections (RSET between messages, at most 100 each), each
    delivered once."""
    sink = Sink()
    controller, port = _controller(sink)
    mailer = SmtpMailer("127.0.0.1", port, timeout=10, max_workers=4, max_messages=100)
    emails = [an_email(f"k{i}", f"user{i}@example.com") for i in range(2000)]
    try:
        started = time.monotonic()
        statuses = await _send_all(mailer, emails)
        elapsed = time.monotonic() - started
    finally:
        await mailer.aclose()
        controller.stop()
    print(f"\n2000 emails over {mailer.connections} connections in {elapsed:.1f} s")
    assert statuses == ["sent"] * 2000
    ids = Counter(_message_id(m) for m in sink.messages)
    assert len(ids) == 2000
    assert max(ids.values()) == 1
    assert 20 <= mailer.connections <= 20 + 4  # 100 per connection; a few part-used at the end


async def test_smtp_a_dropped_connection_loses_nothing_and_repeats_only_the_message_in_flight() -> (
    None
):
    sink = DroppingSink(every=150)
    controller, port = _controller(sink)
    mailer = SmtpMailer("127.0.0.1", port, timeout=10, max_workers=4, max_messages=100)
    emails = [an_email(f"k{i}", f"user{i}@example.com") for i in range(600)]
    try:
        statuses = await _send_all(mailer, emails, tries=3)
    finally:
        await mailer.aclose()
        controller.stop()
    assert statuses == ["sent"] * 600
    ids = Counter(_message_id(m) for m in sink.messages)
    assert set(ids) == {message_id(e) for e in emails}  # nothing lost
    twice = {k for k, n in ids.items() if n > 1}
    assert max(ids.values()) <= 2
    assert twice <= set(sink.dropped)  # only the messages in flight when the relay hung up
    assert sink.dropped


async def test_smtp_a_kept_connection_the_relay_closed_with_421_is_replaced() -> None:
    """A relay says 421 to an idle kept connection and hangs up: smtplib's RSET returns that
    code without raising, so the next send must see it and go on over a new connection
    (before, it tried the message on the dead one and came back "retry")."""
    with SlowRelay(idle_close=0.3) as relay:
        mailer = SmtpMailer("127.0.0.1", relay.port, timeout=5.0)
        try:
            first = await mailer.send(an_email("k1"))
            await asyncio.sleep(0.6)  # the relay gives up on the idle connection
            second = await mailer.send(an_email("k2"))
        finally:
            await mailer.aclose()
        delivered = relay.delivered()
        opened = len(relay.connections)
    assert (first.status, second.status) == ("sent", "sent"), second
    assert len(delivered) == 2
    assert opened == mailer.connections == 2


async def test_smtp_aclose_does_not_block_the_loop_on_a_slow_goodbye() -> None:
    """Kept connections to a relay that hangs on QUIT: aclose says goodbye in threads, bounded,
    and the event loop goes on meanwhile (before, each quit blocked it for up to 1 s)."""
    with SlowRelay(delays={"QUIT": 5.0}) as relay:
        mailer = SmtpMailer("127.0.0.1", relay.port, timeout=5.0, max_workers=2)
        results = await asyncio.gather(mailer.send(an_email("k1")), mailer.send(an_email("k2")))
        assert [r.status for r in results] == ["sent", "sent"]
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.02)
                ticks += 1

        ticker = asyncio.create_task(tick())
        started = time.monotonic()
        await mailer.aclose()
        elapsed = time.monotonic() - started
        ticker.cancel()
    assert elapsed < 1.6
    assert ticks >= 10  # the loop ran while the goodbyes waited


async def test_smtp_a_session_finishing_after_aclose_is_not_kept() -> None:
    """A send still in its worker thread when aclose runs: its connection is closed when the
    send ends, not put back into a mailer that is closed."""
    with SlowRelay(delays={".": 0.5}) as relay:
        mailer = SmtpMailer("127.0.0.1", relay.port, timeout=5.0)
        sending = asyncio.create_task(mailer.send(an_email("k1")))
        await asyncio.sleep(0.2)  # the message is being sent
        await mailer.aclose()
        result = await sending
        await asyncio.sleep(0.2)
        [conn] = relay.connections
    assert result.status == "sent"
    assert "QUIT" in [verb for _, verb in conn.commands]
    assert not mailer.idle_sessions()


def test_classify_batch_survives_malformed_answers(caplog: pytest.LogCaptureFixture) -> None:
    """A 2xx batch answer whose `data`/`errors` are not lists of objects: the provider took the
    request, so every member is sent with an unknown id (logged), never a TypeError that
    would retry delivered emails into dead letters."""
    bodies: list[Any] = [
        {"data": 5},
        {"data": True, "errors": []},
        {"data": [{"id": "a"}, {"id": "b"}], "errors": 7},
        {"data": [{"id": "a"}], "errors": [3]},
        {"data": ["a", "b"]},
        {"data": [{"id": "a"}, {"id": "b"}], "errors": [{"index": True, "message": "x"}]},
        [1, 2],
        "ok",
    ]
    caplog.set_level(logging.WARNING, logger="cronlock.mailer")
    for body in bodies:
        result = classify_batch(httpx.Response(200, json=body), 2)
        assert result.request.status == "sent", body
        assert [(m.status, m.message_id) for m in result.members] == [("sent", None)] * 2, body
    assert len([r for r in caplog.records if "batch answer" in r.getMessage()]) == len(bodies)
    good = {"data": [{"id": "a"}], "errors": [{"index": 0, "message": "bad to"}]}
    result = classify_batch(httpx.Response(200, json=good), 2)
    assert [(m.status, m.message_id) for m in result.members] == [("failed", None), ("sent", "a")]
