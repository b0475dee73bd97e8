"""Delivery backends behind one small protocol: a Resend-compatible HTTP API, SMTP, or the log.

A backend never raises for a delivery problem: it answers with a `SendResult` that says
whether the email went out, is worth retrying (timeouts, connection errors, 408/409/429/5xx,
SMTP 4xx) or failed for good (any other 4xx, SMTP 5xx). The outbox decides what to do next.

Guarantees differ by backend:
- `http` sends the same `Idempotency-Key` and the same body bytes on every attempt, so a
  provider that honours the key delivers once even when our answer was lost;
- `smtp` has no de-duplication: an answer lost after the relay took the message means a
  second copy (with the same Message-ID, which some clients collapse). At-least-once;
- `log` writes one structured line per email and counts it as sent.

Long on purpose: the one place that decides what a provider's answer means (sent, worth a
retry, failed for good) for every backend; the outbox's retries and dead letters follow from
these rules, so the backends are read side by side, as the guarantees above compare them.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.policy
import email.utils
import json
import logging
import math
import re
import smtplib
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import datetime
from email.message import EmailMessage
from typing import TYPE_CHECKING, Any, Literal, Protocol

import httpx

from cronlock.settings import Settings, SettingsError

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

log = logging.getLogger("cronlock.mailer")

# Kept short in `last_error`: enough to tell what the provider said.
ERROR_SNIPPET = 300

# Characters a PostgreSQL text value cannot hold (NUL), or that cannot even be encoded to send
# it (lone surrogates, as `errors="surrogateescape"` leaves them).
_NOT_TEXT = re.compile("[\x00\ud800-\udfff]")

# How long an SMTP send may still take after its deadline: closing the socket ends any wait
# on the relay at once, but a name lookup under way cannot be interrupted (it sends nothing).
SMTP_GRACE = 1.0

# 408/429/5xx are transient by definition; Resend answers 409 `concurrent_idempotent_requests`
# while a request with the same idempotency key is still being processed, which resolves
# itself (but 409 `invalid_idempotent_request`, the key reused with another body, never does:
# see `PERMANENT_409`). 401/403 say our key is
# wrong (rotated, revoked), not the email: retried, so a bad key costs a delay until it is
# fixed instead of killing the whole queue in one pass; the retry window still ends them.
RETRYABLE_STATUS = frozenset({401, 403, 408, 409, 429})
# SMTP's "authentication required / credentials invalid": ours to fix, as above.
SMTP_AUTH_CODES = frozenset({530, 534, 535})
# Resend's name for "this key was used with another body": the same request fails the same
# way for as long as the provider keeps the key (24 h), so retrying it would only loop.
PERMANENT_409 = frozenset({"invalid_idempotent_request"})

# Resend's documented maximum for POST /emails/batch.
MAX_BATCH = 100


@dataclass(frozen=True, slots=True)
class Email:
    """What the provider receives, exactly as frozen in the outbox row at enqueue."""

    idempotency_key: str
    sender: str
    recipient: str
    subject: str
    body: str
    created_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class RateInfo:
    """What one answer said about the provider's request limit (Resend's `ratelimit-limit`,
    `ratelimit-remaining`, `ratelimit-reset`, and `retry-after` on a 429): each None when
    absent or not a number we can use. `throttled`: the answer was 429, the request not taken."""

    limit: int | None = None
    remaining: int | None = None
    reset: float | None = None  # seconds until the provider's window resets
    retry_after: float | None = None
    throttled: bool = False


@dataclass(frozen=True, slots=True)
class SendResult:
    status: Literal["sent", "retry", "failed"]
    message_id: str | None = None
    error: str | None = None
    # Seconds the provider asked us to wait (Retry-After), if it said.
    retry_after: float | None = None
    # The answer's rate headers (None: no answer, or none of them in it).
    rate: RateInfo | None = None
    # time.monotonic() when the request was written out whole (None: not known), so a
    # sender can tell how late it left after its start in the rate window.
    written: float | None = None

    @classmethod
    def sent(cls, message_id: str | None) -> SendResult:
        return cls("sent", message_id=message_id)

    @classmethod
    def retry(cls, error: str, retry_after: float | None = None) -> SendResult:
        return cls("retry", error=error, retry_after=retry_after)

    @classmethod
    def failed(cls, error: str) -> SendResult:
        return cls("failed", error=error)


@dataclass(frozen=True, slots=True)
class BatchResult:
    """The answer to one batch request: `request` for the request as a whole; when the
    provider took it (`request.status == "sent"`), one result per member, by index."""

    request: SendResult
    members: tuple[SendResult, ...] = ()


class Mailer(Protocol):
    async def send(self, message: Email) -> SendResult: ...

    async def aclose(self) -> None: ...


class BatchMailer(Mailer, Protocol):
    """A backend with a batch endpoint: one request, many emails, one idempotency key."""

    async def send_batch(self, key: str, body: bytes, size: int) -> BatchResult: ...


def supports_batches(mailer: Mailer) -> bool:
    return callable(getattr(mailer, "send_batch", None))


def max_send_time(mailer: Mailer, default: float) -> float:
    """The longest one `send` of this backend can take (its `max_send_time` if it says), so a
    caller knows how much lease a send needs."""
    value = getattr(mailer, "max_send_time", None)
    return float(value) if isinstance(value, int | float) else default


def pg_text(text: str) -> str:
    """`text` without the characters a PostgreSQL text column cannot hold."""
    return _NOT_TEXT.sub("", text)


def error_text(text: str, limit: int = ERROR_SNIPPET) -> str:
    """An error message fit for `last_error` and a log line: storable by PostgreSQL (see
    `pg_text`), whitespace collapsed, at most `limit` characters. Every error a backend
    reports, and every error the outbox writes, goes through here."""
    text = " ".join(pg_text(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def create_mailer(settings: Settings) -> Mailer:
    """The backend `EMAIL_BACKEND` names."""
    if settings.email_backend == "http":
        if settings.email_api_key is None:
            raise SettingsError("EMAIL_BACKEND=http needs EMAIL_API_KEY")
        return HttpMailer(
            settings.email_api_url,
            settings.email_api_key.get_secret_value(),
            timeout=settings.outbox_send_timeout,
            max_connections=settings.outbox_concurrency,
        )
    if settings.email_backend == "smtp":
        return SmtpMailer(
            settings.smtp_host,
            settings.smtp_port,
            username=settings.smtp_username,
            password=(
                settings.smtp_password.get_secret_value() if settings.smtp_password else None
            ),
            starttls=settings.smtp_starttls,
            timeout=settings.outbox_send_timeout,
            max_workers=settings.outbox_concurrency,
            max_messages=settings.smtp_max_messages_per_connection,
            max_session_time=settings.smtp_max_session_time,
        )
    return LogMailer()


# --- http -----------------------------------------------------------------------------------


def _document(message: Email) -> dict[str, str]:
    # No attachments, tags or scheduled_at: Resend's batch endpoint does not take them, and a
    # single send carries the same fields so that one email means the same in both.
    return {
        "from": message.sender,
        "to": message.recipient,
        "subject": message.subject,
        "text": message.body,
    }


def _dumps(document: Any) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def payload_bytes(message: Email) -> bytes:
    """The request body: sorted keys, no whitespace, so every attempt sends the same bytes."""
    return _dumps(_document(message))


def batch_bytes(messages: Sequence[Email]) -> bytes:
    """A batch request's body: the members' documents in order (a JSON array), encoded as
    `payload_bytes` encodes one; frozen in the database before the first attempt."""
    if not 0 < len(messages) <= MAX_BATCH:
        raise ValueError(f"a batch holds 1 to {MAX_BATCH} emails, not {len(messages)}")
    return _dumps([_document(m) for m in messages])


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """`Retry-After` as seconds from now: delta-seconds or an HTTP-date; None if absent/bad
    (including "inf", "nan" and numbers too big for a float: the outbox then keeps its own
    schedule; it also caps a finite value at OUTBOX_RETRY_WINDOW)."""
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return max(0.0, seconds) if math.isfinite(seconds) else None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    # An HTTP-date is the provider's wall clock; only the difference to ours means anything.
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


# Larger counts than any provider's are not a limit we can use (and would not fit the row).
_MAX_COUNT = 1_000_000_000


def _count(response: httpx.Response, name: str) -> int | None:
    """A header that must be one whole number >= 0 (a repeated header: ignored)."""
    values = response.headers.get_list(name)
    if len(values) != 1 or not values[0].strip().isdigit() or not values[0].isascii():
        return None
    value = int(values[0])
    return value if value <= _MAX_COUNT else None


def parse_rate(response: httpx.Response) -> RateInfo | None:
    """The answer's rate headers (None when it has none and is not a 429). A value that is
    not a usable number is left out, never guessed at."""
    throttled = response.status_code == 429
    limit = _count(response, "ratelimit-limit")
    remaining = _count(response, "ratelimit-remaining")
    resets = response.headers.get_list("ratelimit-reset")
    reset = parse_retry_after(resets[0]) if len(resets) == 1 else None
    afters = response.headers.get_list("retry-after")
    retry_after = parse_retry_after(afters[0]) if len(afters) == 1 else None
    if not throttled and limit is None and remaining is None and reset is None:
        return None
    return RateInfo(limit, remaining, reset, retry_after if throttled else None, throttled)


def classify_response(response: httpx.Response) -> SendResult:
    status = response.status_code
    if 200 <= status < 300:
        message_id: str | None = None
        try:
            document = response.json()
        except ValueError:
            document = None
        if isinstance(document, dict) and isinstance(document.get("id"), str):
            message_id = document["id"]
        return replace(SendResult.sent(message_id), rate=parse_rate(response))
    return _refused(response)


def _refused(response: httpx.Response) -> SendResult:
    """A non-2xx answer: retry or failed."""
    return replace(_refusal(response), rate=parse_rate(response))


def _refusal(response: httpx.Response) -> SendResult:
    status = response.status_code
    error = f"HTTP {status}: {error_text(response.text)}"
    if status == 409 and _error_name(response) in PERMANENT_409:
        return SendResult.failed(error)
    if status in RETRYABLE_STATUS or status >= 500:
        return SendResult.retry(error, parse_retry_after(response.headers.get("retry-after")))
    return SendResult.failed(error)


def _error_name(response: httpx.Response) -> str | None:
    try:
        document = response.json()
    except ValueError:
        return None
    name = document.get("name") if isinstance(document, dict) else None
    return name if isinstance(name, str) else None


def classify_batch(response: httpx.Response, size: int) -> BatchResult:
    """A batch answer in permissive mode: `data` holds the created emails' ids in request
    order, `errors` one `{index, message}` per member the provider refused; members not in
    `errors` are the created ones, in order."""
    if not 200 <= response.status_code < 300:
        return BatchResult(_refused(response))
    parsed = _parse_batch_answer(response, size)
    if parsed is None:
        # The provider took the request (2xx) but its answer does not say which id is whose,
        # or which member it refused: the emails count as sent (asking again with the key
        # would get the same answer, and a retry could only end in dead letters for emails
        # that went out), ids unknown.
        log.warning("batch answer not understood for a batch of %d: ids unknown", size)
        request = replace(SendResult.sent(None), rate=parse_rate(response))
        return BatchResult(request, (SendResult.sent(None),) * size)
    ids, refused = parsed
    created = iter(ids)
    members = tuple(
        SendResult.failed(refused[i]) if i in refused else SendResult.sent(next(created))
        for i in range(size)
    )
    return BatchResult(replace(SendResult.sent(None), rate=parse_rate(response)), members)


def _parse_batch_answer(
    response: httpx.Response, size: int
) -> tuple[list[str | None], dict[int, str]] | None:
    """(ids of the created members in order, {index: error} of the refused ones), or None
    when the answer's shape is not the documented one (any part of it)."""
    try:
        document = response.json()
    except ValueError:
        return None
    if not isinstance(document, dict):
        return None
    data = document.get("data")
    errors = document.get("errors", [])
    if errors is None:
        errors = []
    if not isinstance(data, list) or not isinstance(errors, list):
        return None
    refused: dict[int, str] = {}
    for item in errors:
        index = item.get("index") if isinstance(item, dict) else None
        # bool is an int to Python, not an index to JSON.
        if type(index) is not int or not 0 <= index < size or index in refused:
            return None
        refused[index] = error_text(f"refused in its batch: {item.get('message')}")
    if not all(isinstance(d, dict) for d in data) or len(data) != size - len(refused):
        return None
    ids = [d.get("id") if isinstance(d.get("id"), str) else None for d in data]
    return ids, refused


