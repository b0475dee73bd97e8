"""The service as bench/ runs it: cronlock's own app, plus two baseline routes the trigger
benchmark measures against, behind the cron secret like a trigger (BearerAuth wraps them).

  (a) POST /bench/constant   the framework alone (auth middleware included)
  (b) POST /bench/select1    one `SELECT 1` through the same pool a trigger uses

Served with `uvicorn --factory bench.app:create_app`; never part of the product.
"""

from __future__ import annotations

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, Response

from cronlock import service as main
from cronlock.errors import DatabaseUnavailable
from cronlock.web.deps import DatabaseDep, error

router = APIRouter(prefix="/bench", tags=["bench"], include_in_schema=False)


@router.post("/constant")
async def bench_constant() -> Response:
    """Baseline (a): the framework alone."""
    return JSONResponse({"job": "bench", "skipped": True, "reason": "constant"})


@router.post("/select1")
async def bench_select1(db: DatabaseDep) -> Response:
    """Baseline (b): one `SELECT 1` through the same pool a trigger uses."""
    try:
        conn = await db.acquire()
    except DatabaseUnavailable as exc:
        return error(503, "database unavailable", reason=exc.reason)
    try:
        value = await conn.fetchval("SELECT 1")
    finally:
        await db.release(conn)
    return JSONResponse({"job": "bench", "skipped": True, "reason": "select", "value": value})


def create_app() -> FastAPI:
    app = main.create_app()
    # Ahead of the catch-all /cron/{name} route does not matter: these live under /bench.
    app.include_router(router)
    return app
