"""The app factory: `uvicorn --factory cronlock.service:create_app`. Nothing happens at import
time."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import sys
from collections.abc import AsyncIterator
from typing import TypedDict

from fastapi import FastAPI
from pydantic import SecretStr

from cronlock import __version__, logs
from cronlock.core import catchup, retries, scheduler
from cronlock.core.jobs import Registry, load
from cronlock.core.metrics import Metrics
from cronlock.core.runner import Runner
from cronlock.db.pool import Database
from cronlock.delivery import alerts, sender
from cronlock.errors import JobDefinitionError
from cronlock.settings import Settings, SettingsError
from cronlock.web import api, ui
from cronlock.web.auth import BearerAuth

log = logging.getLogger("cronlock")


class State(TypedDict):
    settings: Settings
    registry: Registry
    db: Database
    runner: Runner


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the service. Refuses (SystemExit with the reason when started by uvicorn) to start
    without a usable secret, or with jobs that are declared wrongly."""
    from_env = settings is None
    try:
        settings = settings or Settings()
        settings.check_secrets()
        settings.check_email()
        settings.check_retention()
        registry = load(settings.job_modules, settings.lock_namespace, settings.db_schema)
        alerts.check(registry, settings)
        registry.check_leases(settings.db_query_timeout, settings.lease_margin)
    except (SettingsError, JobDefinitionError) as exc:
        if from_env:
            print(f"cronlock: cannot start: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        raise
    if from_env:
        logs.setup(settings.log_format, settings.log_level)
    return build(settings, registry)


def build(settings: Settings, registry: Registry) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[State]:
        db = Database(settings)
        await db.open()
        lease_jobs = [name for name, job in registry.items() if job.lease is not None]
        runner = Runner(settings, registry, db, metrics=Metrics(registry, lease_jobs))
        stop = asyncio.Event()
        tasks = [asyncio.create_task(db.watch(stop), name="db-watch")]
        if any(job.catch_up for job in registry.values()):
            tasks.append(asyncio.create_task(catchup.catch_up_loop(runner, stop), name="catch-up"))
        if any(job.retries for job in registry.values()):
            tasks.append(asyncio.create_task(retries.retry_loop(runner, stop), name="retries"))
        if alerts.enabled(registry, settings):
            tasks.append(asyncio.create_task(alerts.alert_loop(runner, stop), name="alerts"))
        if settings.scheduler_enabled:
            tasks.append(
                asyncio.create_task(scheduler.scheduler_loop(runner, stop), name="scheduler")
            )
        if lease_jobs:
            tasks.append(asyncio.create_task(runner.leases.watch(stop), name="lease-watch"))
        if settings.outbox_enabled:
            tasks.append(asyncio.create_task(_deliver(db, settings, stop), name="outbox"))
        # What exists now (the app, its routes and models, imported modules) lives as long as
        # the process: kept out of the collector's full passes, which otherwise walk all of it
        # and stall every request in flight for tens of milliseconds (bench/trigger.py's p99).
        gc.collect()
        gc.freeze()
        log.info(
            "cronlock %s started",
            __version__,
            extra={"instance": settings.instance_name, "jobs": list(registry)},
        )
        try:
            yield {"settings": settings, "registry": registry, "db": db, "runner": runner}
        finally:
            stop.set()
            await runner.shutdown(settings.graceful_shutdown_timeout)
            _, late = await asyncio.wait(tasks, timeout=settings.outbox_shutdown_timeout + 1)
            for task in late:
                task.cancel()
            if late:
                # Let them unwind (give back rows, close connections) before the pool goes.
                await asyncio.wait(late, timeout=1.0)
            await db.close()

    app = FastAPI(
        title="cronlock",
        version=__version__,
        description="Scheduled jobs that run exactly once across instances.",
        lifespan=lifespan,
    )
    if settings.ui_enabled:
        # Before api.install: its session check then sits inside TriggerDispatch (and
        # BearerAuth), so a trigger never passes through it.
        ui.install(app, registry, settings)
    api.install(app, registry, settings)
    tokens = settings.secrets()
    app.add_middleware(
        BearerAuth,
        run_tokens=tokens,
        read_tokens=_token(settings.cron_read_token),
        metrics_tokens=_token(settings.metrics_token),
        sessions=settings.ui_enabled,
    )
    return app


def _token(secret: SecretStr | None) -> list[bytes]:
    return [secret.get_secret_value().encode()] if secret is not None else []


async def _deliver(db: Database, settings: Settings, stop: asyncio.Event) -> None:
    """The outbox delivery loop of this instance; it waits for the database like everything
    else and never takes the service down with it."""
    while not stop.is_set():
        try:
            await sender.run_in_app(db.pool, settings, stop)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("outbox delivery loop failed; restarting it")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), settings.outbox_poll_interval)
