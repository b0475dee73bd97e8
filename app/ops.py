"""What an operator sees and does: jobs, runs, locks, metrics, and catching up a missed slot.

The views are plain functions of a connection, shared by the routes below and by the CLI
(`python -m app jobs|runs|locks`), so both show the same thing.

"Running" here only ever comes from `pg_locks`: a transaction-level advisory lock exists
exactly while its run's transaction does, whereas a ledger row says `running` until someone
writes otherwise, which a killed instance never does. Such rows are closed as `abandoned`
(`ledger.close_abandoned`) whenever jobs or runs are listed.

Overdue: a job is overdue when the newest tick whose grace period has passed (the *due slot*)
has no succeeded scheduled or backfill run, and no later tick has one either. Measuring
against the newest success (rather than only the current slot) keeps a job overdue from a
missed tick until a run succeeds, instead of clearing at the next tick and flapping.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Annotated, Any, Literal, get_args

import asyncpg
from fastapi import APIRouter, Path, Query
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, PlainSerializer

from app import ledger, outbox
from app.db import Conn
from app.deps import DatabaseDep, RegistryDep, RunnerDep, SettingsDep, error
from app.errors import (
    CONNECTION_ERRORS,
    DRIVER_ERRORS,
    DatabaseUnavailable,
    InvalidTrigger,
    describe,
    translate,
)
from app.inputs import BIGINT_MAX
from app.jobs import NAME_PATTERN, Job, Registry
from app.lock import LockKey, held_locks, internal_lock, lock_key
from app.metrics import CONTENT_TYPE
from app.outcome import Outcome
from app.runner import Runner
from app.schedule import ScheduleError
from app.settings import Settings

log = logging.getLogger("cronlock.ops")

# Ledger timestamps are shown exactly as the trigger answers show them (`isoformat()`).
Timestamp = Annotated[datetime, PlainSerializer(lambda d: d.isoformat(), return_type=str)]

RunStatus = Literal["running", "succeeded", "failed", "timed_out", "cancelled", "abandoned"]
RUN_STATUSES: tuple[str, ...] = get_args(RunStatus)

# A dashboard must never hang a pooled connection on a slow catalog or ledger query.
READ_TIMEOUT_SQL = "SELECT set_config('statement_timeout', '5000ms', true)"
NOW_SQL = "SELECT now()"

CANCEL_SQL = "SELECT pg_cancel_backend($1)"
TERMINATE_SQL = "SELECT pg_terminate_backend($1)"

# Serialises catch-up decisions across the instances of one deployment (see `catch_up`).
CATCH_UP = "catch-up"
CATCH_UP_LOCK_SQL = """
SELECT set_config('idle_in_transaction_session_timeout', $3, true),
       pg_try_advisory_xact_lock(hashtextextended($1, $2)) AS locked,
       now() AS db_now