class _Written:
    """When a request was written out whole, from httpcore's trace events (a new connection,
    a busy process: the request can leave well after the sender decided to send it)."""

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at: float | None = None

    async def trace(self, event: str, info: dict[str, Any]) -> None:
        if event.endswith(".send_request_body.complete"):
            self.at = time.monotonic()


class HttpMailer:
    """A Resend-compatible API: `POST {api_url}/emails` with an `Idempotency-Key`, and
    `POST {api_url}/emails/batch` (up to 100 emails, one key for the whole batch)."""

    def __init__(
        self,
        api_url: str,
        api_key: str,
        *,
        timeout: float,
        max_connections: int = 8,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = api_url.rstrip("/") + "/emails"
        self.batch_url = self.url + "/batch"
        self.timeout = timeout
        # The asyncio timeout in `send` bounds the whole request.
        self.max_send_time = timeout
        self._client = httpx.AsyncClient(
            # httpx's timeouts apply per phase; the asyncio timeout in `send` caps the whole.
            timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)),
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
            headers={
                "Authorization": f"Bearer {api_key}",
                "Content-Type": "application/json",
                "User-Agent": "cronlock",
            },
            transport=transport,
        )

    async def send(self, message: Email) -> SendResult:
        body = payload_bytes(message)
        written = _Written()
        try:
            async with asyncio.timeout(self.timeout):
                response = await self._client.post(
                    self.url,
                    content=body,
                    headers={"Idempotency-Key": message.idempotency_key},
                    extensions={"trace": written.trace},
                )
        except (TimeoutError, httpx.TimeoutException):
            return SendResult.retry(f"timed out after {self.timeout:g}s")
        except httpx.TransportError as exc:
            return SendResult.retry(error_text(f"connection error: {type(exc).__name__}: {exc}"))
        return replace(classify_response(response), written=written.at)

    async def send_batch(self, key: str, body: bytes, size: int) -> BatchResult:
        """One batch request with its frozen `body` of `size` emails. Permissive validation:
        Resend's default (strict) refuses the whole batch for one bad email, permissive sends
        the valid ones and answers an error per refused index."""
        headers = {"Idempotency-Key": key, "x-batch-validation": "permissive"}
        written = _Written()
        try:
            async with asyncio.timeout(self.timeout):
                response = await self._client.post(
                    self.batch_url,
                    content=body,
                    headers=headers,
                    extensions={"trace": written.trace},
                )
        except (TimeoutError, httpx.TimeoutException):
            return BatchResult(SendResult.retry(f"timed out after {self.timeout:g}s"))
        except httpx.TransportError as exc:
            error = error_text(f"connection error: {type(exc).__name__}: {exc}")
            return BatchResult(SendResult.retry(error))
        result = classify_batch(response, size)
        return replace(result, request=replace(result.request, written=written.at))

    async def aclose(self) -> None:
        await self._client.aclose()


