"""What route handlers get from the app's lifespan state, as `Annotated` dependencies."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Protocol

from fastapi import Depends, Request
from fastapi.responses import JSONResponse

from cronlock.core.jobs import Registry
from cronlock.core.runner import Runner
from cronlock.db.pool import Database
from cronlock.settings import Settings
from cronlock.web.auth import Access

RETRY_AFTER_SECONDS = "5"


class Serving(Protocol):
    """What cronlock's routes are served by (a `Cronlock`): its settings, the tokens each kind
    of access accepts, and the objects a request of its routes finds in `request.state`."""

    @property
    def settings(self) -> Settings: ...

    def tokens(self, access: Access) -> Sequence[bytes]: ...

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


RunnerDep = Annotated[Runner, Depends(get_runner)]
DatabaseDep = Annotated[Database, Depends(get_db)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
RegistryDep = Annotated[Registry, Depends(get_registry)]


def error(status: int, message: str, **extra: Any) -> JSONResponse:
    """Every error answer: `{"error": ..., **extra}`; a 503 says when to retry."""
    headers = {"Retry-After": RETRY_AFTER_SECONDS} if status == 503 else None
    return JSONResponse({"error": message, **extra}, status_code=status, headers=headers)