"""


SWEEP_ERRORS: tuple[type[BaseException], ...] = (asyncpg.PostgresError, *CONNECTION_ERRORS)


# --- views ----------------------------------------------------------------------------------


class LockView(BaseModel):
    """One advisory lock in this database, mapped back to its job where it is one."""

    job: str | None
    # The 64-bit key as a string (JSON numbers lose precision above 2**53 in JavaScript and
    # jq), and as pg_locks shows it: classid = high 32 bits, objid = low 32 bits.
    key: str
    classid: int
    objid: int
    pid: int
    holder: str | None  # application_name: "cronlock:<instance>" for cronlock's own sessions
    instance: str | None
    state: str | None
    held_for: float | None  # seconds since the holding transaction began
    granted: bool
    run_id: int | None


class RunView(BaseModel):
    id: int
    job: str
    slot: Timestamp | None
    status: RunStatus
    trigger: str
    source: str
    instance: str
    started_at: Timestamp
    finished_at: Timestamp | None
    duration_ms: float | None
    params: Any
    result: Any
    error: str | None
    # From pg_locks: the job's lock is held by the backend that recorded this run.
    running: bool


class RunsPage(BaseModel):
    runs: list[RunView]
    # Pass as `before=` for the next (older) page; null on the last page.
    next: int | None


class LastRun(BaseModel):
    """A job's newest finished run: the ledger row's fields that /cron/jobs shows."""

    model_config = ConfigDict(from_attributes=True)

    id: int
    status: RunStatus
    slot: Timestamp | None
    trigger: str
    instance: str
    started_at: Timestamp
    finished_at: Timestamp | None
    duration_ms: float | None
    error: str | None


class Holder(BaseModel):
    """Where a job runs now: the fields of its lock (LockView) that /cron/jobs shows."""

    model_config = ConfigDict(from_attributes=True)

    instance: str | None
    pid: int
    state: str | None
    held_for: float | None
    run_id: int | None


class JobView(BaseModel):
    name: str
    description: str
    schedule: str | None
    tz: str | None
    timeout: float
    grace: float
    early_tolerance: float
    max_lateness: float | None
    catch_up: bool
    lock_key: str  # a 64-bit integer, as a string (see LockView.key)
    current_slot: Timestamp | None
    next_slot: Timestamp | None
    due_slot: Timestamp | None
    last_success_slot: Timestamp | None
    last_run: LastRun | None
    running: bool
    running_on: Holder | None
    overdue: bool


class JobsView(BaseModel):
    now: Timestamp  # the database's clock, which every slot above is relative to
    jobs: list[JobView]


class LocksView(BaseModel):
    locks: list[LockView]


def due_slot(job: Job, now: datetime) -> datetime | None:
    """The newest tick whose grace period has passed at `now`."""
    if job.schedule is None:
        return None
    try:
        return job.schedule.prev_tick(now - timedelta(seconds=job.grace))
    except ScheduleError:
        return None


def is_overdue(job: Job, now: datetime, last_success: datetime | None) -> bool:
    due = due_slot(job, now)
    return due is not None and (last_success is None or last_success < due)


def _instance(application_name: str | None) -> str | None:
    if application_name and application_name.startswith("cronlock:"):
        return application_name.removeprefix("cronlock:")
    return application_name or None


def _names(registry: Registry) -> dict[int, str]:
    # The locks cronlock takes that are not jobs, so `locks` can name them too.
    names = {
        lock_key(internal_lock(registry.schema, "migrate"), 0).key: "(migrations)",
        lock_key(internal_lock(registry.schema, CATCH_UP), registry.namespace).key: "(catch-up)",
    }
    names.update(registry.by_key())
    return names


async def locks(conn: Conn, registry: Registry) -> list[LockView]:
    """Every advisory lock in this database, oldest holder first."""
    rows = await held_locks(conn)
    names = _names(registry)
    granted = [r["pid"] for r in rows if r["granted"]]
    run_ids = await ledger.running_by_pid(conn, registry.schema, granted)
    found = []
    for r in rows:
        key = LockKey.from_pg_locks(r["classid"], r["objid"]).key
        found.append(
            LockView(
                job=names.get(key),
                key=str(key),
                classid=r["classid"],
                objid=r["objid"],
                pid=r["pid"],
                holder=r["application_name"] or None,
                instance=_instance(r["application_name"]),
                state=r["state"],
                held_for=round(r["held_for"], 3) if r["held_for"] is not None else None,
                granted=r["granted"],
                run_id=run_ids.get(r["pid"]) if r["granted"] else None,
            )
        )
    return found


def _holders(held: list[LockView], registry: Registry) -> dict[str, LockView]:
    return {lk.job: lk for lk in held if lk.granted and lk.job is not None and lk.job in registry}


async def sweep(conn: Conn, settings: Settings, job: str | None = None) -> list[int]:
    """Close `running` rows whose lock is gone (cheap: the partial index on running rows).

    Best effort: on a standby or a read-only connection the rows simply stay for later.
    """
    try:
        return await ledger.close_abandoned(conn, settings.db_schema, settings.lock_namespace, job)
    except SWEEP_ERRORS as exc:
        log.debug("could not close abandoned runs: %s", describe(exc))
        return []


async def jobs(conn: Conn, registry: Registry, *, now: datetime | None = None) -> JobsView:
    """Every job's state; `now` defaults to the database's clock (tests pass another)."""
    if now is None:
        now = await conn.fetchval(NOW_SQL)
        assert now is not None
    names = list(registry)
    holders = _holders(await locks(conn, registry), registry)
    last = await ledger.last_runs(conn, registry.schema, names)
    succeeded = await ledger.last_succeeded_slots(conn, registry.schema, names)
    views = []
    for job in registry.values():
        current = nxt = None
        if job.schedule is not None:
            with contextlib.suppress(ScheduleError):
                current = job.schedule.prev_tick(now)
                nxt = job.schedule.next_tick(now)
        run = last.get(job.name)
        holder = holders.get(job.name)
        views.append(
            JobView(
                name=job.name,
                description=job.description,
                schedule=job.schedule.expr if job.schedule else None,
                tz=job.tz,
                timeout=job.timeout,
                grace=job.grace,
                early_tolerance=job.early_tolerance,
                max_lateness=job.max_lateness,
                catch_up=job.catch_up,
                lock_key=str(registry.key(job.name)),
                current_slot=current,
                next_slot=nxt,
                due_slot=due_slot(job, now),
                last_success_slot=succeeded.get(job.name),
                last_run=LastRun.model_validate(run) if run is not None else None,
                running=holder is not None,
                running_on=Holder.model_validate(holder) if holder is not None else None,
                overdue=is_overdue(job, now, succeeded.get(job.name)),
            )
        )
    return JobsView(now=now, jobs=views)


def _run_view(run: ledger.Run, held: dict[str, LockView]) -> RunView:
    holder = held.get(run.job)
    return RunView(
        id=run.id,
        job=run.job,
        slot=run.slot,
        status=run.status,
        trigger=run.trigger,
        source=run.source,
        instance=run.instance,
        started_at=run.started_at,
        finished_at=run.finished_at,
        duration_ms=run.duration_ms,
        params=run.params,
        result=run.result,
        error=run.error,
        running=run.status == "running" and holder is not None and holder.run_id == run.id,
    )


async def runs(
    conn: Conn,
    registry: Registry,
    *,
    job: str | None = None,
    status: str | None = None,
    before: int | None = None,
    limit: int = 50,
) -> RunsPage:
    """Newest first; one row more than asked tells whether there is a next page."""
    found = await ledger.list_runs(
        conn, registry.schema, job=job, status=status, before=before, limit=limit + 1
    )
    page, more = found[:limit], len(found) > limit
    held = _holders(await locks(conn, registry), registry)
    return RunsPage(
        runs=[_run_view(r, held) for r in page], next=page[-1].id if more and page else None
    )


async def run(conn: Conn, registry: Registry, run_id: int) -> RunView | None:
    found = await ledger.get(conn, registry.schema, run_id)
    if found is None:
        return None
    held = _holders(await locks(conn, registry), registry) if found.status == "running" else {}
    return _run_view(found, held)


@contextlib.asynccontextmanager
async def reading(conn: Conn, *, input_from: tuple[str, ...] | None = None) -> AsyncIterator[Conn]:
    """A short transaction with a statement timeout; database errors become
    DatabaseUnavailable (503 for the routes, exit code 3 for the CLI), or InvalidInput (422,
    exit 2) for a value the caller passed in from `input_from` (see `db.translate`)."""
    try:
        async with conn.transaction():
            await conn.execute(READ_TIMEOUT_SQL)
            yield conn
    except DRIVER_ERRORS as exc:
        raise translate(exc, input_from=input_from) from exc


# --- cancel ---------------------------------------------------------------------------------


async def signal_holder(conn: Conn, pid: int, *, terminate: bool) -> bool:
    """pg_cancel_backend (the running statement fails, the transaction rolls back) or
    pg_terminate_backend (the session ends). Sent through the database, so it reaches the
    real backend even behind PgBouncer."""
    return bool(await conn.fetchval(TERMINATE_SQL if terminate else CANCEL_SQL, pid))


# --- catching up ----------------------------------------------------------------------------


def missed_slot(
    job: Job, now: datetime, last_success: datetime | None, backfill_window: float
) -> datetime | None:
    """The slot a `catch_up` job should still run: overdue, young enough to backfill, and not
    later than the job's own `max_lateness` allows."""
    if not job.catch_up or not is_overdue(job, now, last_success):
        return None
    slot = due_slot(job, now)
    assert slot is not None
    late = (now - slot).total_seconds()
    if late > backfill_window or (job.max_lateness is not None and late > job.max_lateness):
        return None
    return slot


