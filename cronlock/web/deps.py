"""What route handlers get from the app's lifespan state, as `Annotated` dependencies."""

from __future__ import annotations

from typing import Annotated, Any, Protocol

from fastapi import Depends, Request
from fastapi.responses import JSONResponse

from cronlock.core.jobs import Registry
from cronlock.core.runner import Runner
from cronlock.db.pool import Database
from cronlock.settings import Settings
from cronlock.web.auth import Tokens
from cronlock.web.schemes import TriggerAuth

RETRY_AFTER_SECONDS = "5"


class Serving(Protocol):
    """What cronlock's routes are served by (a `Cronlock`): its settings, the tokens each kind
    of access accepts, and the objects a request of its routes finds in `request.state`."""

    @property
    def settings(self) -> Settings: ...

    @property
    def tokens(self) -> Tokens: ...

    @property
    def trigger_auth(self) -> TriggerAuth: ...

    def bind(self, request: Request) -> None: ...


# Async on purpose: FastAPI runs a plain `def` dependency in a worker thread, two thread hops
# per trigger for what is an attribute read (bench/trigger.py measured it as the largest cost
# of a skip).


async def get_runner(request: Request) -> Runner:
    runner: Runner = request.state.runner
    return runner


async def get_db(request: Request) -> Database:
    db: Database = request.state.db
    return db


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.state.settings
    return settings


async def get_registry(request: Request) -> Registry:
    registry: Registry = request.state.registry
    return registry


async def get_tokens(request: Request) -> Tokens:
    """The app's one set of accepted tokens (cronlock/web/auth.py): what a route that checks a token
    itself asks, as the Bearer check and the dashboard do."""
    tokens: Tokens = request.state.tokens
    return tokens


RunnerDep = Annotated[Runner, Depends(get_runner)]
DatabaseDep = Annotated[Database, Depends(get_db)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
RegistryDep = Annotated[Registry, Depends(get_registry)]
TokensDep = Annotated[Tokens, Depends(get_tokens)]


class RequestTooLarge(Exception):
    """A body past MAX_BODY_BYTES: every route that reads one reads it with `read_body`."""


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (RequestTooLarge) as soon as it is declared or streamed past `limit`:
    never more than `limit` bytes held, whatever the client sends."""
    declared = request.headers.get("content-length")
    if declared is not None and _declared_too_large(declared, limit):
        raise RequestTooLarge
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise RequestTooLarge
    return bytes(body)


def _declared_too_large(declared: str, limit: int) -> bool:
    # isascii: str.isdigit() is true for "²", which int() refuses. More digits than the limit
    # has is too large without converting them (int() refuses a string of 4300 digits).
    if not (declared.isascii() and declared.isdigit()):
        return False  # not a length: the body as streamed decides
    digits = declared.lstrip("0")
    return len(digits) > len(str(limit)) or int(digits or "0") > limit


def error(status: int, message: str, **extra: Any) -> JSONResponse:
    """Every error answer: `{"error": ..., **extra}`; a 503 says when to retry."""
    headers = {"Retry-After": RETRY_AFTER_SECONDS} if status == 503 else None
    return JSONResponse({"error": message, **extra}, status_code=status, headers=headers)