# --- smtp -----------------------------------------------------------------------------------

_KEY_UNSAFE = re.compile(r"[^A-Za-z0-9._\-]")


def message_id(message: Email) -> str:
    """A Message-ID derived from the idempotency key: every attempt carries the same one."""
    address = email.utils.parseaddr(message.sender)[1]
    domain = address.rpartition("@")[2] or "cronlock.invalid"
    return f"<{_KEY_UNSAFE.sub('-', message.idempotency_key)}@{domain}>"


def build_mime(message: Email) -> EmailMessage:
    mime = EmailMessage(policy=email.policy.SMTP)
    mime["From"] = message.sender
    mime["To"] = message.recipient
    mime["Subject"] = message.subject
    mime["Message-ID"] = message_id(message)
    if message.created_at is not None:
        # The enqueue time, not the attempt time: retries carry the same headers.
        mime["Date"] = email.utils.format_datetime(message.created_at)
    mime.set_content(message.body)
    return mime


class _Deadline:
    """One SMTP send's overall deadline, shared by the worker thread and the event loop.

    smtplib's timeout applies to each socket operation, so a relay that answers every command
    just in time can keep a send going for many timeouts. Here each operation waits at most
    the time left, and `expire` (the loop, at the deadline) shuts the socket down, which ends
    any wait at once. The lock makes it either-or: the thread registers its socket before it
    sends anything, and a socket that arrives after `expire` is closed unused, so once `expire`
    returns not one more byte reaches the relay."""

    def __init__(self, seconds: float) -> None:
        self.message = f"timed out after {seconds:g}s"
        self.at = time.monotonic() + seconds
        self._lock = threading.Lock()
        self._expired = False
        self._sock: socket.socket | None = None

    @property
    def passed(self) -> bool:
        return self._expired or time.monotonic() >= self.at

    def left(self) -> float:
        if self.passed:
            raise TimeoutError(self.message)
        return self.at - time.monotonic()

    def register(self, sock: socket.socket) -> None:
        with self._lock:
            if self._expired:
                sock.close()
                raise TimeoutError(self.message)
            self._sock = sock

    def expire(self) -> None:
        with self._lock:
            self._expired = True
            sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def detach(self) -> bool:
        """Let the socket outlive this send (a connection kept for the next one): after this
        `expire` leaves it alone. False if the deadline already expired (the socket is shut)."""
        with self._lock:
            if self._expired:
                return False
            self._sock = None
            return True


