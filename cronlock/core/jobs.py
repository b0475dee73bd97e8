"""Jobs: the `@job` decorator, the context a job runs with, and the registry.

A job is an async function of a `JobContext`. It may only touch the database through
`ctx.conn`, the connection whose transaction holds the job's advisory lock: a query sent
through the pool would run outside that transaction and the lock would protect nothing.

An SQL error inside the job aborts the whole transaction and so frees the lock at once; a job
that must survive a failing statement wraps it in a savepoint (`async with ctx.conn.transaction():`
inside the job opens one).

A keyed job (`key=` names a field of its params) locks per key value: runs for different keys
go at once, on one instance or several; a second run for the same key is "already running".
The key's canonical text (`key_text`) is what is locked, stored in the ledger and shown.

A lease job (`lease=` seconds) runs outside one transaction: it has no `ctx.conn`, and writes
only in steps (`async with ctx.step() as conn:`), each a short transaction fenced by the run's
lease (cronlock/core/lease.py), committed with `ctx.checkpoint`, from which a later attempt resumes.

`ctx.session` (the `sqlalchemy` extra) is a SQLAlchemy AsyncSession on the same connection and
in the same transaction as `ctx.conn` (a lease job's: the open step's); its `commit()` releases
a savepoint, never the lock's transaction (cronlock/db/orm.py, docs/orm.md).

Long on purpose: a job's declaration rules (`define`), the context it runs with and the
registry that checks the set are one concept whose rules refer to each other; apart, a rule
about keys or leases would be checked in one module and relied on in another.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import re
from collections.abc import Callable, Coroutine, Iterator, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from datetime import datetime
from typing import (
    TYPE_CHECKING,
    Any,
    Literal,
    Protocol,
    TypedDict,
    TypeVar,
    Unpack,
    cast,
    overload,
)

from pydantic import BaseModel

from cronlock.core.schedule import Interval, Schedule, ScheduleError, Slots
from cronlock.db.lock import LockKey, lock_key, lock_text
from cronlock.db.orm import Sessions, SessionScope
from cronlock.db.pool import Conn
from cronlock.errors import JobDefinitionError, LeaseLost, RunCancelled
from cronlock.settings import Settings

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession

__all__ = [
    "Job",
    "JobContext",
    "LeaseLost",
    "Registry",
    "RunCancelled",
    "call",
    "job",
    "key_text",
    "load",
]

RESERVED_NAMES = frozenset({"jobs", "runs", "locks"})
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")

Trigger = Literal["scheduled", "manual", "backfill"]
# What happens to slots nobody triggered (every instance down, a scheduler that did not fire):
# `latest` runs the most recent one once (what `catch_up=True` always did), `all` each of them
# in order within the backfill window, `none` leaves them (overdue, for a person to look at).
Missed = Literal["latest", "all", "none"]
MISSED_POLICIES: tuple[Missed, ...] = ("latest", "all", "none")

# The types a key field may have: those with one stable text form (str as is, int in decimal).
# A float ("1.0" or "1"?), a datetime (which offset?) or a model would lock different texts
# for what a client thinks is one value. bool is refused although it is an int: "True" is not
# what anyone means by a customer id.
KEY_TYPES: tuple[type, ...] = (str, int)
# The key's text goes into the lock's hash, a ledger column and a unique index, whose rows
# PostgreSQL caps at about 2.7 kB: a longer key would fail its commit, not its trigger.
MAX_KEY_LENGTH = 200
# `schedule="dynamic"` (cronlock/core/schedules.py) and the most its `spread=` may be: a day.
DYNAMIC = "dynamic"
MAX_SPREAD = 86400.0


class Steps(Protocol):
    """Where a lease job's steps come from (cronlock/core/lease.py `Fence`)."""

    def step(self, ctx: JobContext) -> AbstractAsyncContextManager[Conn]: ...


class _StepsOnly:
    """`ctx.conn` of a lease job: it has no transaction of its own to write in."""

    def __init__(self, job: str) -> None:
        self._job = job

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(
            f"job {self._job!r} is a lease job: it has no ctx.conn; write through "
            "`async with ctx.step() as conn:`"
        )


def steps_only(job: str) -> Conn:
    return cast(Conn, _StepsOnly(job))


