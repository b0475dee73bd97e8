"""`cron.router`: cronlock's HTTP surface as one APIRouter a host app includes.

Everything cronlock answers is decided inside its own routes, so a host app's middleware,
exception handlers and other routes neither change cronlock's answers nor are changed by them:

- **Auth per route**, in constant time, fail closed: a trigger or a write needs the cron
  secret, a read the secret or the read token. The check is a dependency of the router (reads,
  writes) or the first thing a trigger's handler does; a refusal is a response, never an
  exception that the host's handlers would answer in their own shape.
- **Errors answered here** (`CronRoute`): our exceptions, FastAPI's validation errors and
  anything unexpected become cronlock's JSON answers inside the route, before the host's
  exception handlers could see them.
- **State per router**: each request gets the objects of the `Cronlock` whose router it
  reached (in `request.state`), so two `Cronlock`s with different schemas serve side by side.

Triggers skip FastAPI's dependency machinery (`TriggerRoute`): a storm answers thousands of
them a minute, mostly skips worth one database round trip (bench/trigger.py).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Scope

from cronlock.core.jobs import Registry
from cronlock.errors import DatabaseUnavailable, InvalidInput
from cronlock.web import api, control, routes
from cronlock.web.auth import UNAUTHORIZED, Access, bearer_token, matches
from cronlock.web.deps import error

if TYPE_CHECKING:
    from cronlock.web.deps import Serving

log = logging.getLogger("cronlock.api")

# Where under the prefix the dashboard goes (`<prefix>/ui`): the catch-all leaves it alone.
DASHBOARD = "ui"

Endpoint = Callable[[Request], Coroutine[Any, Any, Response]]


class Refused(Exception):
    """An answer decided before the route's own code ran (auth): raised by a dependency,
    answered by `CronRoute` as it is."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


def unauthorized() -> Response:
    return Response(
        UNAUTHORIZED,
        status_code=401,
        media_type="application/json",
        headers={"WWW-Authenticate": "Bearer"},
    )


def authorized(request: Request, tokens: Sequence[bytes]) -> bool:
    token = bearer_token(request.headers.get("authorization", "").encode("latin-1") or None)
    return token is not None and matches(token, tokens)


def answer_error(request: Request, exc: Exception) -> Response:
    """cronlock's answer to an exception out of one of its routes: the same shapes the
    standalone service's exception handlers give (cronlock/web/api.py)."""
    if isinstance(exc, Refused):
        return exc.response
    if isinstance(exc, InvalidInput):
        return api.invalid_input(exc)
    if isinstance(exc, DatabaseUnavailable):
        return error(503, "database unavailable", reason=exc.reason)
    if isinstance(exc, RequestValidationError):
        return api.validation_error(exc)
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
    query, the run); the route exists for matching and for the OpenAPI document."""

    def get_route_handler(self) -> Endpoint:
        endpoint: Endpoint = self.endpoint

        async def answered(request: Request) -> Response:
            try:
                return await endpoint(request)
            except Exception as exc:
                return answer_error(request, exc)

        return answered


class CatchAllRoute(TriggerRoute):
    """The catch-all under the prefix, which leaves `<prefix>/ui` and below to the dashboard
    (`app.mount("/cron/ui", cron.dashboard)`): else, mounted after the router is included, it
    would be unreachable, every path of it answered 401 or 404 here. (A job named `ui` keeps
    its trigger: that route is matched before this one.)"""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        match, child = super().matches(scope)
        if match is not Match.NONE:
            name: str = child["path_params"]["name"]
            if name == DASHBOARD or name.startswith(DASHBOARD + "/"):
                return Match.NONE, {}
        return match, child


def guarded(serving: Serving, handler: Endpoint) -> Endpoint:
    """A trigger's endpoint: the secret first, then the run."""

    async def trigger(request: Request) -> Response:
        if not authorized(request, serving.tokens(Access.RUN)):
            return unauthorized()
        serving.bind(request)
        return await handler(request)

    return trigger


def build(serving: Serving, registry: Registry, prefix: str) -> APIRouter:
    """The router of one `Cronlock`: triggers, reads, pause/resume, and the catch-all that
    answers unknown jobs and wrong methods under `prefix`."""

    async def bind(request: Request) -> None:
        # Per request, so the reads and writes below find this Cronlock's objects (and not
        # another's, or the host's) however the host's lifespan is written.
        serving.bind(request)

    def require(access: Access) -> Callable[[Request], Awaitable[None]]:
        async def check(request: Request) -> None:
            if not authorized(request, serving.tokens(access)):
                raise Refused(unauthorized())

        return check

    router = APIRouter(prefix=prefix, route_class=CronRoute, dependencies=[Depends(bind)])
    readers = [Depends(require(Access.READ))]
    writers = [Depends(require(Access.RUN))]
    router.include_router(routes.router, dependencies=readers)
    router.include_router(control.router, dependencies=writers)
    methods = api.trigger_methods(serving.settings)
    for job in registry.values():
        router.add_api_route(
            f"/{job.name}",
            guarded(serving, api.trigger_handler(job)),
            methods=methods,
            name=f"trigger:{job.name}",
            route_class_override=TriggerRoute,
            **api.trigger_route_options(job),
        )

    async def not_a_job(request: Request) -> Response:
        """Anything under the prefix that is no route: an unknown job (404) or a known job or
        read route asked with another method (405). Fail closed: a caller without a token
        learns nothing, not even which jobs exist."""
        name: str = request.path_params["name"]
        method = request.method
        needed = (
            Access.READ if method in ("GET", "HEAD") and api.is_read_route(name) else Access.RUN
        )
        if not authorized(request, serving.tokens(needed)):
            return unauthorized()
        return api.not_a_job(name, registry, serving.settings)

    router.add_api_route(
        "/{name:path}",
        not_a_job,
        methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"],
        include_in_schema=False,
        route_class_override=CatchAllRoute,
    )
    return router


def mounted_twice(app_routes: Sequence[Any], router: APIRouter) -> bool:
    """Whether the host app holds this router's routes twice (included twice): each trigger
    would be answered by the first copy only, and the second prefix would be a trap."""
    ours = {id(route.endpoint) for route in router.routes if isinstance(route, APIRoute)}
    seen: dict[tuple[int, str], int] = {}
    for route in app_routes:
        if isinstance(route, APIRoute) and id(route.endpoint) in ours:
            key = (id(route.endpoint), ",".join(sorted(route.methods or ())))
            seen[key] = seen.get(key, 0) + 1
    return any(count > 1 for count in seen.values())
