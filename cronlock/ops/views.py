"""What an operator sees and does: jobs, runs, locks, and signalling a lock's holder.

The views are plain functions of a connection, shared by the read routes (cronlock/web/routes.py)
and by the CLI (`python -m cronlock jobs|runs|locks`), so both show the same thing; nothing here
needs the web framework.

"Running" comes from `pg_locks` for one-transaction runs: a transaction-level advisory lock
exists exactly while its run's transaction does, whereas a ledger row says `running` until
someone writes otherwise, which a killed instance never does. Such rows are closed as
`abandoned` (`ledger.close_abandoned`) whenever jobs or runs are listed. A lease run holds no
lock while it runs: it is running while its lease is live on the database's clock
(cronlock/core/lease.py), and `locks` shows its lease next to the advisory locks.

A keyed run's lock is a hash of its key, which cannot be turned back into the key: the lock
is named by the `running` row its backend recorded (backend pid and key), once the hash of
that row's job and key is seen to be the lock's.

Overdue: see cronlock/core/due.py.

Long on purpose: every view an operator reads (jobs, runs, locks, the outbox) with its answer
models, shared by the routes and the CLI; one module keeps the two showing the same thing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, Literal, get_args

import asyncpg
from pydantic import BaseModel, ConfigDict, Field, PlainSerializer

from cronlock.core import cancel as requests
from cronlock.core import fanout, lease, ledger, pause, retries, schedules
from cronlock.core.catchup import CATCH_UP
from cronlock.core.due import due_slot, is_overdue
from cronlock.core.jobs import Registry
from cronlock.core.schedule import ScheduleError
from cronlock.db.lock import LockKey, held_locks, internal_lock, lock_key
from cronlock.db.pool import Conn, deadline
from cronlock.delivery import outbox
from cronlock.errors import (
    DRIVER_ERRORS,
    describe,
    translate,
)
from cronlock.settings import Settings

log = logging.getLogger("cronlock.ops")

# Ledger timestamps are shown exactly as the trigger answers show them (`isoformat()`).
Timestamp = Annotated[datetime, PlainSerializer(lambda d: d.isoformat(), return_type=str)]

RunStatus = Literal["running", "succeeded", "failed", "timed_out", "cancelled", "abandoned"]
RUN_STATUSES: tuple[str, ...] = get_args(RunStatus)

# A dashboard must never hang a pooled connection on a slow catalog or ledger query.
READ_TIMEOUT_SQL = "SELECT set_config('statement_timeout', '5000ms', true)"
NOW_SQL = "SELECT now()"
# /metrics: a standby answers reads, but is no database cronlock can run on.
NOW_AND_ROLE_SQL = "SELECT now() AS now, pg_is_in_recovery() AS standby"

CANCEL_SQL = "SELECT pg_cancel_backend($1)"
TERMINATE_SQL = "SELECT pg_terminate_backend($1)"


# How far back /cron/jobs looks for failed slots waiting for a retry (a retry older than this
# is long given up by max_lateness or the backfill window in any sane configuration).
RETRY_VIEW_WINDOW = 86400.0


# --- views ----------------------------------------------------------------------------------


class LockView(BaseModel):
    """One advisory lock in this database, mapped back to its job where it is one; or a lease
    run's live lease (`kind` "lease": no backend holds anything, the run's row does)."""

    kind: Literal["advisory", "lease", "fanout"] = "advisory"
    job: str | None
    # A keyed job's run: its key (canonical text). Not `key`, which is the lock's own key.
    job_key: str | None = None
    # The 64-bit key as a string (JSON numbers lose precision above 2**53 in JavaScript and
    # jq), and as pg_locks shows it: classid = high 32 bits, objid = low 32 bits.
    key: str
    classid: int
    objid: int
    pid: int | None  # None for a lease
    holder: str | None  # application_name: "cronlock:<instance>" for cronlock's own sessions
    instance: str | None
    state: str | None
    held_for: float | None  # seconds since the holding transaction (or the lease run) began
    granted: bool
    run_id: int | None
    token: int | None = None  # a lease's fencing token
    lease_expires_at: Timestamp | None = None


class Failure(BaseModel):
    """What a failed run raised: secrets hidden, the message and traceback bounded."""

    type: str
    message: str
    traceback: str


class ItemCounts(BaseModel):
    """A fan-out run's items: planned, succeeded, failed for good, being worked now."""

    total: int
    done: int
    failed: int
    running: int