@dataclass
class JobContext:
    """What a running job gets. `conn` is the only connection it may use (a lease job has
    none: it writes in `ctx.step()`s)."""

    conn: Conn
    job: Job
    run_id: int
    slot: datetime | None
    now: datetime  # the database's now(): the start of the lock transaction
    params: Any  # an instance of the job's params model, or None
    trigger: Trigger
    instance: str
    # The service's settings: a job reads its configuration here, not from the environment.
    settings: Settings
    # A keyed job's key, as locked and stored (its canonical text, e.g. "42"); None otherwise.
    key: str | None = None
    # Lease jobs: the attempt (1 at first; a takeover or a new attempt at the slot adds one),
    # the resume point the job sets and each step commits (JSON; None before the first), and
    # what the job says of its progress (JSON, shown in /cron/runs/{id}).
    attempt: int = 1
    checkpoint: Any = None
    progress: Any = None
    steps: Steps | None = None
    # What makes `ctx.session` (the runner's `session_class`); None: SQLAlchemy's AsyncSession.
    sessions: Sessions | None = None
    # The session of the run (one-transaction jobs) or of the open step (lease jobs).
    _scope: SessionScope | None = field(default=None, init=False, repr=False)

    @property
    def session(self) -> AsyncSession:
        """A SQLAlchemy AsyncSession on `conn`, inside the lock's transaction (made at first
        use; the `sqlalchemy` extra). Its writes commit with the run, once, or roll back with
        it; `session.commit()` releases a savepoint, `session.rollback()` rolls back to it. A
        lease job has one per step, inside `async with ctx.step():`. See docs/orm.md."""
        if self._scope is None:
            if self.steps is not None:
                raise RuntimeError(
                    f"job {self.job.name!r} is a lease job: its ctx.session exists inside a "
                    "step (`async with ctx.step():`), in the step's transaction"
                )
            self._scope = (self.sessions or Sessions()).scope(self.conn)
        return self._scope.session

    def enter_session_scope(self, conn: Conn) -> None:
        """Make `session` the one of a transaction on `conn` (a lease step; a fan-out item)."""
        self._scope = (self.sessions or Sessions()).scope(conn)

    async def leave_session_scope(self, *, commit: bool) -> None:
        """Settle the session of the current scope, if one was made (see `SessionScope`)."""
        scope, self._scope = self._scope, None
        if scope is not None:
            await scope.finish(commit=commit)

    @property
    def schema(self) -> str:
        """cronlock's schema (DB_SCHEMA), for a job that writes cronlock's tables itself."""
        return self.settings.db_schema

    def step(self) -> AbstractAsyncContextManager[Conn]:
        """A lease job's fenced transaction: `async with ctx.step() as conn:` (see the module
        docstring). Raises LeaseLost when the run is no longer this holder's."""
        if self.steps is None:
            raise RuntimeError(
                f"job {self.job.name!r} is not a lease job: it writes through ctx.conn, in the "
                "one transaction of its run"
            )
        return self.steps.step(self)


JobFunc = Callable[[JobContext], Coroutine[Any, Any, Any]]


async def call(func: JobFunc, ctx: JobContext) -> Any:
    """A one-transaction job's function, then its session settled in the same task (so within
    the job's timeout, and a failing flush is the job's failure): committed into the run's
    transaction when the job returned, rolled back when it raised."""
    returned = False
    try:
        result = await func(ctx)
        returned = True
    finally:
        await ctx.leave_session_scope(commit=returned)
    return result


# --- fan-out declarations (cronlock/core/fanout.py runs them) --------------------------------

# Their context is an ItemContext / a DoneContext (cronlock/core/fanout.py), which build on
# this module's JobContext: named here as Any, so that this module need not import that one.
ItemFunc = Callable[[Any], Coroutine[Any, Any, Any]]
DoneFunc = Callable[[Any], Coroutine[Any, Any, Any]]
# A planner: an async generator of items, or an async def returning an iterable of them.
PlanFunc = Callable[[JobContext], Any]

ItemF = TypeVar("ItemF", bound=ItemFunc)
DoneF = TypeVar("DoneF", bound=DoneFunc)
# An item's retries, as a job's.
MAX_ITEM_RETRIES = 100


