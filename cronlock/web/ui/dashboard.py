"""`cron.dashboard`: the dashboard as one ASGI app a host mounts where it likes.

```python
app.mount("/cron/ui", cron.dashboard)      # the standalone service: app.mount("/ui", ...)
```

Everything in it is relative to where it is mounted (the ASGI `root_path` a mount sets):
links, form actions, redirects, static files, and the cookies' `Path`, so two dashboards (two
`Cronlock`s) mounted at two paths of one app keep separate sessions. What it answers is decided
here, whatever the host registered:

- **Its objects per request**: `serving.bind()` puts its Cronlock's settings, jobs, pool and
  runner into the request's state (a copy: the host's is not touched); when that Cronlock is
  not running, a 503 page says so.
- **The session check before routing**: every path but the login page and static files needs a
  live session (else a redirect to the login page for a page read, 401 for anything else), so
  no 404 tells a stranger which pages exist.
- **Its own headers** (the CSP and the others of cronlock/web/ui/session.py) on every answer.
- **Its own error pages**: a 404, a 405, and anything unexpected become its pages inside it
  (the inner app's handlers), never an exception the host's handlers or middleware would
  answer in their own shape.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles
from starlette.types import Message, Receive, Scope, Send

from cronlock.db.pool import Database
from cronlock.errors import DatabaseUnavailable
from cronlock.ops.views import reading
from cronlock.web.answers import Refused as NotRunning
from cronlock.web.auth import route_path
from cronlock.web.ui import actions, history, items, pages, schedules, session
from cronlock.web.ui.session import NO_STORE, SECURITY_HEADERS, Session

if TYPE_CHECKING:
    from cronlock.web.deps import Serving

log = logging.getLogger("cronlock.ui")

STATIC = "/static/"
NOT_RUNNING = (
    "cronlock is not running: the app's lifespan does not start it (cron.lifespan, or "
    "`async with cron.running():` in the app's own)."
)


def is_open_path(path: str) -> bool:
    """The login page and the static files: no session needed (a path inside the mount)."""
    return path == "/login" or path.startswith(STATIC)


class Dashboard:
    """The dashboard of one `Cronlock` (see the module docstring)."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self.app = _pages()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            # A lifespan (served on its own, not mounted), or a WebSocket the inner app refuses.
            await self.app(scope, receive, send)
            return
        # A state of its own: the host's stays as it was, another Cronlock's objects never mix.
        state = dict(scope.get("state") or {})
        state["settings"] = self.serving.settings
        state["ui_root"] = scope.get("root_path", "")
        scope = {**scope, "state": state}
        path = route_path(scope)
        static = path.startswith(STATIC)

        started = False

        async def with_headers(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = list(message.get("headers", []))
                headers.extend(SECURITY_HEADERS)
                if not static:
                    headers.append(NO_STORE)
                message["headers"] = headers
            await send(message)

        try:
            await self._answer(scope, receive, with_headers, path)
        except Exception:
            # The inner app's handler answered with a page and logged it, then re-raised (as
            # Starlette's error middleware does): it stops here, where the host's middleware
            # and handlers would otherwise see it once more.
            if not started:
                log.exception("ui: unexpected error on %s %s", scope["method"], scope["path"])
                await pages.problem(Request(scope), 500, "Something went wrong on our side.")(
                    scope, receive, with_headers
                )

    async def _answer(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        """Bind, check the session, then route (the login page and static files need none)."""
        state = scope["state"]
        if not path.startswith(STATIC):
            try:
                self.serving.bind(Request(scope))
            except NotRunning:
                await pages.problem(Request(scope), 503, NOT_RUNNING, retry=True)(
                    scope, receive, send
                )
                return
        if not is_open_path(path):
            try:
                found = await _session(scope)
            except DatabaseUnavailable as exc:
                await _plain(send, 503, f"database unavailable: {exc.reason}")
                return
            if found is None:
                if scope["method"] in ("GET", "HEAD"):
                    await _redirect(send, f"{state['ui_root']}/login")
                else:
                    await _plain(send, 401, "log in first: no session")
                return
            state["ui_session"] = found
            if path == "":
                # The mount point itself, without its slash (the service routes `/ui` here).
                await pages.back(Request(scope), "/")(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _pages() -> FastAPI:
    """The pages and the static files, with an error page for whatever they do not answer."""

    async def not_answered(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        response = pages.problem(request, exc.status_code, str(exc.detail))
        response.headers.update(exc.headers or {})
        return response

    async def invalid(request: Request, exc: Exception) -> Response:
        return pages.problem(request, 422, "The request could not be read.")

    async def unexpected(request: Request, exc: Exception) -> Response:
        log.error("ui: unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
        return pages.problem(request, 500, "Something went wrong on our side.")

    app = FastAPI(
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
        exception_handlers={
            HTTPException: not_answered,
            RequestValidationError: invalid,
            Exception: unexpected,
        },
    )
    app.router.routes.append(
        Mount(STATIC.rstrip("/"), StaticFiles(packages=[("cronlock.web.ui", "static")]))
    )
    app.include_router(pages.router)
    app.include_router(schedules.router)
    app.include_router(actions.router)
    app.include_router(items.router)
    app.include_router(history.router)
    return app


async def _session(scope: Scope) -> Session | None:
    value = session.request_cookie(scope, session.COOKIE)
    if value is None or len(value) > 200:
        return None
    state = scope["state"]
    db: Database = state["db"]
    async with db.connection() as conn, reading(conn):
        return await session.lookup(conn, state["settings"], state["tokens"], value)


async def _plain(send: Send, status: int, text: str) -> None:
    body = text.encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _redirect(send: Send, location: str) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 303,
            "headers": [(b"location", location.encode()), (b"content-length", b"0")],
        }
    )
    await send({"type": "http.response.body", "body": b""})