class _DeadlineSMTP(smtplib.SMTP):
    """smtplib.SMTP bounded by a `_Deadline` instead of a timeout per socket operation: before
    each command and each reply the socket (the TLS one after STARTTLS too) is registered
    with the deadline and may wait only the time left."""

    def __init__(self, deadline: _Deadline) -> None:
        self._deadline = deadline
        self._registered: socket.socket | None = None
        # No host: `connect` is called later. The timeout is for the connect; the thread may
        # start late, so it is what is left, not the whole.
        super().__init__(timeout=deadline.left())

    def rebind(self, deadline: _Deadline) -> None:
        """Serve the next send, under its own deadline (a connection reused)."""
        self._deadline = deadline
        self._registered = None

    def _bound(self) -> None:
        sock = self.sock
        if sock is None:
            return
        if sock is not self._registered:
            self._deadline.register(sock)
            self._registered = sock
        sock.settimeout(self._deadline.left())

    def send(self, s: ReadableBuffer | str) -> None:
        self._bound()
        super().send(s)

    def getreply(self) -> tuple[int, bytes]:
        self._bound()
        return super().getreply()


@dataclass
class _Session:
    """An open, logged-in SMTP connection between sends."""

    smtp: _DeadlineSMTP
    opened: float
    messages: int = 0