@dataclass
class Fanout:
    """What a fan-out job does besides planning: its item function (`@plan.each`), the item's
    timeout and retries, and `@plan.done`. Filled in after the job's own declaration, checked
    when the jobs are collected (`check_fanouts`)."""

    job: str
    each: ItemFunc | None = None
    timeout: float = 60.0
    retries: int = 0
    done: DoneFunc | None = None


class Plan:
    """What `@job(..., fanout=True)` returns: the planner, with `.each` and `.done` to declare
    the rest of the job. Calling it calls the planner."""

    def __init__(self, func: PlanFunc, spec: Fanout) -> None:
        self.func = func
        self.spec = spec
        self.__doc__ = func.__doc__
        self.__name__ = getattr(func, "__name__", spec.job)
        self.__qualname__ = getattr(func, "__qualname__", spec.job)
        self.__module__ = func.__module__

    def __call__(self, ctx: JobContext) -> Any:
        return self.func(ctx)

    def each(self, *, timeout: float = 60.0, retries: int = 0) -> Callable[[ItemF], ItemF]:
        """Declare the function that works one item, in one transaction of its own (`ctx.conn`,
        `ctx.session`), bounded by `timeout` seconds; a failed item is tried `retries` more
        times, with a backoff (FANOUT_RETRY_DELAY, doubling)."""
        name = self.spec.job
        if not timeout > 0:
            raise JobDefinitionError(f"job {name!r}: each(timeout=) must be positive")
        if isinstance(retries, bool) or not isinstance(retries, int):
            raise JobDefinitionError(f"job {name!r}: each(retries=) must be a whole number")
        if not 0 <= retries <= MAX_ITEM_RETRIES:
            raise JobDefinitionError(
                f"job {name!r}: each(retries=) must be from 0 to {MAX_ITEM_RETRIES}"
            )

        def register(func: ItemF) -> ItemF:
            _check_async(name, func, "each")
            if self.spec.each is not None and self.spec.each is not func:
                raise JobDefinitionError(f"job {name!r} has two item functions (@{name}.each)")
            self.spec.each, self.spec.timeout, self.spec.retries = func, timeout, retries
            return func

        return register

    def done(self, func: DoneF) -> DoneF:
        """Declare what runs once every item is settled, in the transaction that settles the
        last one (`ctx.conn`, `ctx.session`; `ctx.total`, `ctx.done`, `ctx.failed`)."""
        name = self.spec.job
        _check_async(name, func, "done")
        if self.spec.done is not None and self.spec.done is not func:
            raise JobDefinitionError(f"job {name!r} has two done functions")
        self.spec.done = func
        return func


def _check_async(job: str, func: Any, what: str) -> None:
    if not inspect.iscoroutinefunction(func):
        raise JobDefinitionError(
            f"job {job!r}: {getattr(func, '__qualname__', func)!r} (@{what}) must be an async def"
        )


class _NotFanout:
    """`.each`/`.done` of a job that is not a fan-out job: a clear error at declaration."""

    def __init__(self, job: str) -> None:
        self.job = job

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise JobDefinitionError(
            f"job {self.job!r} is not a fan-out job: declare it with fanout=True to give it "
            "an item function (@each) or a done function"
        )


def declared_as(job: Job, func: Any) -> Any:
    """What a job's decorator gives back: a `Plan` for a fan-out job, else the function itself
    (with `.each` and `.done` that refuse, clearly, when they are tried on it)."""
    if job.fanout is not None:
        return Plan(func, job.fanout)
    for attribute in ("each", "done"):
        if not hasattr(func, attribute):
            with contextlib.suppress(AttributeError, TypeError):
                setattr(func, attribute, _NotFanout(job.name))
    return func


def check_fanouts(jobs: Mapping[str, Job]) -> None:
    """Refuse, at start-up, a fan-out job without an item function."""
    for job in jobs.values():
        if job.fanout is not None and job.fanout.each is None:
            raise JobDefinitionError(
                f"job {job.name!r} is a fan-out job without an item function: declare one "
                f"with @{job.func.__name__}.each(timeout=..., retries=...)"
            )