async def catch_up(runner: Runner) -> list[Outcome]:
    """Run the missed slot of each job that opted in (`catch_up=True`), at most once per slot.

    "Missed" means no scheduled or backfill run was even attempted for the due slot; a slot
    whose run failed stays overdue for a person to look at. The slot runs as a backfill, so
    its success counts like the scheduled run would have. Decisions are taken under a lock of
    their own and the attempt's ledger row is committed before that lock is released, so two
    instances never both attempt one slot.
    """
    chosen = [j for j in runner.registry.values() if j.catch_up and j.schedule is not None]
    if not chosen:
        return []
    settings, db = runner.settings, runner.db
    await db.ensure_ready()
    outcomes: list[Outcome] = []
    longest = max(j.timeout for j in chosen) + settings.db_timeout_margin
    try:
        async with db.connection(bounded=False) as conn, conn.transaction():
            row = await conn.fetchrow(
                CATCH_UP_LOCK_SQL,
                internal_lock(settings.db_schema, CATCH_UP),
                settings.lock_namespace,
                f"{int(longest * 1000)}ms",
            )
            assert row is not None
            if not row["locked"]:
                return []
            now: datetime = row["db_now"]
            succeeded = await ledger.last_succeeded_slots(
                conn, settings.db_schema, [j.name for j in chosen]
            )
            for job in chosen:
                slot = missed_slot(job, now, succeeded.get(job.name), settings.backfill_window)
                if slot is None or await ledger.slot_attempted(
                    conn, settings.db_schema, job.name, slot
                ):
                    continue
                log.info(
                    "catching up %s", job.name, extra={"job": job.name, "slot": slot.isoformat()}
                )
                try:
                    outcomes.append(await runner.trigger(job, slot=slot, source="catch-up"))
                except InvalidTrigger as exc:
                    log.warning("cannot catch up %s: %s", job.name, exc.args[0])
    except DRIVER_ERRORS as exc:
        raise translate(exc) from exc
    return outcomes


