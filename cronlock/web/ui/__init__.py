"""The dashboard under /ui/ (docs/dashboard.md): server-rendered pages over cronlock/ops/views.py's
views, a session check before routing, static files under /ui/static/."""

from __future__ import annotations

from fastapi import FastAPI
from starlette.staticfiles import StaticFiles

from cronlock.core.jobs import Registry
from cronlock.settings import Settings


def install(app: FastAPI, registry: Registry, settings: Settings) -> None:
    """Mount the pages and static files, and the session check in front of them (added
    before BearerAuth, so it runs inside it)."""
    from cronlock.web.ui.pages import router
    from cronlock.web.ui.session import SessionCheck

    app.mount("/ui/static", StaticFiles(packages=[("cronlock.web.ui", "static")]), name="ui-static")
    app.include_router(router)
    app.add_middleware(SessionCheck, settings=settings)
