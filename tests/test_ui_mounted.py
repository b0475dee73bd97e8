"""`cron.dashboard` mounted in a host FastAPI app of its own: two Cronlocks (two schemas) at
two paths of one app, each dashboard's links, redirects and cookies under its own mount; the
host's exception handlers and middleware do not change its answers; not running is a 503 page.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from http.cookiejar import Cookie
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from cronlock import Cronlock, Settings
from cronlock.ops import views
from cronlock.service import create_app
from cronlock.web.ui.session import CSP
from tests.support import TEST_SECRET
from tests.support.asgi import InProcess, serve
from tests.support.ui import READ_TOKEN, csrf_of

OTHER_SECRET = "the-other-cronlocks-secret-0123456789-abcdefghij"
# Every URL a page gives a browser: links, forms, the style sheet and the script.
URL = re.compile(r'(?<![\w-])(?:href|action|src)="([^"]*)"')

MakeSettings = Callable[..., Settings]


def host_app(*crons: Cronlock, start: bool = True) -> FastAPI:
    """An app of the user's own: its lifespan, its routes, its error handlers and a middleware
    that would answer any exception in its own shape; each cron's router, then its dashboard
    under the router's prefix (`<prefix>/ui`)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            for cron in crons if start else ():
                await stack.enter_async_context(cron.running())
            yield

    app = FastAPI(lifespan=lifespan)

    @app.get("/hello")
    async def hello() -> dict[str, str]:
        return {"hello": "world"}

    @app.exception_handler(StarletteHTTPException)
    async def host_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return JSONResponse({"host": exc.status_code}, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def host_error(request: Request, exc: Exception) -> Response:
        return JSONResponse({"host": "error"}, status_code=500)

    @app.middleware("http")
    async def host_middleware(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        try:
            return await call_next(request)
        except Exception:
            return JSONResponse({"host": "middleware"}, status_code=500)

    for cron in crons:
        # The router first: its catch-all under the prefix leaves `<prefix>/ui` to the mount.
        app.include_router(cron.router)
        app.mount(f"{cron.prefix}/ui", cron.dashboard)
    return app


@pytest.fixture
def two_crons(make_settings: MakeSettings) -> tuple[Cronlock, Cronlock]:
    common: dict[str, Any] = {"cron_read_token": READ_TOKEN, "ui_cookie_secure": False}
    one = Cronlock(make_settings(instance_name="host-one", **common))
    other = Cronlock(
        make_settings(
            instance_name="host-other",
            db_schema="cron_other",
            cron_secret=OTHER_SECRET,
            **common,
        ),
        prefix="/other",
    )
    return one, other


@contextlib.asynccontextmanager
async def browser(app: FastAPI, *ready: Cronlock) -> AsyncIterator[httpx.AsyncClient]:
    """The host app served in-process, once each of `ready` is (its migrations applied), and
    one browser's worth of cookies against it."""
    async with (
        serve(app, "host") as served,
        httpx.AsyncClient(transport=served.transport, base_url=served.url) as http,
    ):
        for cron in ready:
            for _ in range(500):
                if await cron.ready():
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError(f"{cron.settings.db_schema}: not ready")
        yield http


async def login(http: httpx.AsyncClient, mount: str, token: str) -> httpx.Response:
    form = await http.get(f"{mount}/login")
    assert form.status_code == 200
    return await http.post(f"{mount}/login", data={"csrf": csrf_of(form.text), "token": token})


async def act(http: httpx.AsyncClient, mount: str, path: str, **fields: str) -> httpx.Response:
    csrf = csrf_of((await http.get(f"{mount}/")).text)
    return await http.post(f"{mount}{path}", data={"csrf": csrf, **fields})


def set_cookie(response: httpx.Response, name: str) -> dict[str, str]:
    """The attributes of the response's Set-Cookie for `name` (its value as `value`)."""
    for header in response.headers.get_list("set-cookie"):
        first, *rest = (part.strip() for part in header.split(";"))
        key, _, value = first.partition("=")
        if key == name:
            attributes = dict(a.partition("=")[::2] for a in rest)
            return {"value": value, **attributes}
    raise AssertionError(f"no Set-Cookie for {name}: {response.headers}")


def cookies_named(http: httpx.AsyncClient, name: str) -> dict[str, Cookie]:
    return {c.path: c for c in http.cookies.jar if c.name == name}


def urls(html: str) -> list[str]:
    return URL.findall(html)


async def test_two_dashboards_in_one_app_each_under_its_mount(
    two_crons: tuple[Cronlock, Cronlock], db: asyncpg.Connection
) -> None:
    one, other = two_crons
    async with browser(host_app(one, other), one, other) as http:
        for mount in ("/cron/ui", "/other/ui"):
            r = await http.get(f"{mount}/")
            assert (r.status_code, r.headers["location"]) == (303, f"{mount}/login")
            assert (await http.post(f"{mount}/jobs/fast/pause")).status_code == 401
        # The mount point without its slash: the host's router sends it below the mount.
        r = await http.get("/cron/ui")
        assert r.status_code == 307
        assert r.headers["location"].endswith("/cron/ui/")

        # Login: the form, its cookie and the session's, all under the mount.
        form = await http.get("/cron/ui/login")
        assert form.headers["content-security-policy"] == CSP
        assert set_cookie(form, "cronlock_login")["Path"] == "/cron/ui"
        assert urls(form.text) == [
            "/cron/ui/static/ui.css",
            "/cron/ui/static/ui.js",
            "/cron/ui/",
            "/cron/ui/login",
        ]
        assert (await http.get("/cron/ui/static/ui.css")).status_code == 200
        # Each dashboard takes its own Cronlock's tokens.
        assert (await login(http, "/cron/ui", OTHER_SECRET)).status_code == 401
        r = await login(http, "/cron/ui", TEST_SECRET)
        assert (r.status_code, r.headers["location"]) == (303, "/cron/ui/")
        session = set_cookie(r, "cronlock_session")
        assert session["Path"] == "/cron/ui"
        assert {"HttpOnly", "SameSite"} <= session.keys()

        # A page: every URL in it is under the mount.
        page = await http.get("/cron/ui/")
        assert page.status_code == 200
        assert page.headers["cache-control"] == "no-store"
        found = urls(page.text)
        assert "/cron/ui/jobs/fast" in found
        assert "/cron/ui/logout" in found
        assert all(u.startswith("/cron/ui/") for u in found), found
        # The other dashboard has not seen that session: its cookie is for /cron/ui only.
        assert (await http.get("/other/ui/")).status_code == 303
        r = await login(http, "/other/ui", OTHER_SECRET)
        assert (r.status_code, r.headers["location"]) == (303, "/other/ui/")
        assert set_cookie(r, "cronlock_session")["Path"] == "/other/ui"
        assert set(cookies_named(http, "cronlock_session")) == {"/cron/ui", "/other/ui"}
        other_page = await http.get("/other/ui/jobs/fast")
        assert other_page.status_code == 200
        assert all(u.startswith("/other/ui/") for u in urls(other_page.text))

        # An action: the pause is the first Cronlock's, in its schema, and redirects under it.
        r = await act(http, "/cron/ui", "/jobs/fast/pause", note="deploy", until="")
        assert (r.status_code, r.headers["location"]) == (303, "/cron/ui/jobs/fast?notice=paused")
        assert "paused by ui (secret)" in (await http.get("/cron/ui/")).text
        assert "paused by ui (secret)" not in (await http.get("/other/ui/")).text
        skipped = await http.post("/cron/fast", headers={"Authorization": f"Bearer {TEST_SECRET}"})
        assert skipped.json()["reason"] == "paused"
        ran = await http.post("/other/fast", headers={"Authorization": f"Bearer {OTHER_SECRET}"})
        assert "run_id" in ran.json()

        # Logout ends that dashboard's session only, its cookie cleared under its mount.
        r = await act(http, "/cron/ui", "/logout")
        assert (r.status_code, r.headers["location"]) == (303, "/cron/ui/login")
        cleared = set_cookie(r, "cronlock_session")
        assert (cleared["value"], cleared["Path"], cleared["Max-Age"]) == ("", "/cron/ui", "0")
        assert (await http.get("/cron/ui/")).status_code == 303
        assert (await http.get("/other/ui/")).status_code == 200
        # The host's own routes are untouched.
        assert (await http.get("/hello")).json() == {"hello": "world"}

    assert await db.fetchval("SELECT count(*) FROM cronlock.ui_sessions") == 0
    assert await db.fetchval("SELECT count(*) FROM cron_other.ui_sessions") == 1
    actions = await db.fetch("SELECT action FROM cronlock.ui_actions")
    assert [a["action"] for a in actions] == ["pause"]
    assert await db.fetchval("SELECT count(*) FROM cron_other.ui_actions") == 0


async def test_the_hosts_handlers_and_middleware_do_not_change_its_answers(
    make_settings: MakeSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    cron = Cronlock(make_settings(instance_name="host", ui_cookie_secure=False))
    async with browser(host_app(cron), cron) as http:
        await login(http, "/cron/ui", TEST_SECRET)

        async def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("a bug")

        monkeypatch.setattr(views, "locks", broken)
        for method, path, status in [
            ("GET", "/cron/ui/no-such-page", 404),
            ("GET", "/cron/ui/static/nothing.css", 404),
            ("GET", "/cron/ui/logout", 405),
            ("GET", "/cron/ui/jobs/no-such-job", 404),
            ("GET", "/cron/ui/runs/abc", 422),
            ("GET", "/cron/ui/locks", 500),
        ]:
            r = await http.request(method, path)
            assert r.status_code == status, path
            assert r.headers["content-type"].startswith("text/html"), path
            assert r.headers["content-security-policy"] == CSP, path
            assert '{"host"' not in r.text, path
            assert 'href="/cron/ui/"' in r.text, path
        assert (await http.get("/cron/ui/logout")).headers["allow"] == "POST"
        # The host's own answers stay the host's.
        assert (await http.get("/nope")).json() == {"host": 404}


async def test_not_running_is_a_503_page(make_settings: MakeSettings) -> None:
    cron = Cronlock(make_settings(instance_name="idle"))
    async with browser(host_app(cron, start=False)) as http:
        for path in ["/cron/ui/login", "/cron/ui/", "/cron/ui/jobs/fast"]:
            r = await http.get(path)
            assert r.status_code == 503, path
            assert r.headers["content-type"].startswith("text/html")
            assert r.headers["retry-after"] == "5"
            assert r.headers["content-security-policy"] == CSP
            assert "cronlock is not running" in r.text
        # Its style sheet still loads, for that page.
        assert (await http.get("/cron/ui/static/ui.css")).status_code == 200


async def test_the_service_behind_a_root_path(make_settings: MakeSettings) -> None:
    """`uvicorn --root-path /api`: the server puts the prefix in front of every path; the
    dashboard at /ui then lives at /api/ui, links and cookies with it."""
    app = create_app(make_settings(cron_jobs="tests.jobs", ui_cookie_secure=False))

    async def rooted(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope = {**scope, "root_path": "/api", "path": "/api" + scope["path"]}
        await app(scope, receive, send)

    async with serve(rooted, "rooted") as served:
        http = httpx.AsyncClient(transport=served.transport, base_url=served.url)
        async with http:
            await _wait_ready(served, http)
            r = await http.get("/ui/")
            assert r.headers["location"] == "/api/ui/login"
            r = await http.get("/ui")
            assert r.headers["location"] == "/api/ui/login"
            form = await http.get("/ui/login")
            assert set_cookie(form, "cronlock_login")["Path"] == "/api/ui"
            assert "/api/ui/login" in urls(form.text)
            # The client asks for /ui/...: its jar keeps a cookie of /api/ui to itself.
            login_cookie = set_cookie(form, "cronlock_login")["value"]
            r = await http.post(
                "/ui/login",
                data={"csrf": csrf_of(form.text), "token": TEST_SECRET},
                headers={"Cookie": f"cronlock_login={login_cookie}"},
            )
            assert r.headers["location"] == "/api/ui/"
            assert set_cookie(r, "cronlock_session")["Path"] == "/api/ui"


async def _wait_ready(served: InProcess, http: httpx.AsyncClient) -> None:
    for _ in range(500):
        if (await http.get("/readyz")).status_code == 200:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{served.name}: not ready")