@dataclass(frozen=True)
class Job:
    name: str
    func: JobFunc
    schedule: Slots | None = None  # a cron expression in a zone, or an interval (`every=`)
    timeout: float = 60.0
    # A trigger up to this many seconds before a tick counts for that tick (clock skew);
    # capped at half the schedule's interval.
    early_tolerance: float = 5.0
    max_lateness: float | None = None
    # How long after a tick a missing succeeded run makes the job `overdue`.
    grace: float = 300.0
    # True when `missed` is `latest` or `all`: the catch-up loop looks after this job.
    catch_up: bool = False
    params: type[BaseModel] | None = None
    description: str = ""
    module: str = ""
    # The params field whose value is the run's key (keyed jobs), else None.
    key: str | None = None
    # None: "latest" with catch_up, else "none" (a Job built without the decorator).
    missed: Missed | None = None
    # Retries cronlock owns (cronlock/core/retries.py): how many more attempts a failed, timed-out
    # or abandoned scheduled or backfill run gets for its slot, the first after `retry_delay`
    # seconds, doubling after each.
    retries: int = 0
    retry_delay: float = 30.0
    # Alerts (cronlock/delivery/alerts.py): this job's Healthchecks.io-style ping URL and webhook
    # URL; None falls back to ALERT_PING_URL / ALERT_WEBHOOK_URL.
    ping_url: str | None = None
    webhook_url: str | None = None

    @property
    def missed_policy(self) -> Missed:
        if self.missed is not None:
            return self.missed
        return "latest" if self.catch_up else "none"

    # Lease mode: the lease's length in seconds (cronlock/core/lease.py); None runs in one
    # transaction.
    lease: float | None = None
    # `schedule="dynamic"`: a keyed job whose schedules are rows, one per key
    # (cronlock/core/schedules.py), dispatched by the built-in scheduler; `schedule` is None.
    dynamic: bool = False
    # Dynamic jobs: each key's start is spread over this many seconds after its tick,
    # deterministically by key (the slot stays the tick).
    spread: float = 0.0
    # Fan-out mode (`fanout=True`, cronlock/core/fanout.py): `func` plans the run's items, the
    # spec names what works each one and what runs when all are settled.
    fanout: Fanout | None = None

    @property
    def tz(self) -> str | None:
        return self.schedule.tz if self.schedule else None

    def key_of(self, params: Any) -> str | None:
        """The run's key for validated `params`: the key field's canonical text."""
        if self.key is None:
            return None
        return key_text(getattr(params, self.key))


def key_text(value: Any) -> str:
    """A key value's canonical text: str as is, int in decimal (see KEY_TYPES)."""
    if isinstance(value, bool) or not isinstance(value, KEY_TYPES):
        # Unreachable for a field `_check_key` accepted, unless a validator of the job's
        # model returns another type: the job's bug, found before anything is locked.
        raise TypeError(f"a key must be a str or an int, not {type(value).__name__}")
    return value if isinstance(value, str) else str(value)


def _check_key(name: str, key: str, params: type[BaseModel] | None) -> None:
    """Refuse a key that cannot be one, at declaration: not a field of the params, optional
    (a trigger without it would have no key to lock), or of a type without a stable text."""
    if params is None:
        raise JobDefinitionError(f"job {name!r}: key={key!r} needs params= (the key is a field)")
    field_info = params.model_fields.get(key)
    if field_info is None:
        raise JobDefinitionError(f"job {name!r}: key={key!r} is not a field of {params.__name__}")
    if not field_info.is_required():
        raise JobDefinitionError(
            f"job {name!r}: key field {key!r} has a default: a trigger must carry its key"
        )
    annotation = field_info.annotation
    if annotation is bool or annotation not in KEY_TYPES:
        raise JobDefinitionError(
            f"job {name!r}: key field {key!r} is {annotation!r}: a key must be str or int "
            "(types with one stable text form)"
        )


_DECLARED: dict[str, Job] = {}


class JobOptions(TypedDict, total=False):
    """What `@job(name, ...)` and `@cron.job(name, ...)` accept besides the name (see `define`
    for each one's meaning and default)."""

    schedule: str | None
    tz: str
    every: float | None
    timeout: float
    early_tolerance: float
    max_lateness: float | None
    grace: float
    catch_up: bool
    params: type[BaseModel] | None
    key: str | None
    missed: Missed | None
    retries: int
    retry_delay: float
    ping_url: str | None
    webhook_url: str | None
    lease: float | None
    spread: float


