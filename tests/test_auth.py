"""The Bearer check on its own: parsing, constant-time matching, which paths need what, the
one set of tokens every surface asks (and, with real instances, a secret file changed under a
running one)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from cronlock.settings import PLACEHOLDER_SECRET, Settings, SettingsError
from cronlock.web.auth import (
    Access,
    BearerAuth,
    Tokens,
    bearer_token,
    matches,
    required_access,
    route_path,
)
from tests.support import TEST_SECRET
from tests.support.cluster import Instance
from tests.support.ui import csrf_of

SECRET = b"s" * 40
FILE_SECRET = "cronlock-file-secret-0123456789-abcdefghijklmnop"
OLD_SECRET = "cronlock-old-secret-0123456789-abcdefghijklmnopq"


@pytest.mark.parametrize(
    ("header", "token"),
    [
        (b"Bearer abc", b"abc"),
        (b"bearer abc", b"abc"),
        (b"BEARER abc", b"abc"),
        (b"Bearer", None),
        (b"Bearer ", None),
        (b"Bearer  abc", None),
        (b"Bearer abc def", None),
        (b"Bearer\tabc", None),
        (b"Basic abc", None),
        (b"", None),
        (None, None),
        (b"Bearer \xc3\xa9t\xc3\xa9", b"\xc3\xa9t\xc3\xa9"),
    ],
)
def test_bearer_token_parsing(header: bytes | None, token: bytes | None) -> None:
    assert bearer_token(header) == token


def test_matches_any_candidate_and_nothing_else() -> None:
    assert matches(SECRET, [SECRET])
    assert matches(SECRET, [b"x" * 40, SECRET])
    assert not matches(SECRET + b"x", [SECRET])
    assert not matches(SECRET[:-1], [SECRET])
    assert not matches(b"", [SECRET])
    assert not matches(SECRET, [])
    # Non-ASCII bytes are compared like any others: no exception, no match.
    assert not matches("é".encode() * 20, [SECRET])


@pytest.mark.parametrize("token", [b"", b"x", b"s" * 31])
def test_an_empty_or_short_token_never_matches_whatever_is_configured(token: bytes) -> None:
    """Even against itself: no configuration, checked or not, lets a short token in."""
    assert not matches(token, [token])
    assert not matches(token, [token, SECRET])


def test_tokens_hold_no_short_token_and_never_show_one() -> None:
    with pytest.raises(ValueError, match="no cron secret"):
        Tokens([])
    for short in (b"", b"x", b"r" * 31):
        with pytest.raises(ValueError, match="shorter than 32"):
            Tokens([SECRET], read=[short])
    tokens = Tokens([SECRET], read=[b"r" * 40], metrics=[b"m" * 40])
    assert repr(tokens) == "Tokens(run=1, read=2, metrics=3)"
    assert tokens.accepts(Access.RUN, SECRET)
    assert not tokens.accepts(Access.RUN, b"r" * 40)
    assert tokens.accepts(Access.READ, b"r" * 40)
    assert tokens.accepts(Access.METRICS, b"m" * 40)
    assert not tokens.accepts(Access.READ, b"m" * 40)
    assert (tokens.kind(SECRET), tokens.kind(b"r" * 40), tokens.kind(b"m" * 40)) == (
        "secret",
        "read",
        None,
    )


def test_the_secret_file_is_read_and_checked_once(tmp_path: Path) -> None:
    """What is checked is what is served: changing the file afterwards changes nothing."""
    path = tmp_path / "secret"
    path.write_text(FILE_SECRET + "\n")
    settings = Settings(_env_file=None, cron_secret_file=path, cron_secret_previous=OLD_SECRET)
    tokens = Tokens.from_settings(settings)
    for change in ("", "x", "n" * 40, None):
        if change is None:
            path.unlink()
        else:
            path.write_text(change)
        assert tokens.accepts(Access.RUN, FILE_SECRET.encode())
        assert tokens.accepts(Access.RUN, OLD_SECRET.encode())
        assert tokens.kind(FILE_SECRET.encode()) == "secret"
        assert not tokens.accepts(Access.RUN, b"n" * 40)
        assert tokens.kind(b"n" * 40) is None


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("", "shorter than 32"),
        ("\n", "shorter than 32"),
        ("x", "shorter than 32"),
        (PLACEHOLDER_SECRET, "placeholder"),
        ("caf\u00e9" * 10, "printable ASCII"),
        (None, "cannot be read"),
    ],
)
def test_a_bad_secret_file_refuses_to_start(
    tmp_path: Path, content: str | None, problem: str
) -> None:
    path = tmp_path / "secret"
    if content is not None:
        path.write_text(content)
    settings = Settings(_env_file=None, cron_secret_file=path)
    with pytest.raises(SettingsError, match=problem) as caught:
        Tokens.from_settings(settings)
    assert f"CRON_SECRET_FILE {path}" in str(caught.value)


@pytest.mark.parametrize(
    ("method", "path", "access"),
    [
        ("POST", "/cron/daily-digest", Access.RUN),
        ("GET", "/cron/daily-digest", Access.RUN),
        ("POST", "/cron/jobs", Access.RUN),
        ("GET", "/cron/jobs", Access.READ),
        ("GET", "/cron/runs", Access.READ),
        ("GET", "/cron/runs/12", Access.READ),
        ("GET", "/cron/locks", Access.READ),
        ("GET", "/openapi.json", Access.READ),
        ("GET", "/docs", Access.READ),
        ("GET", "/redoc", Access.READ),
        ("GET", "/metrics", Access.METRICS),
        ("GET", "/healthz", Access.OPEN),
        ("GET", "/readyz", Access.OPEN),
        ("GET", "/cron", Access.RUN),
        ("GET", "/cron/../openapi.json", Access.RUN),
        # Fail closed: whatever is not known to be open needs the secret.
        ("GET", "/", Access.RUN),
        ("GET", "/no-such-path", Access.RUN),
        ("GET", "/api/cron/jobs", Access.RUN),
        ("POST", "/healthz/", Access.RUN),
        ("POST", "/metrics", Access.METRICS),
        # The dashboard's own session check decides there (cronlock/web/ui/dashboard.py).
        ("GET", "/ui/", Access.SESSION),
        ("POST", "/ui/jobs/fast/run", Access.SESSION),
        ("GET", "/ui", Access.SESSION),
        ("GET", "/uix", Access.RUN),
        ("GET", "/cron/ui/", Access.RUN),
    ],
)
def test_required_access(method: str, path: str, access: Access) -> None:
    assert required_access(method, path) is access


@pytest.mark.parametrize(
    ("path", "root_path", "routed"),
    [
        ("/cron/fast", "", "/cron/fast"),
        ("/api/cron/fast", "/api", "/cron/fast"),
        ("/api", "/api", ""),
        ("/apix/cron/fast", "/api", "/apix/cron/fast"),
        ("/cron/fast", "/api", "/cron/fast"),
    ],
)
def test_route_path_drops_the_root_path(path: str, root_path: str, routed: str) -> None:
    assert route_path({"type": "http", "path": path, "root_path": root_path}) == routed


async def test_a_websocket_handshake_never_reaches_the_app() -> None:
    """No route speaks WebSocket: the handshake is refused before the app sees it, token or
    not, so a route added later cannot be reached around the Bearer check."""
    reached: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope["type"])

    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "websocket.connect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    auth = BearerAuth(app, tokens=Tokens([SECRET]))
    headers = [(b"authorization", b"Bearer " + SECRET)]
    scope = {"type": "websocket", "path": "/cron/jobs", "root_path": "", "headers": headers}
    await auth(scope, receive, send)
    assert reached == []
    assert sent == [{"type": "websocket.close", "code": 1008}]


# --- the secret file changed under a running instance (real processes) -----------------------

ROTATED = "cronlock-rotated-secret-0123456789-abcdefghijk"


async def dashboard_login(url: str, token: str) -> httpx.AsyncClient | None:
    """A browser's login with `token`: its client (cookies) if it got a session, else None;
    anything but 303 (in) or 401 (refused, on the login page) fails the test."""
    browser = httpx.AsyncClient(base_url=url, timeout=30)
    page = await browser.get("/ui/login")
    assert page.status_code == 200, page.text
    r = await browser.post("/ui/login", data={"csrf": csrf_of(page.text), "token": token})
    if r.status_code == 303:
        return browser
    assert r.status_code == 401, r.text
    assert "That token is not one this service accepts." in r.text
    await browser.aclose()
    return None


async def dashboard_acts(browser: httpx.AsyncClient) -> bool:
    """A session pauses and resumes a job (the right the cron secret gives)."""
    page = await browser.get("/ui/jobs/fast")
    assert page.status_code == 200, page.text
    csrf = csrf_of(page.text)
    done = []
    for action in ("pause", "resume"):
        r = await browser.post(f"/ui/jobs/fast/{action}", data={"csrf": csrf})
        assert r.status_code in (303, 401, 403), r.text
        done.append(r.status_code == 303 and f"notice={action}d" in r.headers["location"])
    return all(done)


async def gets_in(client: httpx.AsyncClient, url: str, token: str) -> dict[str, bool]:
    """Where `token` gets in on a real instance: a trigger, a read route, /metrics, a dashboard
    login and an action with its session. Never a 5xx."""
    # An empty token is sent as "Bearer" alone: HTTP clients refuse trailing whitespace.
    headers = {"Authorization": f"Bearer {token}".rstrip()}
    answers = {
        "trigger": await client.post(url + "/cron/fast", headers=headers),
        "jobs": await client.get(url + "/cron/jobs", headers=headers),
        "metrics": await client.get(url + "/metrics", headers=headers),
    }
    found = {}
    for surface, r in answers.items():
        assert r.status_code in (200, 401), (surface, r.status_code, r.text)
        found[surface] = r.status_code == 200
    browser = await dashboard_login(url, token)
    found["dashboard login"] = browser is not None
    found["dashboard action"] = browser is not None and await dashboard_acts(browser)
    if browser is not None:
        await browser.aclose()
    return found


async def test_a_secret_file_changed_under_a_running_instance_changes_nothing(
    start_instance: Callable[..., Instance], client: httpx.AsyncClient, tmp_path: Path
) -> None:
    """The file is read and checked once, at start: truncated, one character, rotated, removed,
    restored while the instance runs, the API and the dashboard accept exactly the secret it
    started with, never an empty or short token, and nothing answers 5xx or logs a
    traceback. (A new secret takes a restart: docs/configuration.md, rotating the secret.)"""
    path = tmp_path / "cron_secret"
    path.write_text(FILE_SECRET + "\n")
    env = {"CRON_SECRET": "", "CRON_SECRET_FILE": str(path), "UI_COOKIE_SECURE": "false"}
    instance = start_instance("i1", env)
    url = instance.url
    kept = await dashboard_login(url, FILE_SECRET)  # a session made before any change
    assert kept is not None
    changes: list[tuple[str, str | None]] = [
        ("as started", FILE_SECRET + "\n"),
        ("truncated", ""),
        ("one character", "x"),
        ("rotated", ROTATED + "\n"),
        ("removed", None),
        ("restored", FILE_SECRET + "\n"),
    ]
    try:
        for change, content in changes:
            if content is None:
                path.unlink()
            else:
                path.write_text(content)
            for token in (FILE_SECRET, ROTATED, "", "x", " ", "x" * 31):
                found = await gets_in(client, url, token)
                expected = token == FILE_SECRET
                assert found == dict.fromkeys(found, expected), (change, token, found)
            assert (await kept.get("/ui/")).status_code == 200, change
    finally:
        await kept.aclose()
    log = instance.log()
    assert "Traceback" not in log
    assert "unexpected error" not in log
    assert "Exception in ASGI application" not in log


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def post_large(port: int, path: str, size: int, *, declared: bool) -> int:
    """POST `size` bytes (declared with Content-Length, or chunked) over loopback, writing
    until the server has answered and stopped reading; the answer's status."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    framing = f"Content-Length: {size}" if declared else "Transfer-Encoding: chunked"
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
        f"{TEST_SECRET}\r\nContent-Type: application/json\r\n{framing}\r\n\r\n".encode()
    )
    chunk = b"{" * (1024 * 1024)
    answer = asyncio.create_task(reader.readline())

    async def send() -> None:
        for _ in range(size // len(chunk)):
            if answer.done():
                return
            writer.write(chunk if declared else b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()
        if not declared:
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    # The server may answer and close before all is sent: what a client sending too much sees.
    with contextlib.suppress(ConnectionError, OSError):
        await send()
    status_line = await asyncio.wait_for(answer, 30)
    writer.close()
    return int(status_line.split()[1])


async def test_a_100_mb_pause_body_is_413_and_costs_the_instance_no_memory(
    start_instance: Callable[..., Instance], client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """The pause route reads its body with the size-limited reader: 100 MB, declared or
    chunked, is a 413 and never held (the instance's resident memory barely moves)."""
    instance = start_instance("i1")
    size = 100 * 1024 * 1024
    path = "/cron/jobs/fast/pause"
    # Warm up (imports, the first request's allocations) before measuring.
    assert await post_large(instance.port, path, 1024 * 1024, declared=True) == 413
    before = rss_bytes(instance.pid)
    assert await post_large(instance.port, path, size, declared=True) == 413
    assert await post_large(instance.port, path, size, declared=False) == 413
    grown = rss_bytes(instance.pid) - before
    assert grown < 16 * 1024 * 1024, f"the instance grew by {grown / 2**20:.1f} MB"
    assert await db.fetchval("SELECT count(*) FROM cronlock.pauses") == 0
    r = await client.get(instance.url + "/readyz")
    assert r.status_code == 200