class SmtpMailer:
    """Any SMTP relay, through stdlib smtplib in worker threads. At-least-once (see module).

    `timeout` bounds the whole send (connect, TLS, login, the message), not each step: at the
    deadline the socket is shut down, so a send reported as "retry" can no longer deliver.

    A connection carries many messages: after a send it is kept (up to `max_messages` per
    connection and `max_session_time` seconds) and the next send starts with RSET on it, under
    that send's own deadline. A kept connection the relay has closed fails at RSET, before any
    of the message is sent, and the send goes on over a new one; a connection that fails during
    a message is dropped, and only that message may reach the relay twice.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        username: str | None = None,
        password: str | None = None,
        starttls: bool = False,
        timeout: float = 10.0,
        max_workers: int = 4,
        max_messages: int = 100,
        max_session_time: float = 300.0,
    ) -> None:
        self.max_messages = max_messages
        self.max_session_time = max_session_time
        self._idle: list[_Session] = []
        self._idle_lock = threading.Lock()
        self._closed = False  # under _idle_lock: no session is kept after aclose
        self.connections = 0  # opened so far (for tests and the log)
        self.host = host
        self.port = port
        self.username = username
        self.password = password
        self.starttls = starttls
        self.timeout = timeout
        self.max_send_time = timeout + SMTP_GRACE
        # Our own threads: a slow relay must not starve the loop's default executor.
        self._threads = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="smtp")

    async def send(self, message: Email) -> SendResult:
        mime = build_mime(message)
        loop = asyncio.get_running_loop()
        deadline = _Deadline(self.timeout)
        future = loop.run_in_executor(self._threads, self._send_sync, mime, deadline)
        try:
            await asyncio.wait({future}, timeout=self.timeout)
            if not future.done():
                # Nothing more reaches the relay after this; the thread ends as soon as it
                # sees its socket shut down (or its name lookup come back).
                deadline.expire()
                await asyncio.wait({future}, timeout=SMTP_GRACE)
        except BaseException:
            deadline.expire()  # cut off (shutdown): the row is given back, stop sending it
            future.add_done_callback(_ignore_result)
            raise
        timed_out = SendResult.retry(deadline.message)
        if not future.done():
            future.add_done_callback(_ignore_result)
            return timed_out
        try:
            future.result()
        except TimeoutError:
            return timed_out
        except (smtplib.SMTPServerDisconnected, smtplib.SMTPConnectError) as exc:
            # A socket the deadline shut down looks like a relay that hung up.
            if deadline.passed:
                return timed_out
            return SendResult.retry(error_text(f"SMTP connection error: {exc}"))
        except smtplib.SMTPRecipientsRefused as exc:
            codes = [code for code, _ in exc.recipients.values()]
            error = error_text(f"SMTP recipient refused: {_smtp_text(exc.recipients)}")
            if codes and all(400 <= c < 500 for c in codes):
                return SendResult.retry(error)
            return SendResult.failed(error)
        except smtplib.SMTPResponseException as exc:
            error = error_text(f"SMTP {exc.smtp_code}: {_decode(exc.smtp_error)}")
            if 500 <= exc.smtp_code < 600 and exc.smtp_code not in SMTP_AUTH_CODES:
                return SendResult.failed(error)
            return SendResult.retry(error)
        except smtplib.SMTPNotSupportedError as exc:
            return SendResult.failed(error_text(f"SMTP relay does not support it: {exc}"))
        except (smtplib.SMTPException, OSError) as exc:
            if deadline.passed:
                return timed_out
            return SendResult.retry(error_text(f"SMTP error: {type(exc).__name__}: {exc}"))
        return SendResult.sent(str(mime["Message-ID"]))

    def _send_sync(self, mime: EmailMessage, deadline: _Deadline) -> None:
        session = self._reuse(deadline)
        if session is None:
            session = self._open(deadline)
        try:
            session.smtp.send_message(mime)
        except BaseException:
            session.smtp.close()
            raise
        session.messages += 1
        # The relay has the message: whatever happens to the connection now, it was sent (a
        # failure here reported as "retry" would deliver a second copy).
        fresh = time.monotonic() - session.opened < self.max_session_time
        if session.messages < self.max_messages and fresh and deadline.detach():
            with self._idle_lock:
                # After aclose nobody would ever close a kept connection.
                if not self._closed:
                    self._idle.append(session)
                    return
        _goodbye(session.smtp)

    def _reuse(self, deadline: _Deadline) -> _Session | None:
        """A kept connection, reset for a new message (RSET), or None."""
        while True:
            with self._idle_lock:
                session = self._idle.pop() if self._idle else None
            if session is None:
                return None
            if time.monotonic() - session.opened >= self.max_session_time:
                _goodbye(session.smtp)
                continue
            session.smtp.rebind(deadline)
            try:
                # rset() returns the relay's code instead of raising: a relay that hung up on
                # an idle connection says 421 first, and that must not count as a reset.
                code, _ = session.smtp.rset()
            except (smtplib.SMTPException, OSError):
                code = 0
            if code != 250:
                # Closed by the relay while idle (or broken): nothing of this message went.
                session.smtp.close()
                deadline.left()  # past the deadline: a TimeoutError, no new connection
                continue
            return session

    def _open(self, deadline: _Deadline) -> _Session:
        smtp = _DeadlineSMTP(deadline)
        try:
            smtp.connect(self.host, self.port)
            if self.starttls:
                smtp.starttls(context=ssl.create_default_context())
            if self.username:
                smtp.login(self.username, self.password or "")
        except BaseException:
            smtp.close()
            raise
        self.connections += 1
        return _Session(smtp, time.monotonic())

    def idle_sessions(self) -> int:
        """Connections kept open between sends."""
        with self._idle_lock:
            return len(self._idle)

    async def aclose(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        with self._idle_lock:
            self._closed = True
            idle, self._idle = self._idle, []
        if not idle:
            return
        # Goodbyes in threads, all at once, each bounded by its deadline: QUIT blocks on the
        # relay, and the event loop must not wait on a relay that stopped answering.
        bound = min(1.0, self.timeout)
        goodbyes = [
            asyncio.ensure_future(asyncio.to_thread(_goodbye_within, s.smtp, bound)) for s in idle
        ]
        _, late = await asyncio.wait(goodbyes, timeout=bound + SMTP_GRACE)
        for future in late:
            future.add_done_callback(_ignore_result)


def _goodbye_within(smtp: _DeadlineSMTP, seconds: float) -> None:
    smtp.rebind(_Deadline(seconds))
    _goodbye(smtp)


def _goodbye(smtp: smtplib.SMTP) -> None:
    with contextlib.suppress(smtplib.SMTPException, OSError, TimeoutError):
        smtp.quit()
    smtp.close()


def _ignore_result(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()  # retrieved: no "exception was never retrieved" warning


def _decode(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _smtp_text(recipients: dict[str, tuple[int, bytes]]) -> str:
    return "; ".join(f"{rcpt}: {code} {_decode(text)}" for rcpt, (code, text) in recipients.items())


# --- log ------------------------------------------------------------------------------------


class LogMailer:
    """The local default: one structured log line per email, counted as sent."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self.log = logger or logging.getLogger("cronlock.mail")

    async def send(self, message: Email) -> SendResult:
        self.log.info(
            "email to %s",
            message.recipient,
            extra={
                "event": "email",
                "idempotency_key": message.idempotency_key,
                "from": message.sender,
                "to": message.recipient,
                "subject": message.subject,
                "text": message.body,
            },
        )
        return SendResult.sent(f"log:{message.idempotency_key}")

    async def aclose(self) -> None:
        return None