class RunView(BaseModel):
    id: int
    job: str
    key: str | None  # a keyed job's key; None for a key-less job
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
    # From pg_locks: the job's lock is held by the backend that recorded this run; for a lease
    # run, its lease is live.
    running: bool
    # Attempts: 1 for a first attempt; a retry or a lease takeover is the next, and names the
    # attempt it continues.
    attempt: int
    retry_of: int | None
    cancel_requested_at: Timestamp | None
    # Lease runs (null otherwise): the holder while the lease is live (the instance), the
    # fencing token, the lease's end, the resume point the job committed, its progress, and
    # the steps this attempt committed.
    holder: str | None
    token: int | None
    lease_expires_at: Timestamp | None
    checkpoint: Any
    progress: Any
    steps: int | None
    # A failed run's exception (GET /cron/runs/{id} only; null in lists and for other runs).
    failure: Failure | None = None
    # Fan-out runs (null otherwise): their items, settled or in flight now.
    items: ItemCounts | None = None


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

    kind: Literal["advisory", "lease", "fanout"] = "advisory"
    instance: str | None
    pid: int | None  # None for a lease
    state: str | None
    held_for: float | None
    run_id: int | None
    key: str | None = Field(default=None, validation_alias="job_key")  # a keyed run's key
    lease_expires_at: Timestamp | None = None


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
    # A lease job's lease in seconds (it runs in fenced steps, docs/long-jobs.md), else None.
    lease: float | None
    # The params field a keyed job locks on, else None. A keyed job's runs lock per key (see
    # `running_keys`); `lock_key` is then the key-less text's, which no run takes.
    key_field: str | None
    lock_key: str  # a 64-bit integer, as a string (see LockView.key)
    current_slot: Timestamp | None
    next_slot: Timestamp | None
    due_slot: Timestamp | None
    last_success_slot: Timestamp | None
    # When this database first saw the job (an instance declaring it started): its history
    # starts there, so no slot before it is missed or overdue. None: never seen yet.
    first_seen: Timestamp | None
    last_run: LastRun | None
    running: bool
    running_on: Holder | None  # the oldest holder, for a keyed job one of `running_keys`
    running_keys: list[Holder]  # every run in progress, with its key: which keys run where
    overdue: bool  # never while paused: a paused job says so in `paused` instead
    paused: pause.Paused | None = (
        None  # who paused it, when, why and until when (cronlock/core/pause.py)
    )
    # Its oldest failed slot that cronlock will retry (cronlock/core/retries.py): "failing, retry 2
    # of 3 at T"; None when nothing is waiting for a retry.
    retry: retries.RetryView | None = None
    # A dynamic job's schedules (cronlock/core/schedules.py): how many, paused, due now, late
    # (due for longer than its grace); None for any other job.
    schedules: dict[str, int] | None = None


class JobsView(BaseModel):
    now: Timestamp  # the database's clock, which every slot above is relative to
    jobs: list[JobView]


