"""HTTP routes: translate requests into runner calls and outcomes into answers. No SQL here.

Answers, in the order a request meets them: 401 (auth, before routing), 404/405, 413, 422,
then the run itself: 200 (ran or skipped: schedulers retry anything else), 202 (accepted,
`wait=false`), 500 (the job raised), 503 (database unavailable), 504 (job timed out).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import AfterValidator, AwareDatetime, BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from cronlock.core.jobs import RESERVED_NAMES, Job, Registry
from cronlock.core.outcome import Outcome, answer
from cronlock.core.params import parse_params
from cronlock.core.runner import Runner
from cronlock.errors import DatabaseUnavailable, InvalidInput, InvalidTrigger
from cronlock.inputs import check_timestamp
from cronlock.settings import Settings
from cronlock.web import routes
from cronlock.web.answers import invalid_input, validation_error
from cronlock.web.deps import DatabaseDep, RequestTooLarge, SettingsDep, error, read_body

log = logging.getLogger("cronlock.api")


class TriggerQuery(BaseModel):
    """Query parameters of `POST /cron/<job>`."""

    model_config = ConfigDict(extra="ignore")

    force: bool = False
    wait: bool = True
    # Any Python datetime fits PostgreSQL's timestamptz, but not every aware one is an instant
    # Python can hold in UTC, which is how it is compared and stored.
    slot: Annotated[AwareDatetime, AfterValidator(check_timestamp)] | None = None


def outcome_response(outcome: Outcome) -> JSONResponse:
    status, body = answer(outcome)
    return JSONResponse(body, status_code=status)


NO_QUERY = TriggerQuery()


@dataclass(frozen=True)
class Authenticated:
    """What the trigger's auth found (cronlock/web/router.py `guarded`): the scheme, as the
    run's source; the body when a signature over it was checked (the handler uses these very
    bytes, never a second read); a signed delivery's message id."""

    source: str = "http"
    body: bytes | None = None
    message_id: str | None = None


UNSIGNED = Authenticated()


def trigger_handler(job: Job) -> Callable[[Request], Coroutine[Any, Any, Response]]:
    async def trigger(request: Request) -> Response:
        # Read and validate everything by hand, in the contract's order (413 before 422),
        # before any connection or lock is taken. No dependency injection on this hot path:
        # solving it costs more than a skip's own work in the handler.
        runner: Runner = request.state.runner
        settings: Settings = request.state.settings
        auth: Authenticated = request.scope["state"].get("trigger", UNSIGNED)
        if auth.body is not None:
            body = auth.body
        else:
            try:
                body = await read_body(request, settings.max_body_bytes)
            except RequestTooLarge:
                return error(413, "request body too large", limit=settings.max_body_bytes)
        try:
            query = (
                TriggerQuery.model_validate(dict(request.query_params))
                if request.scope["query_string"]
                else NO_QUERY
            )
        except ValidationError as exc:
            detail = json.loads(exc.json(include_url=False, include_input=False))
            return error(422, "invalid query parameters", detail=detail)
        try:
            params = parse_params(job, body)
            # The request's `traceparent` is the trigger span's parent (when tracing is on).
            with runner.tracing.request(request.headers):
                outcome = await runner.trigger(
                    job,
                    force=query.force,
                    slot=query.slot,
                    params=params,
                    wait=query.wait,
                    source=auth.source,
                    message_id=auth.message_id,
                )
        except InvalidTrigger as exc:
            return error(422, "invalid trigger", detail=exc.detail)
        except InvalidInput as exc:
            return invalid_input(exc)
        except DatabaseUnavailable as exc:
            return error(503, "database unavailable", job=job.name, reason=exc.reason)
        return outcome_response(outcome)

    return trigger


def _openapi_for(job: Job) -> dict[str, Any]:
    parameters = [
        {
            "name": "force",
            "in": "query",
            "required": False,
            "schema": {"type": "boolean"},
            "description": "run even if this slot already succeeded (recorded as manual)",
        },
        {
            "name": "wait",
            "in": "query",
            "required": False,
            "schema": {"type": "boolean"},
            "description": "false: answer 202 with the run id once the lock is taken",
        },
        {
            "name": "slot",
            "in": "query",
            "required": False,
            "schema": {"type": "string", "format": "date-time"},
            "description": "backfill this past tick of the schedule",
        },
    ]
    extra: dict[str, Any] = {"parameters": parameters}
    if job.params is not None:
        extra["requestBody"] = {
            # A keyed job's body carries its key: without one the trigger is a 422.
            "required": job.key is not None,
            "content": {"application/json": {"schema": job.params.model_json_schema()}},
        }
    return extra


