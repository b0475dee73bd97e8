"""The app factory: `uvicorn --factory app.main:create_app`. Nothing happens at import time."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import sys
from collections.abc import AsyncIterator
from typing import TypedDict

from fastapi import FastAPI

from app import __version__, alerts, api, catchup, logs, retries, scheduler, sender, ui
from app.auth import BearerAuth, Tokens
from app.db import Database
from app.errors import JobDefinitionError
from app.jobs import Registry, load
from app.metrics import Metrics
from app.runner import Runner
from app.settings import Settings, SettingsError

log = logging.getLogger("cronlock")


class State(TypedDict):
    settings: Settings
    registry: Registry
    db: Database
    runner: Runner
    tokens: Tokens


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the service. Refuses (SystemExit with the reason when started by uvicorn) to start
    without a usable secret, or with jobs that are declared wrongly."""
    from_env = settings is None
    try:
        settings = settings or Settings()
        # Read (CRON_SECRET_FILE too) and checked once, here: every surface asks this object.
        tokens = Tokens.from_settings(settings)
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
    return build(settings, registry, tokens)


def build(settings: Settings, registry: Registry, tokens: Tokens) -> FastAPI:
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
            yield {
                "settings": settings,
                "registry": registry,
                "db": db,
                "runner": runner,
                "tokens": tokens,
            }
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
        ui.install(app, registry, settings, tokens)
    api.install(app, registry, settings)
    app.add_middleware(BearerAuth, tokens=tokens, sessions=settings.ui_enabled)
    return app


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
