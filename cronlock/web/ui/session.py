"""The dashboard's sessions: rows in `<DB_SCHEMA>.ui_sessions`, checked before routing.

A session is made by logging in with the read token (kind `read`: see) or the cron secret
(kind `secret`: also act). The cookie carries a random value; the row holds only its hash, the
kind, a fingerprint of the token used and the session's CSRF token. Every request under /ui/
(but the login page and static files) looks its row up, so a logout ends the session on every
instance at once; a session whose token fingerprint is no longer among the configured tokens'
(the token was rotated away) is refused and deleted.

The cookie is scoped to `Path=/ui`, HttpOnly, SameSite=Strict, and Secure unless
UI_COOKIE_SECURE=false; the Bearer check (cronlock/web/auth.py) never reads it, so it is worth
nothing on /cron/* or /metrics.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from starlette.requests import cookie_parser
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cronlock.db.pool import Conn, Database
from cronlock.errors import DatabaseUnavailable
from cronlock.ops.views import reading
from cronlock.settings import Settings
from cronlock.sql import qualify
from cronlock.web.auth import matches, route_path

log = logging.getLogger("cronlock.ui")

COOKIE = "cronlock_session"
# The login form's CSRF token travels in this cookie and in the form (double submit): there
# is no session yet to hold it.
LOGIN_COOKIE = "cronlock_login"

Kind = Literal["read", "secret"]

# Every answer under /ui/: no script or style but our own files, never in a frame, nothing
# stored by a cache (pages carry data). SVG is drawn inline, styled by classes.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
]
NO_STORE = (b"cache-control", b"no-store")

CREATE_SQL = """
INSERT INTO {schema}.ui_sessions (id_hash, kind, token_fingerprint, csrf_token, expires_at)
VALUES ($1, $2, $3, $4, now() + make_interval(secs => $5))
"""
LOOKUP_SQL = """
SELECT kind, token_fingerprint, csrf_token FROM {schema}.ui_sessions
WHERE id_hash = $1 AND expires_at > now()
"""
DELETE_SQL = "DELETE FROM {schema}.ui_sessions WHERE id_hash = $1"
# Expired sessions and those made with a token that is no longer configured (rotation).
PRUNE_SQL = """
DELETE FROM {schema}.ui_sessions
WHERE expires_at <= now() OR NOT (token_fingerprint = ANY($1::bytea[]))
"""
# The record of actions is kept as long as the run history is (LEDGER_RETENTION_DAYS).
PRUNE_ACTIONS_SQL = """
DELETE FROM {schema}.ui_actions WHERE at < now() - make_interval(secs => $1)
"""
RECORD_SQL = """
INSERT INTO {schema}.ui_actions (kind, action, target, detail) VALUES ($1, $2, $3, $4)
"""


@dataclass(frozen=True)
class Session:
    kind: Kind
    csrf: str
    id_hash: bytes

    @property
    def can_act(self) -> bool:
        return self.kind == "secret"


def fingerprint(token: bytes) -> bytes:
    """What a session keeps of its token: enough to tell it is still configured, not the
    token (which is long and random, so a plain hash cannot be turned back)."""
    return hashlib.sha256(b"cronlock-ui-session:" + token).digest()


def _hash_id(value: str) -> bytes:
    return hashlib.sha256(value.encode()).digest()


def configured(settings: Settings) -> dict[Kind, list[bytes]]:
    """The tokens that may log in, by kind: the cron secret (current and previous) acts."""
    read = settings.cron_read_token
    return {
        "secret": settings.secrets(),
        "read": [read.get_secret_value().encode()] if read is not None else [],
    }


def fingerprints(settings: Settings) -> list[bytes]:
    return [fingerprint(t) for tokens in configured(settings).values() for t in tokens]


def identify(settings: Settings, presented: str) -> Kind | None:
    """Which kind of token `presented` is, in constant time (every candidate compared)."""
    token = presented.strip().encode()
    # Every kind compared, not the first match returned: timing shows no kind either.
    found = [kind for kind, tokens in configured(settings).items() if matches(token, tokens)]
    return found[0] if found else None


async def create(conn: Conn, settings: Settings, kind: Kind, presented: str) -> tuple[str, str]:
    """A new session row; returns the cookie's value and the session's CSRF token."""
    value = secrets.token_urlsafe(32)
    csrf = secrets.token_urlsafe(32)
    schema = settings.db_schema
    await conn.execute(qualify(PRUNE_SQL, schema), fingerprints(settings))
    await conn.execute(qualify(PRUNE_ACTIONS_SQL, schema), settings.ledger_retention_days * 86400)
    await conn.execute(
        qualify(CREATE_SQL, schema),
        _hash_id(value),
        kind,
        fingerprint(presented.strip().encode()),
        csrf,
        settings.ui_session_ttl,
    )
    return value, csrf


async def lookup(conn: Conn, settings: Settings, value: str) -> Session | None:
    """The live session of a cookie's value; a session of a rotated token is deleted."""
    id_hash = _hash_id(value)
    row = await conn.fetchrow(qualify(LOOKUP_SQL, settings.db_schema), id_hash)
    if row is None:
        return None
    if bytes(row["token_fingerprint"]) not in fingerprints(settings):
        await conn.execute(qualify(DELETE_SQL, settings.db_schema), id_hash)
        return None
    return Session(kind=row["kind"], csrf=row["csrf_token"], id_hash=id_hash)


