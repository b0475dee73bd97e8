"""The dashboard's retry of a failed fan-out run's failed items, one or all, from the failed
items on its run page (cronlock/web/ui/pages.py `run_page`): made as the API's
(cronlock/core/fanout_retry.py), with the same CSRF check, right to act and record as the
dashboard's other actions; a refusal is a page saying why (404, 409, 422)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from cronlock.core import fanout_retry
from cronlock.core.runner import Runner
from cronlock.inputs import INT_MAX
from cronlock.ops import views as ops
from cronlock.web.ui import session
from cronlock.web.ui.pages import Refused, acting, back, guarded, positive_int, state_of

router = APIRouter(include_in_schema=False)


async def _retry(request: Request, run_id: str, n: str | None) -> Response:
    """A retry of a failed fan-out run's failed items (all of them, or item `n`), made as the
    API's (cronlock/core/fanout_retry.py); then the new attempt's page."""
    db, _, settings = state_of(request)
    current, _ = await acting(request)
    found_id = positive_int(run_id, "run id")
    assert found_id is not None
    item = None
    if n is not None:
        if not (n.isascii() and n.isdigit()) or int(n) > INT_MAX:
            raise Refused(422, "Invalid item number: 0 or a positive integer is expected.")
        item = int(n)
    runner: Runner = request.state.runner
    done = await fanout_retry.retry_items(runner.fanouts, found_id, item, source="ui")
    async with db.connection() as conn, ops.reading(conn):
        await session.record(
            conn,
            settings,
            current,
            "retry-items",
            str(found_id),
            item=item,
            run_id=done.run_id,
            retried=done.retried,
        )
    return back(request, f"/runs/{done.run_id}", "items-retried")


@router.post("/runs/{run_id}/items/retry")
async def retry_failed_items(request: Request, run_id: str) -> Response:
    return await guarded(request, lambda: _retry(request, run_id, None))


@router.post("/runs/{run_id}/items/{n}/retry")
async def retry_failed_item(request: Request, run_id: str, n: str) -> Response:
    return await guarded(request, lambda: _retry(request, run_id, n))
