"""A real local HTTP server standing in for a Resend-compatible email API.

It serves HTTP/1.1 (keep-alive) from an asyncio loop in a thread of its own, so senders in
other processes can hit it concurrently and the test thread stays free; one loop rather than
a thread per connection keeps it fast under the GIL. It records every request with its
idempotency key and its exact body bytes, and honours `Idempotency-Key` like Resend: the
first accepted request for a key is a delivery; a later one with the same bytes gets the same
id and is not delivered again; one that arrives while another with the key is in progress
gets 409 (`concurrent_idempotent_requests`).

A request is accepted (delivered) when it arrives, before its answer is written, so a sender
killed while waiting for the answer has still delivered: exactly the case idempotency keys
exist for. Tests can script answers per key (500, 429 with Retry-After, 409, 400, slow), slow
every answer down, or hold all answers until released. Every method is thread-safe.

`POST /emails/batch` behaves as Resend documents it: a JSON array of up to 100 emails, one
`Idempotency-Key` for the whole batch (the same key and body: the same answer, nothing sent
again; the same key and another body: 409 `invalid_idempotent_request`), `x-batch-validation`
`strict` (the default: one invalid email refuses the whole batch with 422) or `permissive`
(the valid emails are sent; `data` lists their ids in order, `errors` one `{index, message}`
per invalid one). With `rate` set, the limit is a strict window, as Resend enforces it: a
request (on either endpoint) that would make more than `rate` requests taken in the last
second gets 429 with `Retry-After` (refused requests do not count). Every answer then carries
Resend's `ratelimit-limit`, `ratelimit-remaining` (after this request) and `ratelimit-reset`
(whole seconds until the oldest request in the window leaves it). `spend(n)` takes n requests
of the window as another client on the same API key would. `emails()` counts accepted emails
per (recipient, subject): the tests' subjects name the slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

REASONS = {200: "OK", 400: "Bad Request", 409: "Conflict", 422: "Unprocessable Entity"}
REASONS |= {429: "Too Many Requests", 500: "Internal Server Error", 503: "Service Unavailable"}

MAX_BATCH = 100
# What this stand-in accepts as an address: something@domain.tld, no spaces.
ADDRESS = re.compile(r"[^@\s<>]+@[^@\s<>]+\.[^@\s<>]+")


@dataclass(frozen=True)
class Reply:
    """A scripted answer: a status, an optional Retry-After, and how long to take."""

    status: int = 200
    retry_after: str | None = None
    delay: float = 0.0
    body: str | None = None


@dataclass(frozen=True)
class Request:
    key: str | None
    body: bytes
    method: str
    path: str
    headers: dict[str, str]  # lower-cased names
    status: int
    delivered: bool  # this request delivered the email (the key's first acceptance)
    message_id: str | None
    received: float  # time.monotonic() in the test process
    answered: float
    emails: int = 0  # emails this request delivered (1 for a delivered single send)

    def json(self) -> Any:
        return json.loads(self.body)


class Provider:
    def __init__(self, *, delay: float = 0.0, rate: float | None = None) -> None:
        self.delay = delay
        # Requests per second (None: unlimited), in any one-second window; no slack.
        self.rate = rate
        self._taken: deque[float] = deque()  # arrival times of requests in the window
        self.limited = 0  # requests answered 429 by the rate limit
        self._batches: dict[str, tuple[bytes, int, str]] = {}  # key -> (body, status, answer)
        self._emails: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()
        self._requests: list[Request] = []
        self._accepted: dict[str, tuple[bytes, str]] = {}  # key -> (body, message id)
        self._in_progress: Counter[str] = Counter()
        self._scripts: dict[str | None, deque[Reply]] = {}
        self._slow_keys: dict[str, float] = {}
        self._in_flight = 0
        self._ids = 0
        self._loop = asyncio.new_event_loop()
        self._open = asyncio.Event()  # answers flow while set (see hold/release)
        self._thread = threading.Thread(target=self._serve, name="provider", daemon=True)
        self._ready = threading.Event()
        self._server: asyncio.Server | None = None
        self._port = 0

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def start(self) -> Provider:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("provider did not start")
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop_serving)
            self._thread.join(timeout=10)

    def __enter__(self) -> Provider:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.close()

    async def _main(self) -> None:
        self._open.set()
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        self._port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        with contextlib.suppress(asyncio.CancelledError):
            await self._server.serve_forever()
        # Connections still open (keep-alive) are closed with the loop.
        for task in asyncio.all_tasks() - {asyncio.current_task()}:
            task.cancel()
        await asyncio.sleep(0)

    def _stop_serving(self) -> None:
        self._open.set()
        if self._server is not None:
            self._server.close()
            for task in asyncio.all_tasks(self._loop):
                task.cancel()

    # -- steering ----------------------------------------------------------------------------

    def script(self, key: str | None, *replies: Reply) -> None:
        """Answer the next requests for `key` (None: for any key) with these, in order."""
        with self._lock:
            self._scripts.setdefault(key, deque()).extend(replies)

    def slow(self, key: str, seconds: float) -> None:
        """Every answer for `key` takes this long (after the key was accepted)."""
        with self._lock:
            self._slow_keys[key] = seconds

    def hold(self) -> None:
        """Accept requests but keep every answer back until `release()`."""
        self._loop.call_soon_threadsafe(self._open.clear)

    def release(self) -> None:
        self._loop.call_soon_threadsafe(self._open.set)

    # -- what happened -----------------------------------------------------------------------

    @property
    def requests(self) -> list[Request]:
        """Answered requests, in the order they were answered."""
        with self._lock:
            return list(self._requests)

    @property
    def in_flight(self) -> int:
        """Requests received and not answered yet."""
        with self._lock:
            return self._in_flight

    def received(self) -> int:
        """Requests received so far, answered or not."""
        with self._lock:
            return len(self._requests) + self._in_flight

    def emails(self) -> Counter[tuple[str, str]]:
        """Accepted emails per (recipient, subject), over both endpoints."""
        with self._lock:
            return Counter(self._emails)

    def batch_requests(self) -> list[Request]:
        return [r for r in self.requests if r.path == "/emails/batch"]

    def delivered(self) -> Counter[str]:
        """Deliveries per key: a correct sender never makes any count exceed 1."""
        with self._lock:
            return Counter(r.key for r in self._requests if r.delivered and r.key)

    def accepted_keys(self) -> set[str]:
        """Keys delivered so far, including requests whose answer has not been written yet."""
        with self._lock:
            return set(self._accepted)

    def for_key(self, key: str) -> list[Request]:
        return [r for r in self.requests if r.key == key]

    def wait(self, predicate: Callable[[Provider], bool], timeout: float, what: str) -> None:
        """Block the calling (test) thread until `predicate(self)` holds."""
        deadline = time.monotonic() + timeout
        while not predicate(self):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}")
            time.sleep(0.01)

    # -- serving -----------------------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request_line = await reader.readline()
                if not request_line:
                    return
                method, path, _ = request_line.decode("latin-1").split(" ", 2)
                headers: dict[str, str] = {}
                while True:
                    line = await reader.readline()
                    if line in (b"\r\n", b"\n", b""):
                        break
                    name, _, value = line.decode("latin-1").partition(":")
                    headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                status, extra, payload = await self._answer(method, path, headers, body)
                head = [f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}"]
                head += ["Content-Type: application/json", f"Content-Length: {len(payload)}"]
                head += [f"{name}: {value}" for name, value in extra.items()]
                writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + payload)
                await writer.drain()
                if headers.get("connection", "").lower() == "close":
                    return
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            return
        finally:
            writer.close()

    async def _answer(
        self, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        received = time.monotonic()
        key = headers.get("idempotency-key")
        delivered = False
        message_id: str | None = None
        reply: Reply | None = None
        emails = 0
        extra: dict[str, str] = {}
        with self._lock:
            self._in_flight += 1
            wait = self._rate_limited(received)
            extra.update(self._rate_headers(received))
            busy = wait is None and key is not None and self._in_progress[key] > 0
            if wait is not None:
                self.limited += 1
                status, text = 429, json.dumps({"name": "rate_limit_exceeded"})
                extra["Retry-After"] = str(max(1, math.ceil(wait)))
            elif busy:
                status, text = 409, json.dumps({"name": "concurrent_idempotent_requests"})
            else:
                if key is not None:
                    self._in_progress[key] += 1
                reply = self._next_script(key)
                if reply is not None and not 200 <= reply.status < 300:
                    status = reply.status
                    text = reply.body or json.dumps({"name": "scripted", "statusCode": status})
                elif path == "/emails/batch":
                    validation = headers.get("x-batch-validation", "strict")
                    status, text, emails = self._accept_batch(key, body, validation)
                    delivered = emails > 0
                else:
                    status, message_id, delivered = self._accept(key, body)
                    text = json.dumps(
                        {"id": message_id} if message_id else {"name": "invalid_idempotent_request"}
                    )
                    emails = int(delivered)
            delay = max(
                self.delay, reply.delay if reply else 0.0, self._slow_keys.get(key or "", 0.0)
            )
        try:
            if delay:
                await asyncio.sleep(delay)
            await self._open.wait()
        finally:
            with self._lock:
                self._in_flight -= 1
                if key is not None and not busy and wait is None:
                    self._in_progress[key] -= 1
                self._requests.append(
                    Request(
                        key=key,
                        body=body,
                        method=method,
                        path=path,
                        headers=headers,
                        status=status,
                        delivered=delivered,
                        message_id=message_id,
                        received=received,
                        answered=time.monotonic(),
                        emails=emails,
                    )
                )
        if reply and reply.retry_after:
            extra["Retry-After"] = reply.retry_after
        return status, extra, text.encode()

    def spend(self, count: int) -> None:
        """Take `count` requests of the current window, as another client on the same API
        key would (they are not recorded as requests)."""
        with self._lock:
            self._taken.extend([time.monotonic()] * count)

    def _limit(self) -> int:
        return max(1, int(self.rate or 1))

    def _rate_limited(self, now: float) -> float | None:
        """With the lock held: None if the request may pass (it is counted in the window),
        else the seconds until the oldest request in the window leaves it."""
        if self.rate is None:
            return None
        while self._taken and self._taken[0] <= now - 1.0:
            self._taken.popleft()
        if len(self._taken) < self._limit():
            self._taken.append(now)
            return None
        return self._taken[0] + 1.0 - now

    def _rate_headers(self, now: float) -> dict[str, str]:
        """With the lock held, after `_rate_limited`: Resend's headers for this answer."""
        if self.rate is None:
            return {}
        reset = math.ceil(self._taken[0] + 1.0 - now) if self._taken else 0
        return {
            "ratelimit-limit": str(self._limit()),
            "ratelimit-remaining": str(max(0, self._limit() - len(self._taken))),
            "ratelimit-reset": str(reset),
        }

    def _accept_batch(self, key: str | None, body: bytes, validation: str) -> tuple[int, str, int]:
        """Resend's batch rules, with the lock held: (status, answer, emails delivered)."""
        if key is not None and key in self._batches:
            seen_body, seen_status, seen_answer = self._batches[key]
            if seen_body != body:
                return 409, json.dumps({"name": "invalid_idempotent_request"}), 0
            return seen_status, seen_answer, 0
        try:
            items = json.loads(body)
        except ValueError:
            return 400, json.dumps({"name": "invalid_body"}), 0
        if not isinstance(items, list) or not 0 < len(items) <= MAX_BATCH:
            error = {"name": "validation_error", "message": f"1 to {MAX_BATCH} emails"}
            return 422, json.dumps(error), 0
        errors = [
            {"index": i, "message": problem}
            for i, item in enumerate(items)
            if (problem := _invalid(item)) is not None
        ]
        if errors and validation != "permissive":
            # Strict: the whole batch is refused, with the (first) error that refused it.
            return 422, json.dumps({"name": "validation_error", **errors[0]}), 0
        bad = {e["index"] for e in errors}
        data = []
        for i, item in enumerate(items):
            if i in bad:
                continue
            self._ids += 1
            data.append({"id": f"msg_{self._ids}"})
            self._emails[(item["to"], item["subject"])] += 1
        document: dict[str, Any] = {"data": data}
        if validation == "permissive":
            document["errors"] = errors
        answer = json.dumps(document)
        if key is not None:
            self._batches[key] = (body, 200, answer)
        return 200, answer, len(data)

    def _next_script(self, key: str | None) -> Reply | None:
        for which in (key, None):
            queue = self._scripts.get(which)
            if queue:
                return queue.popleft()
        return None

    def _accept(self, key: str | None, body: bytes) -> tuple[int, str | None, bool]:
        """Resend's idempotency rules, with the lock held: (status, message id, delivered)."""
        if key is not None and key in self._accepted:
            seen_body, seen_id = self._accepted[key]
            if seen_body != body:
                return 409, None, False
            return 200, seen_id, False
        self._ids += 1
        message_id = f"msg_{self._ids}"
        if key is not None:
            self._accepted[key] = (body, message_id)
        with contextlib.suppress(ValueError, KeyError, TypeError):
            document = json.loads(body)
            self._emails[(document["to"], document["subject"])] += 1
        return 200, message_id, True


def _invalid(item: Any) -> str | None:
    """Why a batch member would be refused (None: valid)."""
    if not isinstance(item, dict):
        return "an email must be an object"
    for field in ("from", "to", "subject"):
        if not isinstance(item.get(field), str) or not item[field]:
            return f"The `{field}` field is missing."
    if not ADDRESS.fullmatch(item["to"]):
        return f"Invalid `to` field: {item['to']!r}"
    for field in ("attachments", "tags", "scheduled_at"):
        if field in item:
            return f"The `{field}` field is not supported in batches."
    return None
