"""Bearer authentication, checked before routing (an ASGI middleware), in constant time.

Checking before routing means an unauthenticated caller learns nothing, not even which jobs
exist: every `/cron/` path and the OpenAPI document answer 401 first. Fail closed: only the
health checks are open; any other path, known or not, needs a token.

Every surface asks one `Tokens` object, built once at start from checked settings and kept in
the app's state: the Bearer check (triggers, read routes, metrics) and the dashboard's logins
and sessions (cronlock/web/ui/session.py). CRON_SECRET_FILE is read then and never again, so a file
truncated, rotated or removed while the service runs changes nothing until a restart, and the
API and the dashboard always accept the same tokens (docs/operating.md, "Rotating the secret").
"""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import Sequence
from enum import Enum
from typing import Literal, Protocol

from starlette.types import ASGIApp, Receive, Scope, Send

from cronlock.settings import MIN_SECRET_LENGTH, Settings

UNAUTHORIZED = json.dumps({"error": "Unauthorized"}).encode()


class Access(Enum):
    RUN = "run"  # trigger jobs, cancel: the cron secret only
    READ = "read"  # jobs, runs, locks, the OpenAPI document: the secret or the read token
    METRICS = "metrics"  # /metrics: its own token, or any of the above
    OPEN = "open"  # health checks
    # The dashboard (/ui/): its own session check decides (cronlock/web/ui/dashboard.py), not a
    # Bearer token; without the dashboard (UI_ENABLED=false) these paths need the secret.
    SESSION = "session"


OPEN_PATHS = ("/healthz", "/readyz")
READ_PATHS = ("/cron/jobs", "/cron/runs", "/cron/locks", "/openapi.json", "/docs", "/redoc")
# A dynamic job's schedules, and one of them (cronlock/web/schedules.py): read with a GET.
SCHEDULE_PATH = re.compile(r"^/cron/jobs/[^/]+/schedules(/[^/]+)?$")


def required_access(method: str, path: str) -> Access:
    """What a request needs, by its route path (see `route_path`)."""
    if path in OPEN_PATHS:
        return Access.OPEN
    if path == "/metrics":
        return Access.METRICS
    if path == "/ui" or path.startswith("/ui/"):
        return Access.SESSION
    if method in ("GET", "HEAD") and (
        path in READ_PATHS
        or path.startswith(("/cron/runs/", "/docs/"))
        or SCHEDULE_PATH.match(path) is not None
    ):
        return Access.READ
    return Access.RUN


def route_path(scope: Scope) -> str:
    """The path the app routes on: without the `root_path` the server was started with
    (`uvicorn --root-path`), which ASGI servers put in front of `path`; as Starlette's router
    strips it. Checking the raw path instead would let `/prefix/cron/<job>` reach a job."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if not root or not path.startswith(root):
        return path
    if path == root:
        return ""
    return path[len(root) :] if path[len(root)] == "/" else path


def bearer_token(header: bytes | None) -> bytes | None:
    """The token of `Authorization: Bearer <token>`; the scheme is case-insensitive (RFC 9110),
    anything else (no token, two spaces, a second word) is malformed."""
    if not header:
        return None
    scheme, sep, token = header.partition(b" ")
    if not sep or scheme.lower() != b"bearer" or not token or b" " in token or b"\t" in token:
        return None
    return token


def matches(token: bytes, candidates: Sequence[bytes]) -> bool:
    """Constant time in the token, and every candidate is compared, so timing reveals neither
    the secret nor which of the current or previous secret matched. An empty or short token
    never matches, whatever is configured: no configured token may be that short, so refusing
    it at once reveals nothing."""
    if len(token) < MIN_SECRET_LENGTH:
        return False
    found = False
    for candidate in candidates:
        found |= hmac.compare_digest(token, candidate)
    return found


# A dashboard session's kind: made with the cron secret (`secret`: also act) or the read token.
Kind = Literal["read", "secret"]


class Tokens:
    """The tokens this service accepts, by what they may do: the one source every surface
    asks (see the module's docstring). Build it with `from_settings`, which reads and checks
    them once; never holds an empty or short token."""

    def __init__(
        self,
        run: Sequence[bytes],
        read: Sequence[bytes] = (),
        metrics: Sequence[bytes] = (),
    ) -> None:
        if not run:
            raise ValueError("no cron secret: refusing to serve jobs without one")
        if any(len(t) < MIN_SECRET_LENGTH for t in (*run, *read, *metrics)):
            raise ValueError(f"a token is shorter than {MIN_SECRET_LENGTH} characters")
        self.by_access = {
            Access.RUN: (*run,),
            Access.READ: (*run, *read),
            Access.METRICS: (*run, *read, *metrics),
        }
        self.by_kind: dict[Kind, tuple[bytes, ...]] = {"secret": (*run,), "read": (*read,)}

    @classmethod
    def from_settings(cls, settings: Settings) -> Tokens:
        """Read (CRON_SECRET_FILE too) and checked by the start-up rules, once; SettingsError
        when they do not hold."""
        named = settings.checked_tokens()

        def of(*names: str) -> list[bytes]:
            return [named[name] for name in names if name in named]

        return cls(
            run=of("CRON_SECRET", "CRON_SECRET_PREVIOUS"),
            read=of("CRON_READ_TOKEN"),
            metrics=of("METRICS_TOKEN"),
        )

    def accepts(self, access: Access, token: bytes) -> bool:
        return matches(token, self.by_access[access])

    def kind(self, token: bytes) -> Kind | None:
        """Which kind of session `token` opens, in constant time: every kind is compared, not
        the first match returned, so timing shows no kind either."""
        found = [kind for kind, tokens in self.by_kind.items() if matches(token, tokens)]
        return found[0] if found else None

    def __repr__(self) -> str:  # never the tokens themselves
        counts = ", ".join(f"{a.value}={len(t)}" for a, t in self.by_access.items())
        return f"Tokens({counts})"


class Others(Protocol):
    """The trigger schemes besides the Bearer secret (cronlock/web/schemes.py `TriggerAuth`)."""

    challenge: str

    def offers_other(self, headers: Sequence[tuple[bytes, bytes]]) -> bool: ...


class BearerAuth:
    """The standalone service's check before routing. A trigger (`/cron/...`, needing RUN)
    carrying another TRIGGER_AUTH scheme's credential goes on to its route, which checks every
    scheme itself (as it does in a host app) and refuses what is not a trigger."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        tokens: Tokens,
        sessions: bool = False,
        triggers: Others | None = None,
        prefix: str = "/cron/",
    ) -> None:
        self.app = app
        self.sessions = sessions
        self.tokens = tokens
        self.triggers = triggers
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            # No route speaks WebSocket: refuse the handshake rather than pass it on unchecked.
            await receive()
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":  # lifespan
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        access = required_access(scope["method"], path)
        if access is Access.SESSION:
            access = Access.OPEN if self.sessions else Access.RUN
        if access is not Access.OPEN:
            header = None
            for name, value in scope["headers"]:
                if name == b"authorization":
                    header = value
                    break
            token = bearer_token(header)
            if token is None or not self.tokens.accepts(access, token):
                triggers = self.triggers
                if access is Access.RUN and triggers is not None and path.startswith(self.prefix):
                    if triggers.offers_other(scope["headers"]):
                        await self.app(scope, receive, send)
                        return
                    await _unauthorized(send, triggers.challenge)
                    return
                await _unauthorized(send)
                return
        await self.app(scope, receive, send)


async def _unauthorized(send: Send, challenge: str = "Bearer") -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(UNAUTHORIZED)).encode()),
                (b"www-authenticate", challenge.encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": UNAUTHORIZED})