class LocksView(BaseModel):
    locks: list[LockView]


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
    running = await ledger.running_by_pid(conn, registry.schema, granted)
    found = []
    for r in rows:
        key = LockKey.from_pg_locks(r["classid"], r["objid"]).key
        run = running.get(r["pid"]) if r["granted"] else None
        job, job_key = names.get(key), None
        # The backend's keyed run, if this lock is that run's (the backend may hold other
        # locks too: a job takes its own).
        if (
            job is None
            and run is not None
            and run.key is not None
            and run.job in registry
            and registry.lock(run.job, run.key).key == key
        ):
            job, job_key = run.job, run.key
        found.append(
            LockView(
                job=job,
                job_key=job_key,
                key=str(key),
                classid=r["classid"],
                objid=r["objid"],
                pid=r["pid"],
                holder=r["application_name"] or None,
                instance=_instance(r["application_name"]),
                state=r["state"],
                held_for=round(r["held_for"], 3) if r["held_for"] is not None else None,
                granted=r["granted"],
                run_id=run.id if run is not None else None,
            )
        )
    for r in await lease.live(conn, registry.schema):
        lk = registry.lock(r["job"], r["key"])
        found.append(
            LockView(
                kind="lease",
                job=r["job"],
                job_key=r["key"],
                key=str(lk.key),
                classid=lk.classid,
                objid=lk.objid,
                pid=None,
                holder=f"cronlock:{r['instance']}",
                instance=r["instance"],
                state=None,
                held_for=round(r["held_for"], 3),
                granted=True,
                run_id=r["id"],
                token=r["lease_token"],
                lease_expires_at=r["lease_expires_at"],
            )
        )
    return found


def _holders(held: list[LockView], registry: Registry) -> dict[tuple[str, str | None], LockView]:
    """The job locks held now, by (job, key); oldest holder first, as `locks` orders them."""
    return {
        (lk.job, lk.job_key): lk
        for lk in held
        if lk.granted and lk.job is not None and lk.job in registry
    }


async def sweep(conn: Conn, settings: Settings, job: str | None = None) -> list[int]:
    """Close `running` rows whose lock is gone (cheap: the partial index on running rows).

    Best effort: on a standby or a read-only connection the rows simply stay for later.
    """
    try:
        return await ledger.close_abandoned(conn, settings.db_schema, settings.lock_namespace, job)
    except DRIVER_ERRORS as exc:
        log.debug("could not close abandoned runs: %s", describe(exc))
        return []


async def jobs(
    conn: Conn,
    registry: Registry,
    *,
    now: datetime | None = None,
    only: str | None = None,
    held: list[LockView] | None = None,
) -> JobsView:
    """Every job's state (or `only` that registered job's); `now` defaults to the database's
    clock (tests pass another); `held` is `locks()` if the caller has read it already."""
    if now is None:
        now = await conn.fetchval(NOW_SQL)
        assert now is not None
    names = [only] if only is not None else list(registry)
    holders = _holders(held if held is not None else await locks(conn, registry), registry)
    last = await ledger.last_runs(conn, registry.schema, names)
    succeeded = await ledger.last_succeeded_slots(conn, registry.schema, names)
    seen = await ledger.first_seen(conn, registry.schema, names)
    paused = await pause.active(conn, registry.schema, only)
    retrying = await retries.pending(conn, registry, now, RETRY_VIEW_WINDOW, only)
    dynamic = [registry[n] for n in names if registry[n].dynamic]
    counts = await schedules.stats(conn, registry.schema, dynamic) if dynamic else {}
    views = []
    for job in (registry[name] for name in names):
        current = nxt = None
        if job.schedule is not None:
            with contextlib.suppress(ScheduleError):
                current = job.schedule.prev_tick(now)
                nxt = job.schedule.next_tick(now)
        run = last.get(job.name)
        running = [Holder.model_validate(h) for (j, _), h in holders.items() if j == job.name]
        views.append(
            JobView(
                name=job.name,
                description=job.description,
                schedule=job.schedule.expr if job.schedule else "dynamic" if job.dynamic else None,
                tz=job.tz,
                timeout=job.timeout,
                grace=job.grace,
                early_tolerance=job.early_tolerance,
                max_lateness=job.max_lateness,
                catch_up=job.catch_up,
                lease=job.lease,
                key_field=job.key,
                lock_key=str(registry.key(job.name)),
                current_slot=current,
                next_slot=nxt,
                due_slot=due_slot(job, now),
                last_success_slot=succeeded.get(job.name),
                first_seen=seen.get(job.name),
                last_run=LastRun.model_validate(run) if run is not None else None,
                running=bool(running),
                running_on=running[0] if running else None,
                running_keys=running,
                overdue=job.name not in paused
                and (
                    counts[job.name]["late"] > 0
                    if job.dynamic
                    else is_overdue(job, now, succeeded.get(job.name), seen.get(job.name))
                ),
                paused=paused.get(job.name),
                retry=retries.view(retrying[job.name][0], job) if job.name in retrying else None,
                schedules=counts.get(job.name),
            )
        )
    return JobsView(now=now, jobs=views)


