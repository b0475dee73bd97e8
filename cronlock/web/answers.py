"""cronlock's answers to what goes wrong in its routes, given inside the route itself.

A host app's exception handlers see only exceptions that escape a route; `CronRoute` lets none
of cronlock's escape, so a 401, 404, 422 or 503 of cronlock's is in cronlock's shape whatever
the host registered (and cronlock registers no handler that would change the host's answers).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Receive, Scope, Send

from cronlock.errors import DatabaseUnavailable, InvalidInput, RetryRefused
from cronlock.web.auth import UNAUTHORIZED, Access, Tokens, bearer_token
from cronlock.web.deps import error

log = logging.getLogger("cronlock.api")

Endpoint = Callable[[Request], Coroutine[Any, Any, Response]]


def invalid_input(exc: InvalidInput) -> JSONResponse:
    """A value the database refused (`db.translate`): 422 in the shape of every other
    invalid request, never a 503."""
    kind = getattr(exc, "kind", "refused_by_database")  # InvalidSchedule says its own
    problem = {"loc": list(exc.loc), "msg": exc.reason, "type": kind}
    return error(422, "invalid request", detail=[problem])


def validation_error(exc: RequestValidationError) -> JSONResponse:
    # `type` too: the OpenAPI document's 422 (FastAPI's) promises loc, msg and type.
    detail = [
        {"loc": e.get("loc"), "msg": e.get("msg"), "type": e.get("type")} for e in exc.errors()
    ]
    return error(422, "invalid request", detail=detail)


class Refused(Exception):
    """An answer decided before the route's own code ran (auth): raised by a dependency,
    answered by `CronRoute` as it is."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


def unauthorized(challenge: str = "Bearer") -> Response:
    """401; a trigger's names every scheme TRIGGER_AUTH accepts (`TriggerAuth.challenge`)."""
    return Response(
        UNAUTHORIZED,
        status_code=401,
        media_type="application/json",
        headers={"WWW-Authenticate": challenge},
    )


def authorized(request: Request, tokens: Tokens, access: Access) -> bool:
    token = bearer_token(request.headers.get("authorization", "").encode("latin-1") or None)
    return token is not None and tokens.accepts(access, token)


def answer_error(request: Request, exc: Exception) -> Response:
    """cronlock's answer to an exception out of one of its routes: the same shapes the
    standalone service's exception handlers give (cronlock/web/api.py)."""
    if isinstance(exc, Refused):
        return exc.response
    if isinstance(exc, InvalidInput):
        return invalid_input(exc)
    if isinstance(exc, DatabaseUnavailable):
        return error(503, "database unavailable", reason=exc.reason)
    if isinstance(exc, RetryRefused):
        # No such run or item: 404; the run's or job's state forbids the retry now: 409.
        if exc.missing:
            return error(404, "not found", reason=exc.reason)
        return error(409, "retry refused", reason=exc.reason)
    if isinstance(exc, RequestValidationError):
        return validation_error(exc)
    if isinstance(exc, StarletteHTTPException):
        headers = dict(exc.headers) if exc.headers else None
        return JSONResponse(
            {"error": str(exc.detail)}, status_code=exc.status_code, headers=headers
        )
    log.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return error(500, "internal error")


class CronRoute(APIRoute):
    """An APIRoute that answers its own errors (see the module docstring)."""

    def get_route_handler(self) -> Endpoint:
        handler = super().get_route_handler()

        async def answered(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:
                return answer_error(request, exc)

        return answered


class TriggerRoute(CronRoute):
    """A trigger: its endpoint takes the request and does everything itself (auth, body,
    query, the run); the route exists for matching and for the OpenAPI document.

    It is also served without FastAPI's request wrapping (`handle`): the dependencies' exit
    stacks, the exception handlers' lookup and the route's body-limit layers are for
    endpoints that use them, and this one answers every error itself and reads its body
    under its own limit (`MAX_BODY_BYTES`). A trigger storm is thousands of these a minute,
    most of them skips worth one database round trip (bench/embedded.py)."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(path, endpoint, **kwargs)
        self.answered = self.get_route_handler()

    def get_route_handler(self) -> Endpoint:
        endpoint: Endpoint = self.endpoint

        async def answered(request: Request) -> Response:
            try:
                return await endpoint(request)
            except Exception as exc:
                return answer_error(request, exc)

        return answered

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] not in (self.methods or ()):
            # A method no route under the prefix takes: FastAPI's 405.
            await super().handle(scope, receive, send)
            return
        response = await self.answered(Request(scope, receive, send))
        await response(scope, receive, send)


class JobTriggers(TriggerRoute):
    """Every job's trigger as one route, `<prefix>/{name}`, found with one regex and a lookup
    in the jobs' endpoints (`endpoint.jobs`), where one route per job cost a regex each, and
    twice per request: FastAPI walks an included router's routes once to choose the router
    and again to handle the request. The per-job routes stay behind it for the OpenAPI
    document and `url_path_for`; a trigger never reaches them."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        if not isinstance(endpoint, Triggers):
            raise TypeError("JobTriggers serves a Triggers endpoint")
        super().__init__(path, endpoint, **kwargs)
        self.jobs = endpoint.jobs

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        match, child_scope = super().matches(scope)
        if match is not Match.NONE and child_scope["path_params"].get("name") not in self.jobs:
            return Match.NONE, {}
        return match, child_scope


class Triggers:
    """The endpoint of `JobTriggers`: the named job's own trigger endpoint."""

    def __init__(self, jobs: Mapping[str, Endpoint]) -> None:
        self.jobs = dict(jobs)

    async def __call__(self, request: Request) -> Response:
        return await self.jobs[request.path_params["name"]](request)