async def end(conn: Conn, settings: Settings, session: Session) -> None:
    await conn.execute(qualify(DELETE_SQL, settings.db_schema), session.id_hash)


async def record(
    conn: Conn,
    settings: Settings,
    session: Session,
    action: str,
    target: str | None,
    **detail: Any,
) -> None:
    """Keep what was done (in `ui_actions`) and log it, with the kind of token, never the
    token itself."""
    await conn.execute(
        qualify(RECORD_SQL, settings.db_schema),
        session.kind,
        action,
        target,
        # The pool's jsonb codec encodes; through JSON first so datetimes become text.
        json.loads(json.dumps(detail, default=str)),
    )
    log.info(
        "ui action %s", action, extra={"action": action, "target": target, "token": session.kind}
    )


def same(expected: str, presented: str | None) -> bool:
    """A presented CSRF token against the expected one, in constant time."""
    return presented is not None and hmac.compare_digest(presented.encode(), expected.encode())


def csrf_ok(session: Session, presented: str | None) -> bool:
    return same(session.csrf, presented)


def cookie_header(settings: Settings, root_path: str, name: str, value: str, max_age: int) -> str:
    """A Set-Cookie value: only under /ui, never readable by scripts, never sent cross-site."""
    parts = [
        f"{name}={value}",
        f"Path={root_path}/ui",
        f"Max-Age={max_age}",
        "HttpOnly",
        "SameSite=Strict",
    ]
    if settings.ui_cookie_secure:
        parts.append("Secure")
    return "; ".join(parts)


def is_ui_path(path: str) -> bool:
    return path == "/ui" or path.startswith("/ui/")


def is_open_path(path: str) -> bool:
    return path == "/ui/login" or path.startswith("/ui/static/")


def request_cookie(scope: Scope, name: str) -> str | None:
    for key, value in scope["headers"]:
        if key == b"cookie":
            found = cookie_parser(value.decode("latin-1")).get(name)
            if found:
                return found
    return None


class SessionCheck:
    """Before routing, as `BearerAuth` is: every /ui/ path but the login page and static files
    needs a live session (else a redirect to the login page, or 401 for anything but a page
    read). Adds the security headers to every /ui/ answer. Sits inside BearerAuth, which lets
    /ui/ through to it (cronlock/web/auth.py, Access.SESSION); any other path (a trigger) it
    passes on after one look at the path."""

    def __init__(self, app: ASGIApp, *, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        if not is_ui_path(path):
            await self.app(scope, receive, send)
            return
        static = path.startswith("/ui/static/")

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.extend(SECURITY_HEADERS)
                if not static:
                    headers.append(NO_STORE)
                message["headers"] = headers
            await send(message)

        if not is_open_path(path):
            try:
                session = await self._session(scope)
            except DatabaseUnavailable as exc:
                await _plain(with_headers, 503, f"database unavailable: {exc.reason}")
                return
            if session is None:
                if scope["method"] in ("GET", "HEAD"):
                    root = scope.get("root_path", "")
                    await _redirect(with_headers, f"{root}/ui/login")
                else:
                    await _plain(with_headers, 401, "log in first: no session")
                return
            scope.setdefault("state", {})["ui_session"] = session
        await self.app(scope, receive, with_headers)

    async def _session(self, scope: Scope) -> Session | None:
        value = request_cookie(scope, COOKIE)
        if value is None or len(value) > 200:
            return None
        db: Database = scope["state"]["db"]
        async with db.connection() as conn, reading(conn):
            return await lookup(conn, self.settings, value)


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
