"""HTTP routes: translate requests into runner calls and outcomes into answers. No SQL here.

Answers, in the order a request meets them: 401 (auth, before routing), 404/405, 413, 422,
then the run itself: 200 (ran or skipped: schedulers retry anything else), 202 (accepted,
`wait=false`), 500 (the job raised), 503 (database unavailable), 504 (job timed out).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import AfterValidator, AwareDatetime, BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from app import control, routes
from app.auth import route_path
from app.deps import DatabaseDep, RequestTooLarge, SettingsDep, error, read_body
from app.errors import DatabaseUnavailable, InvalidInput, InvalidTrigger
from app.inputs import check_timestamp
from app.jobs import RESERVED_NAMES, Job, Registry, parse_params
from app.outcome import Outcome, answer
from app.runner import Runner
from app.settings import Settings

log = logging.getLogger("cronlock.api")


class TriggerQuery(BaseModel):
    """Query parameters of `POST /cron/<job>`."""

    model_config = ConfigDict(extra="ignore")

    force: bool = False
    wait: bool = True
    # Any Python datetime fits PostgreSQL's timestamptz, but not every aware one is an instant
    # Python can hold in UTC, which is how it is compared and stored.
    slot: Annotated[AwareDatetime, AfterValidator(check_timestamp)] | None = None


def invalid_input(exc: InvalidInput) -> JSONResponse:
    """A value the database refused (`db.translate`): 422 in the shape of every other
    invalid request, never a 503."""
    problem = {"loc": list(exc.loc), "msg": exc.reason, "type": "refused_by_database"}
    return error(422, "invalid request", detail=[problem])


def outcome_response(outcome: Outcome) -> JSONResponse:
    status, body = answer(outcome)
    return JSONResponse(body, status_code=status)


NO_QUERY = TriggerQuery()


def trigger_handler(job: Job) -> Callable[[Request], Awaitable[Response]]:
    async def trigger(request: Request) -> Response:
        # Read and validate everything by hand, in the contract's order (413 before 422),
        # before any connection or lock is taken. No dependency injection on this hot path:
        # solving it costs more than a skip's own work in the handler.
        runner: Runner = request.state.runner
        settings: Settings = request.state.settings
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
            outcome = await runner.trigger(
                job, force=query.force, slot=query.slot, params=params, wait=query.wait
            )
        except InvalidTrigger as exc:
            return error(422, "invalid trigger", detail=exc.args[0])
        except InvalidInput as exc:
            return invalid_input(exc)
        except DatabaseUnavailable as exc:
            return error(503, "database unavailable", job=job.name, reason=exc.reason)
        return outcome_response(outcome)

    return trigger


TriggerHandler = Callable[[Request], Awaitable[Response]]


class TriggerDispatch:
    """Hands `POST /cron/<job>` straight to the job's handler, ahead of FastAPI's router.

    A trigger is the one request answered thousands of times a minute in a storm, and most
    answers are skips worth one database round trip; matching the router's routes one regex at
    a time and FastAPI's per-route wrappers cost about as much again (bench/trigger.py). Sits
    inside `BearerAuth`. The per-job routes stay registered: they are the OpenAPI document,
    and they answer whatever this passes on (another method, a trailing slash). Errors that
    escape a handler reach the app's catch-all handler as before.
    """

    def __init__(self, app: ASGIApp, *, handlers: dict[str, TriggerHandler], methods: list[str]):
        self.app = app
        self.handlers = handlers
        self.methods = frozenset(methods)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in self.methods:
            path = route_path(scope)
            if path.startswith("/cron/"):
                handler = self.handlers.get(path[6:])
                if handler is not None:
                    response = await handler(Request(scope, receive))
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)


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


def job_router(registry: Registry, settings: Settings) -> APIRouter:
    """One route per registered job, so each appears in the OpenAPI document."""
    router = APIRouter(prefix="/cron", tags=["jobs"])
    methods = trigger_methods(settings)
    for job in registry.values():
        router.add_api_route(
            f"/{job.name}",
            trigger_handler(job),
            methods=methods,
            name=f"trigger:{job.name}",
            summary=f"Trigger {job.name}",
            description=_describe(job),
            openapi_extra=_openapi_for(job),
            responses={
                200: {"description": "ran, or skipped (already running / already done)"},
                202: {
                    "description": "accepted (wait=false): follow the run at its link",
                    "content": {"application/json": {"schema": ACCEPTED_SCHEMA}},
                    "links": {"GetRun": routes.RUN_LINK},
                },
                401: {"description": "missing or wrong secret"},
                413: {"description": "body too large"},
                422: {"description": "bad parameters"},
                500: {
                    "description": "job failed (with run id; `commit: unknown` when the "
                    "connection broke during its commit, which may have landed)"
                },
                503: {"description": "database unavailable (Retry-After)"},
                504: {"description": "job timed out (with run id)"},
            },
        )
    return router


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


def install(app: FastAPI, registry: Registry, settings: Settings) -> None:
    app.include_router(health_router)
    app.include_router(routes.router)
    app.include_router(control.router)
    app.include_router(job_router(registry, settings))

    # Anything under /cron/ that is not a route: an unknown job (404), or a known job asked
    # with the wrong method (405). Registered last so real routes match first.
    async def not_a_job(name: str, request: Request) -> Response:
        if name in registry:
            return method_not_allowed("POST, GET" if settings.cron_allow_get else "POST")
        if is_read_route(name):
            # /cron/jobs, /cron/runs... exist: another method on them is not an unknown job.
            return method_not_allowed("GET, HEAD")
        return error(404, "unknown job", job=name[:200])

    # Inside BearerAuth (added after this one, so it runs first).
    app.add_middleware(
        TriggerDispatch,
        handlers={name: trigger_handler(job) for name, job in registry.items()},
        methods=trigger_methods(settings),
    )

    app.add_api_route(
        "/cron/{name:path}",
        not_a_job,
        methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"],
        include_in_schema=False,
    )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        headers = dict(exc.headers) if exc.headers else None
        return JSONResponse(
            {"error": str(exc.detail)}, status_code=exc.status_code, headers=headers
        )

    # Our errors raised out of the routes, answered in one place. (Triggers answer them in
    # `trigger_handler`: they are dispatched ahead of the router and these handlers, for speed.)
    @app.exception_handler(InvalidInput)
    async def refused_input(request: Request, exc: InvalidInput) -> Response:
        return invalid_input(exc)

    @app.exception_handler(DatabaseUnavailable)
    async def unavailable(request: Request, exc: DatabaseUnavailable) -> Response:
        return error(503, "database unavailable", reason=exc.reason)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> Response:
        # `type` too: the OpenAPI document's 422 (FastAPI's) promises loc, msg and type.
        detail = [
            {"loc": e.get("loc"), "msg": e.get("msg"), "type": e.get("type")} for e in exc.errors()
        ]
        return error(422, "invalid request", detail=detail)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error(500, "internal error")
