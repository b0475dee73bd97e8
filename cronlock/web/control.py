"""The operator's write routes: pause and resume a job (`POST /cron/jobs/{name}/pause`,
`/resume`), retry a failed fan-out run's failed items (`POST /cron/runs/{id}/items/retry`, one
item: `/items/{n}/retry`), with the cron secret (a POST under /cron/ needs it,
cronlock/web/auth.py). Routes only: the state and its SQL are cronlock/core/pause.py's and
cronlock/core/fanout_retry.py's; the CLI's `pause`, `resume` and `retry-items` do the same
directly.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from fastapi.responses import JSONResponse
from pydantic import AfterValidator, AwareDatetime, BaseModel, ConfigDict, Field, ValidationError

from cronlock.core import pause
from cronlock.core.fanout_retry import Retried, retry_items
from cronlock.core.jobs import NAME_PATTERN
from cronlock.core.runner import Runner
from cronlock.errors import DRIVER_ERRORS, InvalidTrigger, translate
from cronlock.inputs import BIGINT_MAX, INT_MAX, check_text, check_timestamp
from cronlock.web import routes
from cronlock.web.answers import CronRoute
from cronlock.web.deps import (
    DatabaseDep,
    RegistryDep,
    RequestTooLarge,
    SettingsDep,
    error,
    read_body,
)

# CronRoute: each route answers its own errors (cronlock/web/answers.py).
router = APIRouter(tags=["operations"], route_class=CronRoute)


class PauseRequest(BaseModel):
    """The body of `POST /cron/jobs/{name}/pause`; every field optional, no body at all too."""

    model_config = ConfigDict(extra="forbid")

    until: Annotated[AwareDatetime, AfterValidator(check_timestamp)] | None = Field(
        default=None, description="resume on its own at this time; absent: until resumed"
    )
    note: Annotated[str, AfterValidator(check_text)] | None = Field(
        default=None, max_length=pause.MAX_NOTE, description="why (shown in /cron/jobs)"
    )
    by: Annotated[str, AfterValidator(check_text)] | None = Field(
        default=None, max_length=pause.MAX_BY, description="who (default: the API)"
    )


class PauseAnswer(BaseModel):
    job: str
    paused: pause.Paused | None
    # resume only: whether the job was paused before this request.
    was_paused: bool | None = None


JobName = Annotated[str, Path(pattern=NAME_PATTERN.pattern, description="a job name")]
RESPONSES: dict[int | str, dict[str, Any]] = {
    404: {"description": "unknown job"},
    413: {"description": "body too large (MAX_BODY_BYTES)"},
    422: {"description": "bad body (e.g. `until` in the past)"},
    503: {"description": "database unavailable (Retry-After)"},
}


async def _body(request: Request, limit: int) -> PauseRequest | JSONResponse:
    try:
        raw = await read_body(request, limit)
    except RequestTooLarge:
        return error(413, "request body too large", limit=limit)
    try:
        data = json.loads(raw) if raw.strip() else {}
        return PauseRequest.model_validate(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        if isinstance(exc, ValidationError):
            detail = json.loads(exc.json(include_url=False, include_input=False))
            return error(422, "invalid request", detail=detail)
        return error(422, "body is not valid JSON")


@router.post("/jobs/{name}/pause", response_model=PauseAnswer, responses=RESPONSES)
async def pause_job(
    name: JobName,
    request: Request,
    db: DatabaseDep,
    registry: RegistryDep,
    settings: SettingsDep,
) -> Any:
    """Pause a job on every instance at once: triggers answer `{"skipped": true, "reason":
    "paused"}`, the built-in scheduler, retries, backfill and catch-up skip it; `force=true`
    still runs it. Again on a paused job: the note and `until` are replaced."""
    if name not in registry:
        return error(404, "unknown job", job=name)
    body = await _body(request, settings.max_body_bytes)
    if isinstance(body, JSONResponse):
        return body
    try:
        async with db.connection() as conn:
            state = await pause.pause(
                conn,
                settings.db_schema,
                name,
                by=body.by or "api",
                note=body.note,
                until=body.until,
            )
    except InvalidTrigger as exc:
        return error(422, "invalid request", detail=exc.detail)
    except DRIVER_ERRORS as exc:
        raise translate(exc, input_from=("body",)) from exc
    return PauseAnswer(job=name, paused=state)


@router.post("/jobs/{name}/resume", response_model=PauseAnswer, responses=RESPONSES)
async def resume_job(
    name: JobName, db: DatabaseDep, registry: RegistryDep, settings: SettingsDep
) -> Any:
    """Resume a paused job (a job that was not paused is answered the same, `was_paused`
    false): its next trigger runs as usual."""
    if name not in registry:
        return error(404, "unknown job", job=name)
    try:
        async with db.connection() as conn:
            was = await pause.resume(conn, settings.db_schema, name)
    except DRIVER_ERRORS as exc:
        raise translate(exc) from exc
    return PauseAnswer(job=name, paused=None, was_paused=was)


class ItemsRetried(BaseModel):
    """A retry of a fan-out run's failed items, made: the new attempt `run_id` continues the
    run `retry_of` with `retried` items pending again (of `items`); follow it at
    `GET /cron/runs/{run_id}`."""

    job: str
    run_id: int
    retry_of: int
    attempt: int
    slot: AwareDatetime | None
    key: str | None = None
    retried: int
    items: int


RunId = Annotated[int, Path(ge=1, le=BIGINT_MAX, description="a fan-out run's id")]
ItemNumber = Annotated[int, Path(ge=0, le=INT_MAX, description="an item's number, from 0")]
RETRY_RESPONSES: dict[int | str, dict[str, Any]] = {
    202: {
        "description": "retried: a new attempt works the items",
        "links": {"GetRun": routes.RUN_LINK},
    },
    404: {"description": "no such run, or no such item of it"},
    409: {
        "description": "refused, with the reason: not a fan-out run, still running, not "
        "failed, retried already, the item did not fail, the job paused or running"
    },
    422: {"description": "bad run id or item number"},
    503: {"description": "database unavailable (Retry-After)"},
}


def _retried(done: Retried) -> JSONResponse:
    body = ItemsRetried(
        job=done.job,
        run_id=done.run_id,
        retry_of=done.retry_of,
        attempt=done.attempt,
        slot=done.slot,
        key=done.key,
        retried=done.retried,
        items=done.total,
    )
    # A key-less job's answer has no "key" member, as its trigger's has none.
    dumped = body.model_dump(mode="json", exclude={"key"} if done.key is None else set())
    return JSONResponse(dumped, status_code=202)


@router.post(
    "/runs/{run_id}/items/retry",
    status_code=202,
    response_model=ItemsRetried,
    responses=RETRY_RESPONSES,
)
async def retry_failed_items(run_id: RunId, request: Request) -> Any:
    """Retry every failed item of a failed fan-out run, in a new attempt of the run that
    continues its fan-out on every instance: the items that succeeded are never redone, and
    `done` runs once more when the last item settles (docs/long-jobs.md)."""
    runner: Runner = request.state.runner
    return _retried(await retry_items(runner.fanouts, run_id, source="api"))


@router.post(
    "/runs/{run_id}/items/{n}/retry",
    status_code=202,
    response_model=ItemsRetried,
    responses=RETRY_RESPONSES,
)
async def retry_failed_item(run_id: RunId, n: ItemNumber, request: Request) -> Any:
    """Retry one failed item of a failed fan-out run, in a new attempt of the run (the other
    failed items stay failed, and fail it again unless retried too)."""
    runner: Runner = request.state.runner
    return _retried(await retry_items(runner.fanouts, run_id, n, source="api"))