def _run_view(run: ledger.Run, held: dict[tuple[str, str | None], LockView]) -> RunView:
    holder = held.get((run.job, run.key))
    running = run.status == "running" and holder is not None and holder.run_id == run.id
    leased = run.lease_token is not None
    return RunView(
        id=run.id,
        job=run.job,
        key=run.key,
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
        running=running,
        attempt=run.attempt,
        retry_of=run.retry_of,
        cancel_requested_at=run.cancel_requested_at,
        holder=run.instance if leased and running else None,
        token=run.lease_token,
        lease_expires_at=run.lease_expires_at,
        checkpoint=run.checkpoint,
        progress=run.progress,
        steps=run.steps if leased else None,
    )


async def runs(
    conn: Conn,
    registry: Registry,
    *,
    job: str | None = None,
    status: str | None = None,
    before: int | None = None,
    limit: int = 50,
    key: str | None = None,
    held: list[LockView] | None = None,
    statuses: Sequence[str] | None = None,
) -> RunsPage:
    """Newest first; one row more than asked tells whether there is a next page. `held` is
    `locks()` if the caller has read it already; `statuses`: runs in any of these."""
    found = await ledger.list_runs(
        conn,
        registry.schema,
        job=job,
        status=status,
        before=before,
        limit=limit + 1,
        key=key,
        statuses=statuses,
    )
    page, more = found[:limit], len(found) > limit
    holders = _holders(held if held is not None else await locks(conn, registry), registry)
    return RunsPage(
        runs=[_run_view(r, holders) for r in page], next=page[-1].id if more and page else None
    )


# Items in flight count while their instance published them this recently (it does at
# least every second: cronlock/core/fanout_runner.py).
ITEMS_FRESH = 5.0


async def run(conn: Conn, registry: Registry, run_id: int) -> RunView | None:
    found = await ledger.get(conn, registry.schema, run_id)
    if found is None:
        return None
    held = _holders(await locks(conn, registry), registry) if found.status == "running" else {}
    view = _run_view(found, held)
    failure = await ledger.failure_of(conn, registry.schema, run_id)
    if failure is not None:
        view.failure = Failure.model_validate(failure)
    job = registry.get(found.job)
    if job is not None and job.fanout is not None:
        counts = await fanout.items_of(conn, registry.schema, run_id, ITEMS_FRESH)
        if counts is not None:
            view.items = ItemCounts(**vars(counts))
            # Planned: its items are the run's state, no lock is (cronlock/core/fanout.py).
            view.running = found.status == "running"
    return view


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


@dataclass(frozen=True)
class Cancelled:
    """What `cancel` did: the lock's holder as first seen, how it was reached (`holder`: the
    holder cancelled its job on request; `cancel` / `terminate`: the database-side fallback),
    whether the lock was released within the wait, and the run as recorded afterwards."""

    holder: LockView
    signalled: bool
    released: bool
    run: RunView | None
    how: Literal["holder", "cancel", "terminate", "none"] = "none"