@overload
def job(
    name: str, *, fanout: Literal[True], **options: Unpack[JobOptions]
) -> Callable[[PlanFunc], Plan]: ...
@overload
def job(
    name: str, *, fanout: Literal[False] = False, **options: Unpack[JobOptions]
) -> Callable[[JobFunc], JobFunc]: ...
def job(name: str, *, fanout: bool = False, **options: Unpack[JobOptions]) -> Any:
    """Declare a job in a module that is loaded by name (CRON_JOBS, `Cronlock(jobs=[...])`):
    the job is served by whoever loads its module. See `Cronlock.job` for the same in an app.
    `fanout=True` returns a `Plan`, whose `.each` and `.done` declare the rest."""
    make = define(name, fanout=fanout, **options)

    def register(func: Any) -> Any:
        declared = make(func)
        previous = _DECLARED.get(name)
        if previous is not None and previous.module != declared.module:
            raise JobDefinitionError(
                f"job {name!r} is declared twice ({previous.module} and {declared.module})"
            )
        _DECLARED[name] = declared
        return declared_as(declared, func)

    return register


def define(
    name: str,
    *,
    schedule: str | None = None,
    tz: str = "UTC",
    every: float | None = None,
    timeout: float = 60.0,
    early_tolerance: float = 5.0,
    max_lateness: float | None = None,
    grace: float = 300.0,
    catch_up: bool = False,
    params: type[BaseModel] | None = None,
    key: str | None = None,
    missed: Missed | None = None,
    retries: int = 0,
    retry_delay: float = 30.0,
    ping_url: str | None = None,
    webhook_url: str | None = None,
    lease: float | None = None,
    spread: float = 0.0,
    fanout: bool = False,
) -> Callable[[JobFunc], Job]:
    """Check a job's declaration now (a JobDefinitionError names what is wrong) and return
    what makes its `Job` from the function."""
    if not NAME_PATTERN.match(name):
        raise JobDefinitionError(
            f"job name {name!r}: use letters, digits, '.', '_' or '-' (at most 100)"
        )
    if name in RESERVED_NAMES:
        raise JobDefinitionError(f"job name {name!r} is reserved for the API")
    if timeout <= 0:
        raise JobDefinitionError(f"job {name!r}: timeout must be positive")
    if not early_tolerance >= 0 or (max_lateness is not None and not max_lateness > 0):
        # `not >=`: NaN compares false both ways, and would pass `< 0`.
        raise JobDefinitionError(f"job {name!r}: tolerances must be positive")
    dynamic = schedule == DYNAMIC
    if dynamic:
        _check_dynamic(name, key, every, tz, catch_up, missed, fanout)
        schedule = None
    if spread != 0.0 and not (dynamic and 0 <= spread <= MAX_SPREAD):
        raise JobDefinitionError(
            f"job {name!r}: spread= is for dynamic jobs (schedule='dynamic'), 0 to {MAX_SPREAD} s"
        )
    if every is not None and schedule is not None:
        raise JobDefinitionError(f"job {name!r}: give schedule= or every=, not both")
    if every is not None and tz != "UTC":
        raise JobDefinitionError(f"job {name!r}: every= counts seconds in UTC; drop tz={tz!r}")
    try:
        parsed: Slots | None = (
            Interval.parse(every)
            if every is not None
            else Schedule.parse(schedule, tz)
            if schedule is not None
            else None
        )
    except ScheduleError as exc:
        raise JobDefinitionError(f"job {name!r}: {exc}") from exc
    policy = _missed_policy(name, missed, catch_up, parsed is not None)
    catch_up = policy != "none"
    if catch_up and max_lateness is not None and max_lateness < grace:
        # A slot is missed once its grace has passed, and then already later than this.
        raise JobDefinitionError(
            f"job {name!r}: missed={policy!r} could never run a slot: a missed slot is at least "
            f"grace ({grace} s) late, more than max_lateness ({max_lateness} s) allows"
        )
    if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= 100:
        raise JobDefinitionError(f"job {name!r}: retries must be a whole number from 0 to 100")
    if not retry_delay > 0:
        raise JobDefinitionError(f"job {name!r}: retry_delay must be positive")
    if lease is not None and not 0 < lease <= timeout:
        raise JobDefinitionError(
            f"job {name!r}: lease must be positive and at most the timeout ({timeout} s), "
            "which bounds the whole run"
        )
    if fanout and lease is not None:
        raise JobDefinitionError(
            f"job {name!r}: a job is a lease job or a fan-out job, not both (lease= or fanout=)"
        )
    if key is not None:
        _check_key(name, key, params)
        if catch_up:
            # Catch-up runs a missed slot with no trigger, so with no key to run it for; one
            # per key would need the job's keys listed (fanning a tick out: later work).
            raise JobDefinitionError(f"job {name!r}: a keyed job cannot catch_up (no key)")

    def make(func: JobFunc) -> Job:
        planner = fanout and inspect.isasyncgenfunction(func)
        if not (inspect.iscoroutinefunction(func) or planner):
            # Found now, not at its first trigger: a plain function would fail every run.
            raise JobDefinitionError(f"job {name!r}: {func.__qualname__} must be an async def")
        return Job(
            name=name,
            func=func,
            schedule=parsed,
            timeout=timeout,
            early_tolerance=early_tolerance,
            max_lateness=max_lateness,
            grace=grace,
            catch_up=catch_up,
            params=params,
            description=(func.__doc__ or "").strip().split("\n")[0],
            module=func.__module__,
            key=key,
            missed=policy,
            retries=retries,
            retry_delay=retry_delay,
            ping_url=ping_url,
            webhook_url=webhook_url,
            lease=lease,
            dynamic=dynamic,
            spread=float(spread),
            fanout=Fanout(name) if fanout else None,
        )

    return make


