"""The standalone service: `uvicorn --factory cronlock.service:create_app` (what
`python -m cronlock serve` runs). Nothing happens at import time.

It is built from the pieces an app of your own places (cronlock/instance.py): `cron.router`
under /cron, the dashboard under /ui, metrics at /metrics, health checks, and `cron.running()`
as the lifespan. Being a whole service, it adds what a host app would not want from a library:
the Bearer check in front of every path (fail closed: an unknown path is a 401, not a 404),
JSON answers for every error, the logging set-up, and `gc.freeze()` after start.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from cronlock import logs, tracing
from cronlock.core.metrics import CONTENT_TYPE
from cronlock.errors import ConfigurationError
from cronlock.instance import Cronlock
from cronlock.settings import Settings
from cronlock.version import __version__
from cronlock.web import api
from cronlock.web.auth import BearerAuth


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the service. Refuses (SystemExit with the reason when started by uvicorn) to start
    without a usable secret, or with jobs that are declared wrongly."""
    from_env = settings is None
    try:
        settings = settings or Settings()
        # CRON_JOBS as given (its default serves the demo and the housekeeping jobs).
        cron = Cronlock(settings, jobs=settings.job_modules, housekeeping=False)
        cron.jobs  # noqa: B018 - collected now: a mistake in a job module refuses the start
    except ConfigurationError as exc:
        if from_env:
            print(f"cronlock: cannot start: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        raise
    if from_env:
        logs.setup(settings.log_format, settings.log_level)
    return build(cron)


def build(cron: Cronlock) -> FastAPI:
    """The service around one Cronlock."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        # OTEL_TRACES_EXPORTER: the service's own tracer provider, before cron decides (a
        # host app brings its own instead: docs/tracing.md).
        with tracing.from_env():
            async with cron.running():
                # What exists now (the app, its routes and models, imported modules) lives as long
                # as the process: kept out of the collector's full passes, which otherwise walk all
                # of it and stall every request in flight for tens of milliseconds
                # (bench/trigger.py's p99). A library leaves that choice to its host.
                gc.collect()
                gc.freeze()
                # The health checks and the dashboard read these from the request's state.
                yield cron.state()

    settings = cron.settings
    app = FastAPI(
        title="cronlock",
        version=__version__,
        description="Scheduled jobs that run exactly once across instances.",
        lifespan=lifespan,
    )
    # First of the app's own routes: a trigger storm's path then meets no other route's
    # pattern on its way (the paths do not overlap: /cron, /ui, /healthz, /metrics).
    app.include_router(cron.router)
    if settings.ui_enabled:
        # Its session check decides there (the Bearer check lets /ui through: Access.SESSION).
        app.mount("/ui", cron.dashboard, name="ui")
        # `/ui` itself, which a mount leaves to the app's router (a 307 to `/ui/`): the
        # dashboard's too, as it always was (the login page, or the jobs).
        app.router.routes.append(
            Route("/ui", AtMountPoint(cron.dashboard, "/ui"), include_in_schema=False)
        )
    app.include_router(api.health_router)
    app.add_api_route(
        "/metrics",
        metrics_endpoint(cron),
        methods=["GET"],
        response_class=Response,
        tags=["operations"],
        responses={200: {"content": {CONTENT_TYPE: {}}, "description": "Prometheus text format"}},
    )
    api.install_handlers(app)
    app.add_middleware(
        BearerAuth,
        tokens=cron.tokens,
        sessions=settings.ui_enabled,
        triggers=cron.trigger_auth,
        prefix=cron.prefix + "/",
    )
    return app


class AtMountPoint:
    """A mounted app, asked for its mount point itself (`/ui`, no slash): it sees the request
    as a mount would pass it, at the empty path below its `root_path`."""

    def __init__(self, app: ASGIApp, path: str) -> None:
        self.app = app
        self.path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        root = scope.get("root_path", "") + self.path
        await self.app({**scope, "root_path": root}, receive, send)


def metrics_endpoint(cron: Cronlock) -> Callable[[], Coroutine[Any, Any, Response]]:
    async def get_metrics() -> Response:
        """Prometheus metrics: this instance's counters plus deployment-wide gauges read from
        the database (overdue jobs, outbox)."""
        return Response(await cron.metrics.scrape(), media_type=CONTENT_TYPE)

    return get_metrics