async def catch_up_loop(runner: Runner, stop: asyncio.Event) -> None:
    """`catch_up` in the background of a service instance: as soon as the database is ready,
    then every CATCH_UP_INTERVAL seconds."""
    interval = runner.settings.catch_up_interval
    while not stop.is_set():
        if runner.db.migrated:
            try:
                await catch_up(runner)
            except DatabaseUnavailable as exc:
                log.warning("catch-up skipped: %s", exc.reason)
            except Exception:
                log.exception("catch-up failed")
            wait = interval
        else:
            wait = min(interval, 1.0)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), wait)


async def outbox_stats(conn: Conn, schema: str) -> dict[str, float] | None:
    """The outbox's queue figures, or None where there is no outbox table (not migrated)."""
    try:
        async with conn.transaction():  # a savepoint: a missing table must not end ours
            return await outbox.outbox_stats(conn, schema)
    except asyncpg.UndefinedTableError:
        return None


# --- routes ---------------------------------------------------------------------------------

router = APIRouter(tags=["operations"])

UNAVAILABLE: dict[int | str, dict[str, Any]] = {
    503: {"description": "database unavailable (Retry-After)"}
}

# OpenAPI links: how a client (and a stateful fuzzer) goes from one answer to the next
# request. A trigger's 202 links here too (app/api.py).
GET_RUN = "get_run"
RUN_LINK: dict[str, Any] = {
    "operationId": GET_RUN,
    "parameters": {"run_id": "$response.body#/run_id"},
    "description": "the run this answer names",
}
RUNS_LINKS: dict[str, Any] = {
    "NextPage": {
        "operationId": "get_runs",
        "parameters": {"before": "$response.body#/next"},
        "description": "the next (older) page",
    },
    "NewestRun": {
        "operationId": GET_RUN,
        "parameters": {"run_id": "$response.body#/runs/0/id"},
        "description": "the newest run of this page",
    },
}