async def cancel(
    conn: Conn,
    registry: Registry,
    settings: Settings,
    job: str,
    *,
    terminate: bool,
    wait: float,
    key: str | None = None,
    by: str = "cli",
) -> Cancelled | None:
    """Stop the run holding `job`'s lock and wait up to `wait` seconds for the lock to go;
    None when the job is not running. For a keyed job, `key` picks the run (without it, the
    oldest of its runs). Each step is bounded by DB_QUERY_TIMEOUT, not the whole wait (`conn`
    is not bounded).

    The request goes to the holder through its ledger row (cronlock/core/cancel.py); a holder that
    has not let go after CANCEL_GRACE seconds gets pg_cancel_backend (a statement in progress) or
    pg_terminate_backend (idle in its transaction), sent only while the pid still holds the
    lock. `terminate` goes straight to pg_terminate_backend."""

    async def holder() -> LockView | None:
        with deadline(conn, settings.db_query_timeout):
            async with reading(conn):
                found = await locks(conn, registry)
        return next(
            (
                lk
                for lk in found
                if lk.job == job and lk.granted and (key is None or lk.job_key == key)
            ),
            None,
        )

    lock = registry.lock(job, key)

    async def send(pid: int, *, terminate: bool) -> bool:
        with deadline(conn, settings.db_query_timeout):
            return await requests.signal_holder(conn, pid, lock, terminate=terminate)

    first = await holder()
    if first is None:
        first = await _expired_lease(conn, registry, settings, job, key)
    if first is None:
        first = await _fanout_run(conn, registry, settings, job, key)
    if first is None:
        return None
    if first.kind == "lease":
        return await _cancel_lease(conn, registry, settings, first, wait, by)
    if first.kind == "fanout":
        return await _cancel_fanout(conn, registry, settings, first, wait, by)
    assert first.pid is not None
    if first.job_key is not None:
        lock = registry.lock(job, first.job_key)
    started = time.monotonic()
    give_up_at = started + wait
    fallback_at = started + min(settings.cancel_grace, wait)
    signalled = released = False
    how: Literal["holder", "cancel", "terminate", "none"] = "none"
    if not terminate and first.run_id is not None:
        with deadline(conn, settings.db_query_timeout):
            signalled = await requests.request(conn, settings.db_schema, first.run_id, by)
        how = "holder" if signalled else how
    else:  # --terminate, or no run row to write the request on: the database-side way
        fallback_at = started
    current = first
    while True:
        if time.monotonic() >= fallback_at and how in ("holder", "none"):
            # The holder did not react in time (frozen, its loop blocked), or cannot be asked.
            hard = terminate or current.state != "active"
            if await send(first.pid, terminate=hard):
                signalled, how = True, "terminate" if hard else "cancel"
        await asyncio.sleep(0.1)
        now_held = await holder()
        # Released, or already held by a newer run (a pooled backend may be reused at once).
        # The same backend with no running row is not released: the holder recorded its run
        # as cancelled and closed its connection, and the server has not noticed yet (a
        # statement in progress notices within DB_CLIENT_CHECK_INTERVAL).
        if (
            now_held is None
            or now_held.pid != first.pid
            or now_held.run_id not in (None, first.run_id)
        ):
            released = True
            break
        current = now_held
        if time.monotonic() > give_up_at:
            break
    found = None
    if first.run_id is not None and released:
        # The runner records the outcome in its own transaction just after the rollback; a
        # terminated holder may not until its job wakes up, so its row is swept (as
        # `abandoned`, corrected by the runner later) once its lock is seen gone.
        settle = time.monotonic() + 5.0
        while True:
            with deadline(conn, settings.db_query_timeout):
                async with reading(conn):
                    found = await run(conn, registry, first.run_id)
            if found is None or found.status != "running" or time.monotonic() > settle:
                break
            with deadline(conn, settings.db_query_timeout):
                await sweep(conn, settings, job)
            await asyncio.sleep(0.1)
    return Cancelled(first, signalled, released, found, how)


async def _expired_lease(
    conn: Conn, registry: Registry, settings: Settings, job: str, key: str | None
) -> LockView | None:
    """A lease run whose lease ran out (its holder died, nobody took it over yet): not in the
    lock views, but still `running`, and cancelling it is what an operator means."""
    if job not in registry or registry[job].lease is None:
        return None
    with deadline(conn, settings.db_query_timeout):
        async with reading(conn):
            found = await lease.current(conn, registry.schema, job, key)
    if found is None:
        return None
    return _held_without_a_lock(
        registry, job, key, "lease", "expired", found.id, lease_expires_at=found.expires_at
    )


