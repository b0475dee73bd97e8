"""The app in the test's own process, for tests where no process boundary is under test.

`serve(app, name)` runs the app's lifespan as a server does (the ASGI lifespan protocol, its
state handed to every request) and yields an `InProcess` whose `url` a `Dispatch` client sends
over httpx.ASGITransport; every other URL goes over the network to real processes. What the
app logs while serving is kept, as JSON lines (LOG_FORMAT=json), for `InProcess.log()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

import httpx

from cronlock.logs import JsonFormatter

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Any  # FastAPI, or any ASGI callable

HOST_SUFFIX = ".in-process"
STARTUP_TIMEOUT = 30.0

# Which in-process app a log record came from: set around its lifespan (its background tasks
# inherit it) and around each request it serves.
_serving: contextvars.ContextVar[str | None] = contextvars.ContextVar("serving", default=None)


class LifespanError(RuntimeError):
    """The app's lifespan startup failed; the message is the app's."""


class InProcess:
    """One app served in this process: `url` for a `Dispatch` client, its log lines kept."""

    def __init__(self, name: str, app: ASGIApp, state: dict[str, Any]) -> None:
        self.name = name
        self.url = f"http://{name}{HOST_SUFFIX}"
        self._app = app
        self._state = state
        self.lines: list[str] = []
        self.transport = httpx.ASGITransport(
            app=self._with_state,
            # As uvicorn: an exception after the error answer was sent is logged, not raised
            # into the client.
            raise_app_exceptions=False,
        )

    async def _with_state(self, scope: Scope, receive: Any, send: Any) -> None:
        # As a server does: each request gets a shallow copy of the lifespan's state.
        scope = {**scope, "state": dict(self._state)}
        token = _serving.set(self.name)
        try:
            await self._app(scope, receive, send)
        finally:
            _serving.reset(token)

    def log(self) -> str:
        return "\n".join(self.lines) + ("\n" if self.lines else "")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.lines[-lines:]) or "(empty log)"


class _Keep(logging.Handler):
    def __init__(self, served: InProcess) -> None:
        super().__init__()
        self.served = served
        self.setFormatter(JsonFormatter())

    def filter(self, record: logging.LogRecord) -> bool:
        return _serving.get() == self.served.name

    def emit(self, record: logging.LogRecord) -> None:
        self.served.lines.append(self.format(record))


@contextlib.asynccontextmanager
async def serve(app: ASGIApp, name: str, log_level: str = "INFO") -> AsyncIterator[InProcess]:
    """Start `app`'s lifespan, yield it as an `InProcess`, shut it down on the way out."""
    state: dict[str, Any] = {}
    served = InProcess(name, app, state)
    handler = _Keep(served)
    logger = logging.getLogger("cronlock")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(log_level.upper())
    events: asyncio.Queue[Message] = asyncio.Queue()
    answers: asyncio.Queue[Message] = asyncio.Queue()
    events.put_nowait({"type": "lifespan.startup"})

    async def receive() -> Message:
        return await events.get()

    async def send(message: Message) -> None:
        await answers.put(message)

    scope: Scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": state}
    # The app's startup collects, then freezes what exists for the life of its process
    # (app.main). Here that process is the test session: what it holds already is frozen
    # first, so that collection has only the app to walk (a tenth of a second less a start),
    # and all of it is given back to the collector when the app stops.
    gc.freeze()
    token = _serving.set(name)
    try:
        task = asyncio.create_task(app(scope, receive, send), name=f"lifespan-{name}")
    finally:
        _serving.reset(token)
    try:
        started = await _answer(answers, task, STARTUP_TIMEOUT)
        if started["type"] != "lifespan.startup.complete":
            raise LifespanError(started.get("message", "") or f"{name}: startup failed")
        try:
            yield served
        finally:
            events.put_nowait({"type": "lifespan.shutdown"})
            await task
    finally:
        if not task.done():
            task.cancel()
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await task  # a failed startup's exception is LifespanError's message already
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        gc.unfreeze()


async def _answer(
    answers: asyncio.Queue[Message], task: asyncio.Task[None], within: float
) -> Message:
    """The lifespan's next message, or its exception if it ended without one."""
    getter = asyncio.ensure_future(answers.get())
    done, _ = await asyncio.wait(
        {getter, task}, timeout=within, return_when=asyncio.FIRST_COMPLETED
    )
    if getter in done:
        return getter.result()
    getter.cancel()
    if task in done:
        task.result()  # raises what the lifespan raised
        raise LifespanError("the lifespan returned without answering startup")
    raise LifespanError(f"lifespan startup did not finish within {within} s")


# conftest's `start_app` fixture: `await start_app(name, **settings)`.
StartApp = Callable[..., Awaitable[InProcess]]


class Dispatch(httpx.AsyncBaseTransport):
    """Requests to an in-process app's `url` go to it; any other URL over the network."""

    def __init__(self, **network: Any) -> None:
        self.apps: dict[str, InProcess] = {}
        self.network = httpx.AsyncHTTPTransport(**network)

    def add(self, served: InProcess) -> None:
        self.apps[httpx.URL(served.url).host] = served

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        served = self.apps.get(request.url.host)
        if served is not None:
            return await served.transport.handle_async_request(request)
        if request.url.host.endswith(HOST_SUFFIX):
            raise httpx.ConnectError(f"no in-process app {request.url.host}", request=request)
        return await self.network.handle_async_request(request)

    async def aclose(self) -> None:
        await self.network.aclose()
