"""The Bearer check on its own: parsing, constant-time matching, which paths need what, the
one set of tokens every surface asks (and, with real instances, a secret file changed under a
running one)."""

from __future__ import annotations

from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import pytest

from app.auth import (
    Access,
    BearerAuth,
    Tokens,
    bearer_token,
    matches,
    required_access,
    route_path,
)
from app.settings import PLACEHOLDER_SECRET, Settings, SettingsError

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
        # The dashboard's own session check decides there (app/ui/session.py).
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