@router.get("/cron/jobs", response_model=JobsView, responses=UNAVAILABLE)
async def get_jobs(db: DatabaseDep, registry: RegistryDep, settings: SettingsDep) -> Any:
    """Every registered job: schedule, current and next slot, last run, running now (from
    pg_locks) and where, and whether it is overdue."""
    try:
        async with db.connection() as conn:
            await sweep(conn, settings)
            async with reading(conn):
                return await jobs(conn, registry)
    except DatabaseUnavailable as exc:
        return error(503, "database unavailable", reason=exc.reason)


@router.get(
    "/cron/runs",
    response_model=RunsPage,
    operation_id="get_runs",
    responses={200: {"links": RUNS_LINKS}, **UNAVAILABLE},
)
async def get_runs(
    db: DatabaseDep,
    registry: RegistryDep,
    settings: SettingsDep,
    # Validated here, before any statement: what the database would refuse as a data
    # exception is a 422 naming the parameter (see app/inputs.py).
    job: Annotated[str | None, Query(pattern=NAME_PATTERN.pattern, description="a job name")] = (
        None
    ),
    status: RunStatus | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    before: Annotated[
        int | None, Query(ge=1, le=BIGINT_MAX, description="the `next` of the previous page")
    ] = None,
) -> Any:
    """Run history, newest first, one page at a time."""
    try:
        async with db.connection() as conn:
            await sweep(conn, settings, job)
            async with reading(conn, input_from=("query",)):
                return await runs(
                    conn, registry, job=job, status=status, before=before, limit=limit
                )
    except DatabaseUnavailable as exc:
        return error(503, "database unavailable", reason=exc.reason)


@router.get(
    "/cron/runs/{run_id}",
    response_model=RunView,
    operation_id=GET_RUN,
    responses={404: {"description": "no such run"}, **UNAVAILABLE},
)
async def get_run(
    run_id: Annotated[int, Path(ge=1, le=BIGINT_MAX, description="a run id (bigint)")],
    db: DatabaseDep,
    registry: RegistryDep,
    settings: SettingsDep,
) -> Any:
    """One run; poll it to follow a run started with `wait=false`."""
    try:
        async with db.connection() as conn:
            async with reading(conn, input_from=("path", "run_id")):
                found = await run(conn, registry, run_id)
            # A running row without its lock: the instance may have died. Settle it, look again.
            stale = found is not None and found.status == "running" and not found.running
            if stale and found is not None and await sweep(conn, settings, found.job):
                async with reading(conn, input_from=("path", "run_id")):
                    found = await run(conn, registry, run_id)
    except DatabaseUnavailable as exc:
        return error(503, "database unavailable", reason=exc.reason)
    if found is None:
        return error(404, "unknown run", id=run_id)
    return found


@router.get("/cron/locks", response_model=LocksView, responses=UNAVAILABLE)
async def get_locks(db: DatabaseDep, registry: RegistryDep) -> Any:
    """Advisory locks held in this database (pg_locks joined to pg_stat_activity), each mapped
    to its job, with the holding instance, its state and how long it has held the lock."""
    try:
        async with db.connection() as conn, reading(conn):
            return LocksView(locks=await locks(conn, registry))
    except DatabaseUnavailable as exc:
        return error(503, "database unavailable", reason=exc.reason)


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE: {}}, "description": "Prometheus text format"}},
)
async def get_metrics(runner: RunnerDep, db: DatabaseDep, registry: RegistryDep) -> Response:
    """Prometheus metrics: this instance's counters plus deployment-wide gauges read from the
    database (overdue jobs, outbox)."""
    metrics = runner.metrics
    if metrics is None:
        return error(404, "metrics are not enabled")
    try:
        async with db.connection() as conn, reading(conn):
            now: datetime = await conn.fetchval(NOW_SQL)
            succeeded = await ledger.last_succeeded_slots(conn, registry.schema, list(registry))
            overdue = {
                j.name: is_overdue(j, now, succeeded.get(j.name))
                for j in registry.values()
                if j.schedule is not None
            }
            metrics.set_jobs(overdue, succeeded)
            stats = await outbox_stats(conn, registry.schema)
            if stats is not None:
                metrics.set_outbox(stats)
        metrics.database_up.set(1)
    except DatabaseUnavailable:
        metrics.database_up.set(0)
    return Response(metrics.render(), media_type=CONTENT_TYPE)
