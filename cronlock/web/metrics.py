"""`cron.metrics`: cronlock's Prometheus metrics, for a host app to place.

Either mount it (`app.mount("/cron/metrics", cron.metrics)`: an ASGI app answering a scrape
with this instance's counters and the deployment-wide gauges read from the database at that
moment, behind METRICS_TOKEN, the read token or the secret), or add it to the host's own
registry (`prometheus_client.REGISTRY.register(cron.metrics)`: a collector; its
deployment-wide gauges are read again every METRICS_REFRESH_INTERVAL while cron runs). The
standalone service serves the same app at `/metrics`.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Protocol

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from cronlock.core import ledger, pause, schedules
from cronlock.core.due import is_overdue
from cronlock.core.jobs import Registry
from cronlock.core.metrics import CONTENT_TYPE, Metrics
from cronlock.db.pool import Database
from cronlock.errors import DatabaseUnavailable
from cronlock.ops.views import NOW_AND_ROLE_SQL, outbox_stats, reading
from cronlock.web.answers import authorized, unauthorized
from cronlock.web.auth import Access
from cronlock.web.deps import Serving, error


async def refresh(metrics: Metrics, db: Database, registry: Registry) -> None:
    """Read the deployment-wide gauges (overdue jobs, pauses, the outbox) from the database;
    `cronlock_database_up` says whether that worked on a primary."""
    try:
        async with db.connection() as conn, reading(conn):
            clock = await conn.fetchrow(NOW_AND_ROLE_SQL)
            assert clock is not None
            if clock["standby"]:
                # Its reads would succeed, but no trigger runs on it (503): down, as an alert
                # must see it. The deployment-wide series keep their last primary's values.
                metrics.database_up.set(0)
                return
            now: datetime = clock["now"]
            succeeded = await ledger.last_succeeded_slots(conn, registry.schema, list(registry))
            seen = await ledger.first_seen(conn, registry.schema, list(registry))
            paused = await pause.active(conn, registry.schema)
            overdue = {
                j.name: j.name not in paused
                and is_overdue(j, now, succeeded.get(j.name), seen.get(j.name))
                for j in registry.values()
                if j.schedule is not None
            }
            # Dynamic jobs: overdue while any key's run is late (core/schedules.py `stats`).
            dynamic = [j for j in registry.values() if j.dynamic]
            counts = await schedules.stats(conn, registry.schema, dynamic) if dynamic else {}
            metrics.set_schedules(counts)
            for j in dynamic:
                overdue[j.name] = j.name not in paused and counts[j.name]["late"] > 0
            metrics.set_jobs(overdue, succeeded)
            metrics.set_paused(
                {name: (now - p.at).total_seconds() for name, p in paused.items()}, registry
            )
            stats = await outbox_stats(conn, registry.schema)
            if stats is not None:
                metrics.set_outbox(stats)
        metrics.database_up.set(1)
    except DatabaseUnavailable:
        metrics.database_up.set(0)


class Source(Serving, Protocol):
    """What the metrics are read from: a started Cronlock's database and jobs."""

    @property
    def counters(self) -> Metrics: ...

    @property
    def database(self) -> Database | None: ...

    @property
    def jobs(self) -> Registry: ...


class MetricsApp:
    """The ASGI app and the Prometheus collector (see the module docstring)."""

    def __init__(self, source: Source) -> None:
        self.source = source

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        response: Response
        if not authorized(request, self.source.tokens, Access.METRICS):
            response = unauthorized()
        elif request.method not in ("GET", "HEAD"):
            response = error(405, "method not allowed", allow="GET, HEAD")
            response.headers["Allow"] = "GET, HEAD"
        else:
            response = Response(await self.scrape(), media_type=CONTENT_TYPE)
        await response(scope, receive, send)

    async def scrape(self) -> bytes:
        """The text a scrape answers: the gauges read now, then everything rendered."""
        db = self.source.database
        if db is None:
            self.source.counters.database_up.set(0)
        else:
            await refresh(self.source.counters, db, self.source.jobs)
        return generate_latest(self)

    def collect(self) -> Iterator[Metric]:
        """prometheus_client's collector protocol. The `*_created` series are left out (they
        double the output and no dashboard of ours reads them), here rather than with
        prometheus_client's process-wide switch, which would change the host's metrics too."""
        for family in self.source.counters.registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family
