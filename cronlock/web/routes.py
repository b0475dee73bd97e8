"""The operator's read routes: jobs, runs, locks and metrics, over the views of
cronlock/ops/views.py (which the CLI shows too). Routes only: what they show is computed in ops, and
our errors become answers in cronlock/web/api.py's exception handlers (DatabaseUnavailable: 503)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query
from pydantic import AfterValidator

from cronlock.core.jobs import MAX_KEY_LENGTH, NAME_PATTERN
from cronlock.inputs import BIGINT_MAX, check_text
from cronlock.ops.views import (
    JobsView,
    LocksView,
    RunsPage,
    RunStatus,
    RunView,
    jobs,
    locks,
    reading,
    run,
    runs,
    sweep,
)
from cronlock.web.answers import CronRoute
from cronlock.web.deps import DatabaseDep, RegistryDep, SettingsDep, error

# CronRoute: each route answers its own errors (cronlock/web/answers.py).
router = APIRouter(tags=["operations"], route_class=CronRoute)

UNAVAILABLE: dict[int | str, dict[str, Any]] = {
    503: {"description": "database unavailable (Retry-After)"}
}

# OpenAPI links: how a client (and a stateful fuzzer) goes from one answer to the next
# request. A trigger's 202 links here too (cronlock/web/api.py).
GET_RUN = "get_run"
RUN_LINK: dict[str, Any] = {
    "operationId": GET_RUN,
    "parameters": {"run_id": "$response.body#/run_id"},
    "description": "the run this answer names",
}
RUNS_LINKS: dict[str, Any] = {
    "NextPage": {
        "operationId": "get_runs",
        "parameters": {"before": "$response.body#/next"},
        "description": "the next (older) page",
    },
    "NewestRun": {
        "operationId": GET_RUN,
        "parameters": {"run_id": "$response.body#/runs/0/id"},
        "description": "the newest run of this page",
    },
}


@router.get("/jobs", response_model=JobsView, responses=UNAVAILABLE)
async def get_jobs(db: DatabaseDep, registry: RegistryDep, settings: SettingsDep) -> Any:
    """Every registered job: schedule, current and next slot, last run, running now (from
    pg_locks) and where, and whether it is overdue."""
    async with db.connection() as conn:
        await sweep(conn, settings)
        async with reading(conn):
            return await jobs(conn, registry)


@router.get(
    "/runs",
    response_model=RunsPage,
    operation_id="get_runs",
    responses={200: {"links": RUNS_LINKS}, **UNAVAILABLE},
)
async def get_runs(
    db: DatabaseDep,
    registry: RegistryDep,
    settings: SettingsDep,
    # Validated here, before any statement: what the database would refuse as a data
    # exception is a 422 naming the parameter (see cronlock/inputs.py).
    job: Annotated[str | None, Query(pattern=NAME_PATTERN.pattern, description="a job name")] = (
        None
    ),
    status: RunStatus | None = None,
    key: Annotated[
        str | None,
        Query(max_length=MAX_KEY_LENGTH, description="a keyed job's key, e.g. 42"),
        AfterValidator(check_text),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    before: Annotated[
        int | None, Query(ge=1, le=BIGINT_MAX, description="the `next` of the previous page")
    ] = None,
) -> Any:
    """Run history, newest first, one page at a time."""
    async with db.connection() as conn:
        await sweep(conn, settings, job)
        async with reading(conn, input_from=("query",)):
            return await runs(
                conn, registry, job=job, status=status, before=before, limit=limit, key=key
            )


@router.get(
    "/runs/{run_id}",
    response_model=RunView,
    operation_id=GET_RUN,
    responses={404: {"description": "no such run"}, **UNAVAILABLE},
)
async def get_run(
    run_id: Annotated[int, Path(ge=1, le=BIGINT_MAX, description="a run id (bigint)")],
    db: DatabaseDep,
    registry: RegistryDep,
    settings: SettingsDep,
) -> Any:
    """One run; poll it to follow a run started with `wait=false`."""
    async with db.connection() as conn:
        async with reading(conn, input_from=("path", "run_id")):
            found = await run(conn, registry, run_id)
        # A running row without its lock: the instance may have died. Settle it, look again.
        stale = found is not None and found.status == "running" and not found.running
        if stale and found is not None and await sweep(conn, settings, found.job):
            async with reading(conn, input_from=("path", "run_id")):
                found = await run(conn, registry, run_id)
    if found is None:
        return error(404, "unknown run", id=run_id)
    return found


@router.get("/locks", response_model=LocksView, responses=UNAVAILABLE)
async def get_locks(db: DatabaseDep, registry: RegistryDep) -> Any:
    """Advisory locks held in this database (pg_locks joined to pg_stat_activity), each mapped
    to its job, with the holding instance, its state and how long it has held the lock."""
    async with db.connection() as conn, reading(conn):
        return LocksView(locks=await locks(conn, registry))