def _held_without_a_lock(
    registry: Registry,
    job: str,
    key: str | None,
    kind: Literal["lease", "fanout"],
    state: str,
    run_id: int,
    lease_expires_at: datetime | None = None,
) -> LockView:
    """The lock view of a run that holds its job by a row, not an advisory lock (a lease
    that ran out, a fan-out's items): the job's key, no backend, no holder."""
    lk = registry.lock(job, key)
    return LockView(
        kind=kind,
        job=job,
        job_key=key,
        key=str(lk.key),
        classid=lk.classid,
        objid=lk.objid,
        pid=None,
        holder=None,
        instance=None,
        state=state,
        held_for=None,
        granted=True,
        run_id=run_id,
        lease_expires_at=lease_expires_at,
    )


async def _fanout_run(
    conn: Conn, registry: Registry, settings: Settings, job: str, key: str | None
) -> LockView | None:
    """A fan-out run in progress: its items hold the job, no lock does."""
    if job not in registry or registry[job].fanout is None:
        return None
    with deadline(conn, settings.db_query_timeout):
        async with reading(conn):
            run_id = await fanout.running(conn, registry.schema, job, key)
    if run_id is None:
        return None
    return _held_without_a_lock(registry, job, key, "fanout", "running", run_id)


async def _cancel_fanout(
    conn: Conn, registry: Registry, settings: Settings, first: LockView, wait: float, by: str
) -> Cancelled:
    """A fan-out run is stopped by the workers of whichever instances serve it: they see the
    request within FANOUT_POLL_INTERVAL, stop claiming its items and record it `cancelled`;
    items in flight finish or roll back (cronlock/core/fanout.py)."""
    assert first.run_id is not None
    with deadline(conn, settings.db_query_timeout):
        signalled = await requests.request(conn, settings.db_schema, first.run_id, by)
    give_up_at = time.monotonic() + wait
    while True:
        with deadline(conn, settings.db_query_timeout):
            async with reading(conn):
                view = await run(conn, registry, first.run_id)
        released = view is None or view.status != "running"
        if released or time.monotonic() > give_up_at:
            break
        await asyncio.sleep(0.1)
    return Cancelled(first, signalled, released, view, "holder" if signalled else "none")


async def _cancel_lease(
    conn: Conn, registry: Registry, settings: Settings, first: LockView, wait: float, by: str
) -> Cancelled:
    """A lease run is stopped by its holder, which sees the request at its next step or lease
    renewal (within a third of the lease), records it `cancelled` and ends its job; a run with
    no live holder is cancelled by the request itself, and a takeover closes a run with a
    pending request as cancelled rather than resuming it. The request goes to the (job, key)'s
    lease run, whichever attempt it is at now, and again if a takeover made a new one
    meanwhile. `--terminate` has nothing to add: no backend holds a lease run between steps."""
    assert first.job is not None
    give_up_at = time.monotonic() + wait
    signalled = released = False
    last = first.run_id
    while True:
        with deadline(conn, settings.db_query_timeout):
            async with reading(conn):
                done, run_id = await lease.request_cancel(
                    conn, registry.schema, first.job, first.job_key, by
                )
        if run_id is not None:
            signalled, last = True, run_id
        if done == "finished":
            released = True
            break
        if time.monotonic() > give_up_at:
            break
        await asyncio.sleep(0.1)
    view = None
    if last is not None:
        with deadline(conn, settings.db_query_timeout):
            async with reading(conn):
                view = await run(conn, registry, last)
    return Cancelled(first, signalled, released, view, "holder" if signalled else "none")


async def signal_holder(conn: Conn, pid: int, *, terminate: bool) -> bool:
    """pg_cancel_backend (the running statement fails, the transaction rolls back) or
    pg_terminate_backend (the session ends). Sent through the database, so it reaches the
    real backend even behind PgBouncer."""
    return bool(await conn.fetchval(TERMINATE_SQL if terminate else CANCEL_SQL, pid))


async def outbox_stats(conn: Conn, schema: str) -> dict[str, float] | None:
    """The outbox's queue figures, or None where there is no outbox table (not migrated)."""
    try:
        async with conn.transaction():  # a savepoint: a missing table must not end ours
            return await outbox.outbox_stats(conn, schema)
    except asyncpg.UndefinedTableError:
        return None