def _check_dynamic(
    name: str,
    key: str | None,
    every: float | None,
    tz: str,
    catch_up: bool,
    missed: Missed | None,
    fanout: bool,
) -> None:
    """What `schedule="dynamic"` cannot be combined with: each key's row has its own schedule
    and zone, and its own slots (a missed one runs once, the latest: docs/dynamic-schedules.md).
    `retries=` and `lease=` combine: a key's failed slot is retried for that key and slot, and
    a lease run begins (and its row advances) in one transaction."""
    if key is None:
        raise JobDefinitionError(
            f"job {name!r}: schedule='dynamic' needs key= (the schedules are one per key)"
        )
    if every is not None or tz != "UTC":
        raise JobDefinitionError(
            f"job {name!r}: schedule='dynamic' takes each key's schedule and zone from its row; "
            "drop every= and tz="
        )
    if catch_up or missed not in (None, "none"):
        raise JobDefinitionError(
            f"job {name!r}: schedule='dynamic' runs each key's latest due slot once; drop "
            "catch_up= and missed="
        )
    if fanout:
        # The fan-out runner plans and records a run without the dispatcher's claimed row (the
        # "row still holds this slot" check, the advance in the recording transaction): a
        # dynamic fan-out would run a claimed slot again every claim timeout. Refused until it does.
        raise JobDefinitionError(
            f"job {name!r}: schedule='dynamic' does not take fanout= yet (a fan-out run does "
            "not advance its key's schedule)"
        )


def _missed_policy(name: str, missed: Missed | None, catch_up: bool, scheduled: bool) -> Missed:
    """`missed=` as given, or what `catch_up` always meant; both only when they agree."""
    if missed is not None and missed not in MISSED_POLICIES:
        raise JobDefinitionError(
            f"job {name!r}: missed={missed!r}: choose one of {', '.join(MISSED_POLICIES)}"
        )
    if catch_up and missed not in (None, "latest"):
        raise JobDefinitionError(
            f"job {name!r}: catch_up=True is missed='latest'; drop catch_up to use "
            f"missed={missed!r}"
        )
    policy: Missed = missed or ("latest" if catch_up else "none")
    # (catch_up=True without a schedule was always accepted, and ignored: still so.)
    if missed not in (None, "none") and not scheduled:
        raise JobDefinitionError(f"job {name!r}: missed={policy!r} needs a schedule or every=")
    return policy


