"""The app in this process, behind httpx's ASGI transport, its lifespan running as uvicorn
would run it: fast enough to send hundreds of requests, real PostgreSQL underneath."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from tests.util import AUTH


@contextlib.asynccontextmanager
async def in_process(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """A client of `app` (from `create_app`), authenticated with the test secret.

    httpx's transport does not run the lifespan, so this does, and hands every request a copy
    of its state, as uvicorn does (`request.state` is where the routes find the pool)."""
    try:
        async with app.router.lifespan_context(app) as state:

            async def with_state(scope: Scope, receive: Receive, send: Send) -> None:
                scope["state"] = dict(state or {})
                await app(scope, receive, send)

            transport = httpx.ASGITransport(with_state, raise_app_exceptions=False)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://cronlock.test", headers=AUTH, timeout=30
            ) as client:
                yield client
    finally:
        # The lifespan freezes what exists at start-up for the life of a process; a test
        # process starts many apps, and each would stay in memory for good.
        gc.unfreeze()
