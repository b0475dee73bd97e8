"""A host app as users write them, with cronlock mounted in its two lines: the app that
bench/embedded.py measures against the standalone service (bench/app.py).

  - two ordinary middlewares (CORS, GZip), a few routes of its own (before cron's, as an
    app that adds cronlock later has them), its own /readyz asking `cron.ready()`;
  - `Cronlock()` from the environment (CRON_JOBS=bench.jobs), `lifespan=cron.lifespan`,
    `include_router(cron.router)`, `cron.metrics` mounted at /ops/metrics;
  - (b') POST /bench/select1: the floor route of bench/app.py, on cron's pool, as one of the
    host's own routes (no token: the host's routes are the host's business).

`create_bare_app` is the two lines alone (`lifespan=cron.lifespan`, `include_router(cron.router)`,
plus the metrics and /readyz the benchmark reads): cronlock embedded with nothing of a host's
in front of it, to tell what embedding costs from what the host's own layers cost.

Logging is set up as the standalone service does it (one JSON line per trigger), so that both
apps pay for the same line. With HOST_GC_FREEZE=1 its lifespan ends its start-up with
`gc.collect(); gc.freeze()`, as the standalone service's does (docs/fastapi.md). Served with
`uvicorn --factory bench.host_app:create_app`; never part of the product.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.middleware.gzip import GZipMiddleware
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from cronlock import Cronlock, Settings, logs
from cronlock.errors import DatabaseUnavailable


class Item(BaseModel):
    id: int
    name: str


def configured() -> Cronlock:
    settings = Settings()
    logs.setup(settings.log_format, settings.log_level)
    return Cronlock(settings)


def readiness(cron: Cronlock) -> Callable[[], Awaitable[Response]]:
    async def readyz() -> Response:
        ready = await cron.ready()
        if not ready:
            return JSONResponse({"status": "not ready", "reason": ready.reason}, status_code=503)
        return JSONResponse({"status": "ready"})

    return readyz


def create_bare_app() -> FastAPI:
    cron = configured()
    app = FastAPI(title="a bare host app", lifespan=cron.lifespan)
    app.include_router(cron.router)
    app.add_api_route("/readyz", readiness(cron), methods=["GET"])
    app.mount("/ops/metrics", cron.metrics)
    return app


def create_app() -> FastAPI:
    cron = configured()

    @contextlib.asynccontextmanager
    async def frozen(app: FastAPI) -> AsyncIterator[None]:
        async with cron.lifespan(app):
            gc.collect()
            gc.freeze()
            yield

    freeze = os.environ.get("HOST_GC_FREEZE") == "1"
    app = FastAPI(title="a host app", lifespan=frozen if freeze else cron.lifespan)
    app.add_middleware(GZipMiddleware, minimum_size=500)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=["https://app.example.com"],
        allow_methods=["*"],
        allow_headers=["*"],
        allow_credentials=True,
    )

    @app.get("/")
    async def home() -> dict[str, str]:
        return {"app": "host"}

    @app.get("/items/{item_id}")
    async def get_item(item_id: int) -> Item:
        return Item(id=item_id, name=f"item {item_id}")

    @app.post("/items")
    async def create_item(item: Item) -> Item:
        return item

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    app.add_api_route("/readyz", readiness(cron), methods=["GET"])

    bench = APIRouter(prefix="/bench", include_in_schema=False)

    @bench.post("/select1")
    async def bench_select1() -> Response:
        """Baseline (b'): one `SELECT 1` through cron's pool, as a host route."""
        db = cron.database
        if db is None:
            return JSONResponse({"error": "cron is not running"}, status_code=503)
        try:
            conn = await db.acquire()
        except DatabaseUnavailable as exc:
            return JSONResponse({"error": "database unavailable", "reason": exc.reason}, 503)
        try:
            value = await conn.fetchval("SELECT 1")
        finally:
            await db.release(conn)
        return JSONResponse({"job": "bench", "skipped": True, "reason": "select", "value": value})

    app.include_router(bench)
    app.include_router(cron.router)
    app.mount("/ops/metrics", cron.metrics)
    return app
