"""The dashboard under /ui/ (docs/dashboard.md): server-rendered pages over app/ops.py's views,
a session check before routing, static files under /ui/static/."""

from __future__ import annotations

from fastapi import FastAPI
from starlette.staticfiles import StaticFiles

from app.auth import Tokens
from app.jobs import Registry
from app.settings import Settings


def install(app: FastAPI, registry: Registry, settings: Settings, tokens: Tokens) -> None:
    """Mount the pages and static files, and the session check in front of them (added
    before BearerAuth, so it runs inside it)."""
    from app.ui.pages import router
    from app.ui.session import SessionCheck

    app.mount("/ui/static", StaticFiles(packages=[("app.ui", "static")]), name="ui-static")
    app.include_router(router)
    app.add_middleware(SessionCheck, settings=settings, tokens=tokens)