@dataclass(frozen=True)
class Registry(Mapping[str, Job]):
    """The jobs one app serves, with their lock keys checked for collisions."""

    jobs: dict[str, Job] = field(default_factory=dict)
    namespace: int = 0
    schema: str = "cronlock"

    def __getitem__(self, name: str) -> Job:
        return self.jobs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.jobs)

    def __len__(self) -> int:
        return len(self.jobs)

    def key(self, name: str) -> int:
        return self.lock(name).key

    def lock(self, name: str, key: str | None = None) -> LockKey:
        """The advisory lock key of the job (of one of its keys, for a keyed job; see
        cronlock/db/lock.py)."""
        return lock_key(lock_text(self.schema, name, key), self.namespace)

    def check_leases(self, query_timeout: float, margin: float) -> None:
        """Refuse a lease too short for this deployment's timeouts: its holder renews every
        third of the lease and stops the job once DB_QUERY_TIMEOUT plus LEASE_MARGIN is all
        that may be left of it (cronlock/core/lease.py `stop_at`), so that must leave at least one
        renewal's time."""
        for job in self.jobs.values():
            if job.lease is not None and job.lease - query_timeout - margin <= job.lease / 3:
                raise JobDefinitionError(
                    f"job {job.name!r}: lease={job.lease} s is too short for "
                    f"DB_QUERY_TIMEOUT={query_timeout} s and LEASE_MARGIN={margin} s: use a "
                    f"lease above {1.5 * (query_timeout + margin):g} s, or shorter timeouts"
                )

    def by_key(self) -> dict[int, str]:
        return {self.key(name): name for name in self.jobs}

    def check_keys(self, keys: Mapping[str, int] | None = None) -> None:
        """Refuse two jobs whose lock keys collide: they could never run at the same time,
        and worse, `pg_locks` could not tell them apart."""
        seen: dict[int, str] = {}
        for name in self.jobs:
            key = keys[name] if keys is not None else self.key(name)
            if key in seen:
                raise JobDefinitionError(
                    f"jobs {seen[key]!r} and {name!r} have the same lock key {key} in "
                    f"namespace {self.namespace} of schema {self.schema}: rename one or change "
                    "LOCK_NAMESPACE"
                )
            seen[key] = name


# cronlock's own modules that moved when the library became the `cronlock` package (0.1
# shipped them as `app.*`): a CRON_JOBS entry or a job module's import naming the old one is
# told the new name, instead of an import error about a package it may not even have.
MOVED = {
    "app.demo.digest": "cronlock.demo.digest",
    "app.demo.chunked": "cronlock.demo.chunked",
    "app.housekeeping": "cronlock.housekeeping",
    "app.jobs": "cronlock",
    "app.errors": "cronlock.errors",
    "app.settings": "cronlock",
}


def moved_to(module: str) -> str | None:
    """The new name of a cronlock module 0.1 shipped as `module`, if it is one."""
    return MOVED.get(module)


def load(
    modules: list[str],
    namespace: int = 0,
    schema: str = "cronlock",
    declared: Mapping[str, Job] | None = None,
) -> Registry:
    """Import the job modules and collect the jobs they declare, with `declared` (the jobs of
    a `Cronlock`, declared with `@cron.job`)."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise JobDefinitionError(_import_problem(module, exc)) from exc
    chosen = {
        name: j
        for name, j in _DECLARED.items()
        if any(j.module == m or j.module.startswith(m + ".") for m in modules)
    }
    for name, j in (declared or {}).items():
        other = chosen.get(name)
        if other is not None and other.func is not j.func:
            raise JobDefinitionError(
                f"job {name!r} is declared twice ({other.module} and {j.module}): rename one"
            )
        chosen[name] = j
    registry = Registry(dict(sorted(chosen.items())), namespace, schema)
    registry.check_keys()
    check_fanouts(registry)
    return registry


def _import_problem(module: str, exc: ImportError) -> str:
    missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
    new = moved_to(module)
    if new is not None and missing is not None and (module + ".").startswith(missing + "."):
        return f"CRON_JOBS: {module!r} moved: name {new!r} instead"
    new = moved_to(missing) if missing is not None else None
    if new is not None:
        return (
            f"CRON_JOBS: {module!r} imports {missing!r}, which moved to {new!r}: change the "
            "import (`from cronlock import job, JobContext`)"
        )
    return f"CRON_JOBS: cannot import {module!r}: {exc}"
