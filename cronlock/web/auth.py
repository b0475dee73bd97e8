"""Bearer authentication, checked before routing (an ASGI middleware), in constant time.

Checking before routing means an unauthenticated caller learns nothing, not even which jobs
exist: every `/cron/` path and the OpenAPI document answer 401 first. Fail closed: only the
health checks are open; any other path, known or not, needs a token.
"""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import Sequence
from enum import Enum

from starlette.types import ASGIApp, Receive, Scope, Send

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
    the secret nor which of the current or previous secret matched."""
    found = False
    for candidate in candidates:
        found |= hmac.compare_digest(token, candidate)
    return found


class BearerAuth:
    def __init__(
        self,
        app: ASGIApp,
        *,
        run_tokens: Sequence[bytes],
        read_tokens: Sequence[bytes] = (),
        metrics_tokens: Sequence[bytes] = (),
        sessions: bool = False,
    ) -> None:
        if not run_tokens:
            raise ValueError("no cron secret: refusing to serve jobs without one")
        self.app = app
        self.sessions = sessions
        self.tokens = {
            Access.RUN: list(run_tokens),
            Access.READ: [*run_tokens, *read_tokens],
            Access.METRICS: [*run_tokens, *read_tokens, *metrics_tokens],
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            # No route speaks WebSocket: refuse the handshake rather than pass it on unchecked.
            await receive()
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":  # lifespan
            await self.app(scope, receive, send)
            return
        access = required_access(scope["method"], route_path(scope))
        if access is Access.SESSION:
            access = Access.OPEN if self.sessions else Access.RUN
        if access is not Access.OPEN:
            header = None
            for name, value in scope["headers"]:
                if name == b"authorization":
                    header = value
                    break
            token = bearer_token(header)
            if token is None or not matches(token, self.tokens[access]):
                await _unauthorized(send)
                return
        await self.app(scope, receive, send)


async def _unauthorized(send: Send) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(UNAUTHORIZED)).encode()),
                (b"www-authenticate", b"Bearer"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": UNAUTHORIZED})
