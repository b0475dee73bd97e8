"""`Cronlock`: cronlock inside an application of your own.

```python
cron = Cronlock()                       # settings from the environment

@cron.job("daily-digest", schedule="0 7 * * *", tz="Europe/Berlin")
async def daily_digest(ctx: JobContext) -> int: ...

app = FastAPI(lifespan=cron.lifespan)   # or `async with cron.running(): yield` in your own
app.include_router(cron.router)         # POST /cron/<job>, GET /cron/jobs, /cron/runs, ...
```

One object holds one deployment's jobs, its pool and its background loops (catch-up, retries,
alerts, the scheduler, the lease watcher, outbox delivery). It changes nothing of the host app
but what it is asked to add: routes (`router`), the dashboard (`dashboard`, to mount), metrics
(`metrics`, to mount or register), and a readiness check (`ready()`). The standalone service
(cronlock/service.py) is built from the same pieces.

Mistakes of configuration are `SettingsError` or `JobDefinitionError`, raised as early as they
can be seen (construction, declaration, the first look at the router) with a one-line message;
a process that dies of one prints that line, not a traceback (`errors.install_one_line_errors`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Unpack, overload

from fastapi import APIRouter, Request
from pydantic import ValidationError

from cronlock.core import catchup, ledger, retries, scheduler
from cronlock.core.jobs import (
    Job,
    JobFunc,
    JobOptions,
    Plan,
    PlanFunc,
    Registry,
    declared_as,
    define,
    load,
)
from cronlock.core.metrics import Metrics
from cronlock.core.runner import Runner
from cronlock.core.schedules import Schedules
from cronlock.db.engine import check_engine
from cronlock.db.helper import JobLock
from cronlock.db.helper import job_lock as take_job_lock
from cronlock.db.orm import require_sqlalchemy
from cronlock.db.pool import Conn, Database
from cronlock.delivery import alerts, sender
from cronlock.errors import JobDefinitionError, install_one_line_errors
from cronlock.settings import Settings, SettingsError
from cronlock.tracing import Tracing
from cronlock.version import __version__
from cronlock.web import router as cron_router
from cronlock.web import ui
from cronlock.web.answers import Refused
from cronlock.web.auth import Tokens
from cronlock.web.deps import error
from cronlock.web.metrics import MetricsApp, refresh
from cronlock.web.schemes import TriggerAuth

if TYPE_CHECKING:
    from cronlock.web.ui.dashboard import Dashboard

log = logging.getLogger("cronlock")

HOUSEKEEPING = "cronlock.housekeeping"


@dataclass
class Readiness:
    """The answer of `await cron.ready()`: true when cron can run jobs (database reachable, a
    primary, migrations current); `reason` says why not."""

    ok: bool
    reason: str | None = None
    # Said while ready: migrations newer than this code (a rolling deploy's old instances).
    note: str | None = None

    def __bool__(self) -> bool:
        return self.ok


@dataclass
class _Started:
    db: Database
    runner: Runner
    stop: asyncio.Event
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class Cronlock:
    """cronlock in an app: jobs, routes, background loops (see the module docstring)."""

    # (database, schema, instance) of the Cronlocks running in this process. Two on one schema
    # are two instances of one deployment, which is fine when they are told apart (the tests
    # run several in one process, each with its INSTANCE_NAME); under one name (the default,
    # host-pid, is one per process) each would take the other's runs for its own.
    _running: ClassVar[dict[tuple[str, str, str], Cronlock]] = {}

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        jobs: Iterable[str] = (),
        housekeeping: bool = True,
        prefix: str = "/cron",
        engine: Any = None,
        session_class: Any = None,
        tracer_provider: Any = None,
    ) -> None:
        """`settings`: None reads the environment (and .env) as the service does. `jobs`:
        modules whose `@job`s to serve, besides those declared with `@cron.job` (CRON_JOBS,
        when set, adds its modules too). `housekeeping`: serve cronlock's own `ledger-prune`.
        `prefix`: where `router` puts its routes. `engine`, `session_class`: your SQLAlchemy
        AsyncEngine to take connections from, and the class of `ctx.session` (docs/orm.md).
        `tracer_provider`: an OpenTelemetry tracer provider to trace with instead of the
        global one (docs/tracing.md)."""
        install_one_line_errors()
        if settings is None:
            try:
                settings = Settings()
            except ValidationError as exc:
                raise SettingsError(one_line(exc)) from None
        if not prefix.startswith("/") or prefix.endswith("/"):
            raise SettingsError(f"prefix={prefix!r}: start it with '/' and end it without one")
        modules = list(dict.fromkeys(jobs))
        if "cron_jobs" in settings.model_fields_set:
            modules += [m for m in settings.job_modules if m not in modules]
        if housekeeping and HOUSEKEEPING not in modules:
            modules.append(HOUSEKEEPING)
        # What every part below reads (the pool's migrations, the CLI's view): these modules.
        self._settings = settings.model_copy(update={"cron_jobs": ",".join(modules)})
        # Every token (CRON_SECRET_FILE's too) read and checked once, here: the router, the
        # dashboard and the metrics all ask this one object (docs/operating.md, rotating).
        self.tokens = Tokens.from_settings(self._settings)
        # How a trigger may authenticate (TRIGGER_AUTH), checked now, built once.
        self.trigger_auth = TriggerAuth.from_settings(self._settings, self.tokens)
        self._settings.check_email()
        self._settings.check_retention()
        self.prefix = prefix
        self.engine = engine
        self.session_class = session_class
        self.tracer_provider = tracer_provider
        if session_class is not None:
            require_sqlalchemy("Cronlock(session_class=...)")
        if engine is not None:
            check_engine(engine)
            if not self._settings.database_url:
                # The few connections of cronlock's own that a pool cannot lend (LISTEN for the
                # outbox, the CLI) go where the engine goes.
                url = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
                self._settings = self._settings.model_copy(update={"database_url": url})
        self._declared: dict[str, Job] = {}
        self._registry: Registry | None = None
        self._router: APIRouter | None = None
        self._metrics: MetricsApp | None = None
        self._dashboard: Dashboard | None = None
        self._counters: Metrics | None = None
        self._started: _Started | None = None

    # --- declaring ---------------------------------------------------------------------------

    @overload
    def job(
        self, name: str, *, fanout: Literal[True], **options: Unpack[JobOptions]
    ) -> Callable[[PlanFunc], Plan]: ...
    @overload
    def job(
        self, name: str, *, fanout: Literal[False] = False, **options: Unpack[JobOptions]
    ) -> Callable[[JobFunc], JobFunc]: ...
    def job(self, name: str, *, fanout: bool = False, **options: Unpack[JobOptions]) -> Any:
        """Declare a job served by this Cronlock: the same arguments as `@job` (`fanout=True`
        returns a `Plan`, with `.each` and `.done`)."""
        make = define(name, fanout=fanout, **options)

        def register(func: Any) -> Any:
            if self._registry is not None:
                raise JobDefinitionError(
                    f"job {name!r} is declared after cron's jobs were collected (by cron.router, "
                    "cron.dashboard or the start): declare every job before those"
                )
            if name in self._declared:
                raise JobDefinitionError(
                    f"job {name!r} is declared twice ({self._declared[name].module} and "
                    f"{func.__module__}): rename one"
                )
            self._declared[name] = declared = make(func)
            return declared_as(declared, func)

        return register

    @property
    def settings(self) -> Settings:
        return self._settings

    def job_lock(
        self, conn: Any, job: str, key: str | None = None
    ) -> contextlib.AbstractAsyncContextManager[JobLock]:
        """`cronlock.job_lock` with this Cronlock's schema and namespace: the very lock its
        runs of `job` take (docs/orm.md)."""
        s = self._settings
        return take_job_lock(conn, job, schema=s.db_schema, namespace=s.lock_namespace, key=key)

    @property
    def schedules(self) -> Schedules:
        """The schedules of dynamic jobs (`schedule="dynamic"`), set in your own transaction:
        `await cron.schedules.set(conn, job, key, schedule=..., tz=..., params=...)`
        (cronlock/core/schedules.py, docs/dynamic-schedules.md)."""
        return Schedules(lambda: self.jobs, self._settings)

    @property
    def jobs(self) -> Registry:
        """Every job this Cronlock serves, collected (and checked) at the first look."""
        if self._registry is None:
            s = self._settings
            registry = load(s.job_modules, s.lock_namespace, s.db_schema, self._declared)
            alerts.check(registry, s)
            registry.check_leases(s.db_query_timeout, s.lease_margin)
            self._registry = registry
        return self._registry

    # --- what the host places ------------------------------------------------------------

    @property
    def router(self) -> APIRouter:
        """The routes under `prefix`, each checking its own token (module cronlock/web/router)."""
        if self._router is None:
            self._router = cron_router.build(self, self.jobs, self.prefix)
        return self._router

    @property
    def dashboard(self) -> Dashboard:
        """The dashboard, an ASGI app to mount: `app.mount("/cron/ui", cron.dashboard)`. Its
        links and cookies follow the path it is mounted at (cronlock/web/ui/dashboard.py)."""
        if self._dashboard is None:
            self._dashboard = ui.build(self)
        return self._dashboard

    @property
    def metrics(self) -> MetricsApp:
        """An ASGI app to mount, and a collector to register (cronlock/web/metrics.py)."""
        if self._metrics is None:
            self._metrics = MetricsApp(self)
        return self._metrics

    @property
    def counters(self) -> Metrics:
        """This instance's Prometheus series (what `metrics` serves)."""
        if self._counters is None:
            lease_jobs = [name for name, job in self.jobs.items() if job.lease is not None]
            self._counters = Metrics(self.jobs, lease_jobs)
        return self._counters

    async def ready(self) -> Readiness:
        """For the host's readiness probe: can cron run jobs now?"""
        if self._started is None:
            return Readiness(False, "cronlock is not running (cron.lifespan or cron.running())")
        db = self._started.db
        problem = await db.check(apply_migrations=False)
        if problem is not None:
            return Readiness(False, problem)
        return Readiness(True, note=db.note)

    # --- serving ---------------------------------------------------------------------------

    @property
    def database(self) -> Database | None:
        return self._started.db if self._started is not None else None

    @property
    def runner(self) -> Runner | None:
        return self._started.runner if self._started is not None else None

    def bind(self, request: Request) -> None:
        """Give a request of cron's routes this Cronlock's objects (see cronlock/web/deps.py)."""
        started = self._started
        if started is None:
            raise Refused(
                error(
                    503,
                    "cronlock is not running",
                    reason="the app's lifespan does not start it: cron.lifespan, or "
                    "`async with cron.running():` in the app's own",
                )
            )
        state = request.scope.setdefault("state", {})
        state["settings"] = self._settings
        state["registry"] = self.jobs
        state["db"] = started.db
        state["runner"] = started.runner
        state["tokens"] = self.tokens

    def state(self) -> dict[str, Any]:
        """The objects cron's routes read, as a lifespan's state (the standalone service)."""
        started = self._started
        assert started is not None, "cron is not running"
        return {
            "settings": self._settings,
            "registry": self.jobs,
            "db": started.db,
            "runner": started.runner,
            "tokens": self.tokens,
        }

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Start everything (pool, background loops); stop it all at the end."""
        if self._started is not None:
            raise SettingsError("this Cronlock is running already: start it once")
        s = self._settings
        where = (s.database_url or f"engine:{id(self.engine)}", s.db_schema, s.instance_name)
        if where in self._running:
            raise SettingsError(
                f"two Cronlocks on schema {s.db_schema!r} of one database in this process: "
                "give each its own DB_SCHEMA (Settings(db_schema=...))"
            )
        registry = self.jobs
        names = list(registry)

        async def see_jobs(conn: Conn) -> None:
            # Each job's history starts when the database first sees it (core/due.py).
            await ledger.see_jobs(conn, s.db_schema, names)

        db = Database(s, engine=self.engine, on_ready=see_jobs)
        await db.open()
        runner = Runner(
            s,
            registry,
            db,
            metrics=self.counters,
            session_class=self.session_class,
            # Decided now, at start: a provider the host app sets before its lifespan counts.
            tracing=Tracing.detect(s, self.tracer_provider),
        )
        started = _Started(db, runner, asyncio.Event())
        self._running[where] = self
        self._started = started
        try:
            started.tasks = self._loops(started)
            log.info(
                "cronlock %s started",
                __version__,
                extra={"instance": s.instance_name, "jobs": list(registry)},
            )
            yield
        finally:
            await self._stop(started)
            self._started = None
            self._running.pop(where, None)

    def lifespan(self, app: Any) -> contextlib.AbstractAsyncContextManager[None]:
        """`FastAPI(lifespan=cron.lifespan)`: `running()`, after checking that the app holds
        cron's router once."""
        if self._router is not None and cron_router.mounted_twice(app.routes, self._router):
            raise SettingsError(
                "cron.router is included twice in this app: include it once "
                "(one prefix per Cronlock)"
            )
        return self.running()

    def _loops(self, started: _Started) -> list[asyncio.Task[None]]:
        s, registry, runner, stop = self._settings, self.jobs, started.runner, started.stop
        loops = [asyncio.create_task(started.db.watch(stop), name="cronlock:db-watch")]
        if any(job.catch_up for job in registry.values()):
            loops.append(self._task(catchup.catch_up_loop(runner, stop), "catch-up"))
        if any(job.retries for job in registry.values()):
            loops.append(self._task(retries.retry_loop(runner, stop), "retries"))
        if alerts.enabled(registry, s):
            loops.append(self._task(alerts.alert_loop(runner, stop), "alerts"))
        if s.scheduler_enabled:
            loops.append(self._task(scheduler.scheduler_loop(runner, stop), "scheduler"))
        if any(job.lease is not None for job in registry.values()):
            loops.append(self._task(runner.leases.watch(stop), "lease-watch"))
        if any(job.fanout is not None for job in registry.values()):
            loops.append(self._task(runner.fanouts.work(stop), "fanout"))
        if s.outbox_enabled:
            loops.append(
                self._task(_deliver(started.db, s, stop, started.runner.tracing), "outbox")
            )
        if self._metrics is not None:
            loops.append(self._task(self._refresh_metrics(started), "metrics"))
        return loops

    @staticmethod
    def _task(coro: Any, name: str) -> asyncio.Task[None]:
        return asyncio.create_task(coro, name=f"cronlock:{name}")

    async def _refresh_metrics(self, started: _Started) -> None:
        """Keep the deployment-wide gauges fresh for a host registry that collects them."""
        while not started.stop.is_set():
            with contextlib.suppress(Exception):
                await refresh(self.counters, started.db, self.jobs)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(started.stop.wait(), self._settings.metrics_refresh_interval)

    async def _stop(self, started: _Started) -> None:
        s = self._settings
        started.stop.set()
        await started.runner.shutdown(s.graceful_shutdown_timeout)
        if started.tasks:
            _, late = await asyncio.wait(started.tasks, timeout=s.outbox_shutdown_timeout + 1)
            for task in late:
                task.cancel()
            if late:
                # Let them unwind (give back rows, close connections) before the pool goes.
                await asyncio.wait(late, timeout=1.0)
        await started.db.close()


def one_line(exc: ValidationError) -> str:
    """A settings ValidationError as one line naming each setting and what is wrong."""
    problems = []
    for e in exc.errors(include_url=False, include_input=False):
        name = ".".join(str(part) for part in e["loc"]).upper()
        problems.append(f"{name}: {e['msg']}")
    return "invalid settings: " + "; ".join(problems)


async def _deliver(db: Database, settings: Settings, stop: asyncio.Event, tracing: Tracing) -> None:
    """The outbox delivery loop of this instance; it waits for the database like everything
    else and never takes the service down with it."""
    while not stop.is_set():
        try:
            await sender.run_in_app(db.pool, settings, stop, tracing)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("outbox delivery loop failed; restarting it")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), settings.outbox_poll_interval)
