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
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.routing import Match
from starlette.types import Scope

from cronlock.core.jobs import Registry
from cronlock.errors import KeysUnavailable
from cronlock.web import api, control, routes, schedules
from cronlock.web.answers import (
    CronRoute,
    Endpoint,
    JobTriggers,
    Refused,
    TriggerRoute,
    Triggers,
    authorized,
    unauthorized,
)
from cronlock.web.auth import Access
from cronlock.web.deps import RequestTooLarge, error, read_body
from cronlock.web.schemes import TriggerAuth

if TYPE_CHECKING:
    from cronlock.web.deps import Serving

log = logging.getLogger("cronlock.auth")

# Where under the prefix the dashboard goes (`<prefix>/ui`): the catch-all leaves it alone.
DASHBOARD = "ui"


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
    """A trigger's endpoint: TRIGGER_AUTH's schemes first (cronlock/web/schemes.py), then the
    run, which records the scheme that accepted as its source."""
    auth: TriggerAuth = serving.trigger_auth

    async def trigger(request: Request) -> Response:
        body: bytes | None = None
        if auth.wants_body and any(k == b"upstash-signature" for k, _ in request.scope["headers"]):
            # A signature covers the exact body: read here, once (the handler gets these
            # bytes), within MAX_BODY_BYTES. Too large to check is unchecked: a 401, which says
            # nothing of the job to a caller without a credential.
            try:
                body = await read_body(request, serving.settings.max_body_bytes)
            except RequestTooLarge:
                log.warning("%s: a signed trigger's body is over MAX_BODY_BYTES", request.url.path)
                return unauthorized(auth.challenge)
        try:
            accepted = await auth.check(request.scope, body)
        except KeysUnavailable as exc:
            return error(503, "cannot check the token now", reason=str(exc))
        if accepted is None:
            return unauthorized(auth.challenge)
        serving.bind(request)
        request.scope["state"]["trigger"] = api.Authenticated(
            accepted.source, body, accepted.message_id
        )
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
            if not authorized(request, serving.tokens, access):
                raise Refused(unauthorized())

        return check

    # Tagged: a host whose generate_unique_id_function reads route.tags[0] (the full-stack
    # FastAPI template's does) fails on untagged routes at its first request.
    router = APIRouter(
        prefix=prefix, route_class=CronRoute, dependencies=[Depends(bind)], tags=["cron"]
    )
    methods = api.trigger_methods(serving.settings)
    endpoints = {job.name: guarded(serving, api.trigger_handler(job)) for job in registry.values()}
    # First: the path a storm takes. No read or write route is shadowed (a job's name is never
    # one of theirs, RESERVED_NAMES, and has no '/').
    router.add_api_route(
        "/{name}",
        Triggers(endpoints),
        methods=methods,
        name="triggers",
        include_in_schema=False,
        route_class_override=JobTriggers,
    )
    readers = [Depends(require(Access.READ))]
    writers = [Depends(require(Access.RUN))]
    router.include_router(routes.router, dependencies=readers)
    router.include_router(control.router, dependencies=writers)
    # Dynamic schedules (cronlock/web/schedules.py): reads with the read token, writes the secret.
    router.include_router(schedules.reads, dependencies=readers)
    router.include_router(schedules.writes, dependencies=writers)
    for job in registry.values():
        # For the OpenAPI document (one operation per job) and url_path_for("trigger:<job>").
        router.add_api_route(
            f"/{job.name}",
            endpoints[job.name],
            methods=methods,
            name=f"trigger:{job.name}",
            # The document's group of triggers, as before the router was a library's.
            tags=["jobs"],
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
        if not authorized(request, serving.tokens, needed):
            # A trigger's challenge whether the job exists or not: it tells nothing either way.
            return unauthorized(
                serving.trigger_auth.challenge if needed is Access.RUN else "Bearer"
            )
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
    """Whether the host app holds this router twice (included twice, maybe through routers
    of its own): a second prefix would be a second door to every job."""
    return _inclusions(app_routes, router) > 1


def _inclusions(routes: Sequence[Any], router: APIRouter) -> int:
    # Newer FastAPI keeps an included router as one entry naming it (`original_router`);
    # older versions copied its routes, which are then recognised by their endpoints.
    found = 0
    copied: dict[int, int] = {}
    ours = {id(r.endpoint) for r in router.routes if isinstance(r, APIRoute)}
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is router:
            found += 1
        elif isinstance(included, APIRouter):
            found += _inclusions(included.routes, router)
        elif isinstance(route, APIRoute) and id(route.endpoint) in ours:
            key = id(route.endpoint)
            copied[key] = copied.get(key, 0) + 1
    return found + max(copied.values(), default=0)
