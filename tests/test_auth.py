"""The Bearer check on its own: parsing, constant-time matching, which paths need what."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import pytest

from cronlock.web.auth import (
    Access,
    BearerAuth,
    bearer_token,
    matches,
    required_access,
    route_path,
)

SECRET = b"s" * 40


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

    auth = BearerAuth(app, run_tokens=[SECRET])
    headers = [(b"authorization", b"Bearer " + SECRET)]
    scope = {"type": "websocket", "path": "/cron/jobs", "root_path": "", "headers": headers}
    await auth(scope, receive, send)
    assert reached == []
    assert sent == [{"type": "websocket.close", "code": 1008}]
