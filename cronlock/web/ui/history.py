"""The runs page (`/runs`): the newest runs across every job, with the newest failures above
them, what Oban Web and good_job open on; filtered by status ("failures": failed, timed out
or abandoned) and job, 50 a page, keyset by run id as the job page's list is."""

from __future__ import annotations

from urllib.parse import urlencode

from fastapi import APIRouter, Request
from fastapi.responses import Response

from cronlock.ops import views as ops
from cronlock.web.ui import words
from cronlock.web.ui.pages import Refused, guarded, page, positive_int, state_of

# What the page counts as a failure: a run that ended without its work done, by itself (an
# operator's cancel is not one).
FAILURES = ("failed", "timed_out", "abandoned")
PAGE = 50
# The newest failures shown above the unfiltered list.
RECENT_FAILURES = 10

router = APIRouter(include_in_schema=False)


@router.get("/runs")
async def runs_page(request: Request) -> Response:
    async def render() -> Response:
        db, registry, settings = state_of(request)
        q = request.query_params
        show = q.get("status") or ""
        if show not in ("", "failures", *ops.RUN_STATUSES):
            raise Refused(422, "Invalid status filter.")
        job = q.get("job") or None
        if job is not None and job not in registry:
            raise Refused(404, "No such job.")
        before = positive_int(q.get("before"), "page cursor")
        statuses = FAILURES if show == "failures" else (show,) if show else None
        async with db.connection() as conn:
            await ops.sweep(conn, settings)  # runs whose holder is gone are closed first
            async with ops.reading(conn):
                held = await ops.locks(conn, registry)
                found = await ops.runs(
                    conn,
                    registry,
                    job=job,
                    statuses=statuses,
                    before=before,
                    limit=PAGE,
                    held=held,
                )
                failures = None
                if not show and before is None:
                    failures = await ops.runs(
                        conn,
                        registry,
                        job=job,
                        statuses=FAILURES,
                        limit=RECENT_FAILURES,
                        held=held,
                    )
                now = await conn.fetchval(ops.NOW_SQL)
        filters = {"status": show, "job": job or ""}
        next_query = urlencode({**filters, "before": found.next}) if found.next else None
        return page(
            request,
            "runs.html",
            live=True,
            words=words,
            now=now,
            runs=found.runs,
            failures=failures.runs if failures is not None else None,
            filters=filters,
            statuses=ops.RUN_STATUSES,
            jobs=sorted(registry),
            next_query=next_query,
        )

    return await guarded(request, render)
