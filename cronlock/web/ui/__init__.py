"""The dashboard (docs/dashboard.md): server-rendered pages over cronlock/ops/views.py's views,
as one ASGI app to mount (`cron.dashboard`; the standalone service mounts it at /ui), its
session check before routing, its static files under `<mount>/static/`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cronlock.web.deps import Serving
    from cronlock.web.ui.dashboard import Dashboard


def build(serving: Serving) -> Dashboard:
    """The dashboard of one `Cronlock` (cronlock/web/ui/dashboard.py)."""
    # Imported here: the pages load Jinja2 and their templates, which a host app that does not
    # mount the dashboard never needs.
    from cronlock.web.ui.dashboard import Dashboard

    return Dashboard(serving)