ACCEPTED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["job", "run_id", "slot"],
    "properties": {
        "job": {"type": "string"},
        "run_id": {"type": "integer", "minimum": 1},
        "slot": {"type": ["string", "null"], "format": "date-time"},
        "key": {"type": "string", "description": "a keyed job's key"},
    },
}


def _describe(job: Job) -> str:
    parts = [job.description] if job.description else []
    if job.schedule is not None:
        parts.append(f"Schedule `{job.schedule.expr}` in {job.schedule.tz}.")
    else:
        parts.append("No schedule: protected against overlap only.")
    if job.key is not None:
        parts.append(f"Keyed by `{job.key}`: one run at a time per key, keys at once.")
    parts.append(f"Timeout {job.timeout:g} s.")
    return " ".join(parts)


def trigger_methods(settings: Settings) -> list[str]:
    return ["POST", "GET"] if settings.cron_allow_get else ["POST"]


def trigger_route_options(job: Job) -> dict[str, Any]:
    """How a job's trigger route describes itself in the OpenAPI document."""
    return {
        "summary": f"Trigger {job.name}",
        "description": _describe(job),
        "openapi_extra": _openapi_for(job),
        "responses": {
            200: {"description": "ran, or skipped (already running / already done)"},
            202: {
                "description": "accepted (wait=false): follow the run at its link",
                "content": {"application/json": {"schema": ACCEPTED_SCHEMA}},
                "links": {"GetRun": routes.RUN_LINK},
            },
            401: {"description": "missing or wrong credential (TRIGGER_AUTH)"},
            413: {"description": "body too large"},
            422: {"description": "bad parameters"},
            500: {
                "description": "job failed (with run id; `commit: unknown` when the "
                "connection broke during its commit, which may have landed)"
            },
            503: {"description": "database unavailable (Retry-After)"},
            504: {"description": "job timed out (with run id)"},
        },
    }


health_router = APIRouter(tags=["health"])


@health_router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is alive; no database call."""
    return {"status": "ok"}


@health_router.get("/readyz")
async def readyz(db: DatabaseDep, settings: SettingsDep) -> Response:
    """Database reachable, a primary, migrations current (or newer than this code: a rolling
    deploy's old instances serve on, and say so)."""
    problem = await db.check(apply_migrations=False)
    if problem is not None:
        return error(503, "not ready", reason=problem)
    body = {"status": "ready", "instance": settings.instance_name}
    if db.note is not None:
        body["note"] = db.note
    return JSONResponse(body)


def method_not_allowed(allowed: str) -> Response:
    return JSONResponse(
        {"error": "method not allowed", "allow": allowed},
        status_code=405,
        headers={"Allow": allowed},
    )


def is_read_route(name: str) -> bool:
    """`/cron/<name>` is one of the operations routes (GET only), not a job."""
    if name in RESERVED_NAMES:
        return True
    run_id = name.removeprefix("runs/")
    return run_id != name and run_id.isascii() and run_id.isdigit()


# The operator's write routes (cronlock/web/control.py), POST only.
WRITE_ROUTE = re.compile(r"^(jobs/[^/]+/(pause|resume)|runs/[0-9]+/items(/[0-9]+)?/retry)$")


def not_a_job(name: str, registry: Registry, settings: Settings) -> Response:
    """The answer under the prefix where no route is: an unknown job (404), or a known job,
    read or write route asked with the wrong method (405)."""
    if name in registry:
        return method_not_allowed(", ".join(trigger_methods(settings)))
    if WRITE_ROUTE.match(name):
        return method_not_allowed("POST")
    if is_read_route(name):
        # /cron/jobs, /cron/runs... exist: another method on them is not an unknown job.
        return method_not_allowed("GET, HEAD")
    return error(404, "unknown job", job=name[:200])


def install_handlers(app: FastAPI) -> None:
    """The standalone service's answers to errors out of its other routes (health, the
    dashboard, FastAPI's own 404 and 405), in the shapes cronlock's routes answer with."""

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        headers = dict(exc.headers) if exc.headers else None
        return JSONResponse(
            {"error": str(exc.detail)}, status_code=exc.status_code, headers=headers
        )

    @app.exception_handler(InvalidInput)
    async def refused_input(request: Request, exc: InvalidInput) -> Response:
        return invalid_input(exc)

    @app.exception_handler(DatabaseUnavailable)
    async def unavailable(request: Request, exc: DatabaseUnavailable) -> Response:
        return error(503, "database unavailable", reason=exc.reason)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> Response:
        return validation_error(exc)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error(500, "internal error")
