"""Dynamic schedules: one row per key of a `schedule="dynamic"` job (`<DB_SCHEMA>.schedules`),
and the only module that speaks SQL about them.

**Setting** (`Schedules`, `cron.schedules`): each write is validated first, with the rules of
code schedules (a cron expression that fires, a known zone, `every=` whole seconds), the job's
params model (the key's field filled in from the key) and the key's limits; a refusal is an
`InvalidSchedule` naming the field, before any statement. The write runs in the caller's
transaction (an asyncpg connection, or a SQLAlchemy `AsyncConnection` / `AsyncSession`), so a
customer's sign-up and its schedule commit together or not at all. A write never waits for a run
of its key: no run holds the row's lock, except for the moment its recording transaction
advances `next_at`, and that update skips a row a writer holds (`ADVANCE_SQL`).

**Dispatching** (`Dispatcher`, cronlock/core/dispatch.py, in the built-in scheduler on every
instance): due rows are
claimed in `due_at` order with `FOR UPDATE SKIP LOCKED`, marked claimed for a short while
(`claimed_until`), and each runs through the runner's ordinary trigger path for its key and its
slot (`Planned`). Under the run's advisory lock the row must still hold what was claimed
(`version`, `next_at`): a schedule changed or removed since runs nothing of the old one. The
run's recording transaction (its commit, or the one recording its failure) advances `next_at`
past the slot, conditionally on the same `version`; a crash before that leaves the row due, and
the next claim finds the slot attempted in the ledger ("already attempted") and only advances.
Exactly once per (job, key, slot) is the runner's: one lock per key, the ledger's attempt check
under it, and its unique index of succeeded slots.

Long on purpose: the only module that speaks SQL about schedule rows (as the convention
is), and their validation must be the one the SQL's invariants assume.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo

import asyncpg
from pydantic import ValidationError

from cronlock.core.jobs import Job, Registry, key_text
from cronlock.core.schedule import Interval, Schedule, ScheduleError, Slots
from cronlock.db.lock import internal_lock
from cronlock.db.pool import Conn
from cronlock.errors import DATABASE_ERRORS, InvalidSchedule
from cronlock.inputs import json_problem, text_problem
from cronlock.sql import qualify

if TYPE_CHECKING:
    from cronlock.settings import Settings

log = logging.getLogger("cronlock.schedules")

# The most rows one `list` returns.
MAX_PAGE = 1000
# Outcomes after which the claimed slot is over without a run of it: the dispatcher advances
# the row (the runner's skips; "schedule changed" leaves the row to its new schedule).
ADVANCE_AFTER = ("already done", "already attempted", "too late", "paused", "params refused")


# --- values ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """A validated schedule, ready to write."""

    job: str
    key: str
    schedule: str | None
    every: int | None
    tz: str
    params: dict[str, Any]
    paused: bool
    slots: Slots


@dataclass(frozen=True)
class Row:
    """A schedule as stored; `last_run_*` only where a listing reads them."""

    job: str
    key: str
    schedule: str | None
    every: int | None
    tz: str
    params: Any
    paused: bool
    next_at: datetime
    due_at: datetime
    version: int
    created_at: datetime
    updated_at: datetime
    last_run_id: int | None = None
    last_run_status: str | None = None

    @property
    def expr(self) -> str:
        return self.schedule if self.schedule is not None else f"every {self.every}s"

    def to_json(self) -> dict[str, Any]:
        """The HTTP and CLI shape: next tick in UTC and in the key's zone."""
        local = self.next_at.astimezone(_zone(self.tz)) if self.schedule is not None else None
        return {
            "job": self.job,
            "key": self.key,
            "schedule": self.schedule,
            "every": self.every,
            "tz": self.tz,
            "params": self.params,
            "paused": self.paused,
            "next_at": self.next_at.isoformat(),
            "next_at_local": (local or self.next_at).isoformat(),
            "due_at": self.due_at.isoformat(),
            "version": self.version,
            "created_at": self.created_at.isoformat(),
            "updated_at": self.updated_at.isoformat(),
            "last_run": None
            if self.last_run_id is None
            else {"id": self.last_run_id, "status": self.last_run_status},
        }


@dataclass(frozen=True)
class Planned:
    """A claimed row's run: its slot, the row as claimed (`version`, `claimed_next_at`), where
    its next tick is, and when this run was to start (`start_at`: the slot plus the key's spread
    offset; "too late" counts from it)."""

    job: str
    key: str
    version: int
    claimed_next_at: datetime
    slot: datetime
    start_at: datetime
    next_at: datetime
    next_due_at: datetime


def _refuse(field: str, message: str) -> InvalidSchedule:
    return InvalidSchedule(message, (field,))


@functools.lru_cache(maxsize=4096)
def slots_of(schedule: str | None, every: int | None, tz: str) -> Slots:
    """A row's schedule, parsed once per process (rows share few distinct schedules)."""
    if every is not None:
        return Interval.parse(every)
    assert schedule is not None
    return Schedule.parse(schedule, tz)


def _zone(tz: str) -> ZoneInfo:
    return ZoneInfo(tz)


def spread_offset(job: Job, key: str) -> timedelta:
    """The key's start offset within the job's `spread`: the same on every instance and at every
    tick (a hash of job and key), in whole milliseconds."""
    if not job.spread:
        return timedelta(0)
    digest = hashlib.blake2b(f"{job.name}\x00{key}".encode(), digest_size=8).digest()
    fraction = int.from_bytes(digest, "big") / 2**64
    return timedelta(milliseconds=int(fraction * job.spread * 1000))


def dynamic_job(registry: Mapping[str, Job], name: Any) -> Job:
    if not isinstance(name, str) or name not in registry:
        raise _refuse("job", f"no job named {str(name)[:100]!r}")
    job = registry[name]
    if not job.dynamic:
        raise _refuse("job", f"job {name!r} is not dynamic (declare it with schedule='dynamic')")
    return job


def check_key(job: Job, key: Any) -> tuple[str, Any]:
    """The key's canonical text and its value as the key field holds it, or InvalidSchedule."""
    assert job.params is not None
    assert job.key is not None
    if isinstance(key, bool) or not isinstance(key, str | int):
        raise _refuse("key", f"a key is a str or an int, not {type(key).__name__}")
    field = job.params.model_fields[job.key]
    try:
        value = job.params.__pydantic_validator__.validate_assignment(
            job.params.model_construct(), job.key, key
        )
        value = getattr(value, job.key)
    except ValidationError as exc:
        msg = exc.errors()[0]["msg"] if exc.errors() else str(exc)
        raise _refuse("key", f"key {str(key)[:60]!r}: {msg} ({field.annotation})") from None
    text = key_text(value)
    problem = text_problem(text)
    if problem is None and not text:
        problem = "is empty: a key needs at least one character"
    if problem is None and len(text) > 200:
        problem = "is longer than 200 characters"
    if problem is not None:
        raise _refuse("key", f"key {problem}")
    return text, value


def key_from_text(job: Job, text: str) -> str | int:
    """A key given as text (a URL's path, the command line) as the key field takes it: an int
    key's decimal text as an int; anything else as it is (refused by `check_key`, naming it)."""
    if job.params is None or job.key is None:
        return text
    digits = text.removeprefix("-")
    if job.params.model_fields[job.key].annotation is int and digits.isascii() and digits.isdigit():
        return int(text)
    return text


def check(
    job: Job,
    key: Any,
    *,
    schedule: str | None = None,
    every: Any = None,
    tz: Any = "UTC",
    params: Any = None,
    paused: Any = False,
) -> Entry:
    """Validate one schedule for `job` (dynamic) and `key`; InvalidSchedule names the field."""
    text, value = check_key(job, key)
    if (schedule is None) == (every is None):
        raise _refuse("schedule", "give a schedule (a cron expression) or every= seconds")
    if not isinstance(tz, str) or text_problem(tz) is not None or len(tz) > 100:
        raise _refuse("tz", "tz is an IANA time zone name, e.g. 'Europe/Berlin'")
    if not isinstance(paused, bool):
        raise _refuse("paused", "paused is true or false")
    try:
        if every is not None:
            if tz != "UTC":
                raise _refuse("tz", "every= counts seconds in UTC: leave tz out")
            slots: Slots = Interval.parse(every)
        else:
            if not isinstance(schedule, str) or text_problem(schedule) is not None:
                raise _refuse("schedule", "schedule is a five-field cron expression")
            slots = Schedule.parse(schedule, tz)
    except ScheduleError as exc:
        where = "every" if every is not None else "tz" if "time zone" in str(exc) else "schedule"
        raise _refuse(where, str(exc)) from None
    data: Any = {} if params is None else params
    if not isinstance(data, Mapping):
        raise _refuse("params", "params is a JSON object")
    assert job.params is not None
    assert job.key is not None
    given = data.get(job.key, value)
    if given != value and str(given) != text:
        raise InvalidSchedule(
            f"params.{job.key} is {str(given)[:60]!r}, the key is {text!r}: they must agree",
            ("params", job.key),
        )
    try:
        model = job.params.model_validate({**data, job.key: value})
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        loc = ("params", *(str(part) for part in first["loc"]))
        raise InvalidSchedule(first["msg"], loc) from None
    dumped = model.model_dump(mode="json")
    problem = json_problem(dumped)
    if problem is not None:
        raise InvalidSchedule(f"Value {problem[1]}", ("params", *map(str, problem[0])))
    return Entry(
        job.name,
        text,
        schedule if every is None else None,
        slots.every if isinstance(slots, Interval) else None,
        slots.tz,
        dumped,
        paused,
        slots,
    )


# --- the caller's transaction --------------------------------------------------------------------

_PLACEHOLDER = re.compile(r"\$(\d+)")


class _Tx:
    """Statements in the caller's transaction, whatever it holds: an asyncpg connection (pooled
    or not), or a SQLAlchemy AsyncConnection / AsyncSession (statements through SQLAlchemy, so
    they belong to its transaction). Statements cast jsonb through text, so neither side's
    codecs matter, and write `CAST(x AS t)`: SQLAlchemy's `:name` binds do not mix with `::`."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.asyncpg = isinstance(conn, asyncpg.Connection | asyncpg.pool.PoolConnectionProxy)
        if not self.asyncpg:
            _check_sqlalchemy(conn)

    async def fetch(self, sql: str, *args: Any) -> list[Mapping[str, Any]]:
        if self.asyncpg:
            return list(await self.conn.fetch(sql, *args))
        from sqlalchemy import text

        bound = _PLACEHOLDER.sub(lambda m: f":p{m[1]}", sql)
        result = await self.conn.execute(
            text(bound), {f"p{i}": arg for i, arg in enumerate(args, 1)}
        )
        return list(result.mappings().all()) if result.returns_rows else []


def _check_sqlalchemy(conn: Any) -> None:
    wrong = TypeError(
        "cron.schedules takes an asyncpg connection, a SQLAlchemy AsyncConnection or an "
        f"AsyncSession, not a {type(conn).__name__}"
    )
    try:
        from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
    except ImportError:
        raise wrong from None
    if not isinstance(conn, AsyncConnection | AsyncSession):
        raise wrong


# --- SQL -----------------------------------------------------------------------------------------

_COLUMNS = (
    "s.job, s.key, s.schedule, s.every, s.tz, CAST(s.params AS text) AS params, s.paused, "
    "s.next_at, s.due_at, s.version, s.created_at, s.updated_at"
)
NOW_SQL = "SELECT now() AS now"
# SCHEDULES_MAX: the kept counts (migration 0020), not a count of the rows.
COUNT_SQL = """
SELECT coalesce(sum(schedules), 0) AS n, EXISTS (
    SELECT 1 FROM {schema}.schedules WHERE job = $1 AND key = $2) AS present
FROM {schema}.schedule_counts
"""
SET_SQL = f"""
INSERT INTO {{schema}}.schedules AS s
    (job, key, schedule, every, tz, params, paused, next_at, due_at)
VALUES ($1, $2, $3, $4, $5, CAST(CAST($6 AS text) AS jsonb), $7, $8, $9)
ON CONFLICT (job, key) DO UPDATE SET
    schedule = EXCLUDED.schedule, every = EXCLUDED.every, tz = EXCLUDED.tz,
    params = EXCLUDED.params, paused = EXCLUDED.paused, next_at = EXCLUDED.next_at,
    due_at = EXCLUDED.due_at, version = s.version + 1, claimed_until = NULL,
    claimed_by = NULL, updated_at = now()
RETURNING {_COLUMNS}
"""
REMOVE_SQL = "DELETE FROM {schema}.schedules WHERE job = $1 AND key = $2 RETURNING key"
PAUSE_SQL = f"""
UPDATE {{schema}}.schedules AS s
SET paused = true, version = s.version + 1, claimed_until = NULL, updated_at = now()
WHERE job = $1 AND key = $2
RETURNING {_COLUMNS}
"""
GET_SQL = f"SELECT {_COLUMNS} FROM {{schema}}.schedules AS s WHERE s.job = $1 AND s.key = $2"
# Keyset pagination by key; the prefix as a range, so the primary key answers it.
LIST_SQL = f"""
SELECT {_COLUMNS}, r.id AS last_run_id, r.status AS last_run_status
FROM {{schema}}.schedules AS s
LEFT JOIN LATERAL (
    SELECT id, status FROM {{schema}}.runs
    WHERE job = s.job AND key = s.key AND trigger IN ('scheduled', 'backfill')
    ORDER BY slot DESC, id DESC LIMIT 1
) AS r ON true
WHERE s.job = $1 AND s.key > $2
  AND ($3 = '' OR (s.key >= $3 AND left(s.key, length($3)) = $3))
  AND (CAST($4 AS timestamptz) IS NULL OR (s.due_at < $4 AND NOT s.paused))
ORDER BY s.key
LIMIT $5
"""

# The dispatcher's claim: the due end of `schedules_due`, rows another dispatcher holds skipped.
CLAIM_SQL = """
UPDATE {schema}.schedules AS s
SET claimed_until = now() + make_interval(secs => $3), claimed_by = $4
FROM (
    SELECT job, key FROM {schema}.schedules
    WHERE due_at <= now() AND NOT paused AND job = ANY($1::text[])
      AND (claimed_until IS NULL OR claimed_until <= now())
    ORDER BY due_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED
) AS due
WHERE s.job = due.job AND s.key = due.key
RETURNING s.job, s.key, s.schedule, s.every, s.tz, s.params::text AS params, s.next_at,
          s.due_at, s.version, now() AS db_now
"""
# Under the run's lock: does the row still say what was claimed?
HOLDS_SQL = """
SELECT EXISTS (
    SELECT 1 FROM {schema}.schedules
    WHERE job = $1 AND key = $2 AND version = $3 AND next_at = $4 AND NOT paused)
"""
# In the run's recording transaction: past the slot, if the row is still the one claimed. A row
# a writer holds is skipped, not waited for: the writer rewrites next_at itself, or rolls back
# and leaves the row due, and the next claim finds the slot attempted and only advances it.
ADVANCE_SQL = """
UPDATE {schema}.schedules AS s
SET next_at = $5, due_at = $6, claimed_until = NULL, claimed_by = NULL
FROM (
    SELECT job, key FROM {schema}.schedules
    WHERE job = $1 AND key = $2 AND version = $3 AND next_at = $4
    FOR UPDATE SKIP LOCKED
) AS held
WHERE s.job = held.job AND s.key = held.key
"""
# Under a retry's lock: the key's schedule as it is now (cronlock/core/runner.py `_decide_retry`).
CURRENT_SQL = """
SELECT schedule, every, tz, paused FROM {schema}.schedules WHERE job = $1 AND key = $2
"""
# The alert loop's (cronlock/delivery/alerts.py): a job's keys due for longer than its grace, the
# most overdue first, and how many, from the due end of `schedules_due` (a healthy deployment
# has none there, so both read next to nothing).
LATE_KEYS_SQL = """
SELECT key, next_at, due_at FROM {schema}.schedules
WHERE due_at <= now() - make_interval(secs => $2) AND NOT paused AND job = $1
ORDER BY due_at
LIMIT $3
"""
LATE_COUNT_SQL = """
SELECT count(*) FROM {schema}.schedules
WHERE due_at <= now() - make_interval(secs => $2) AND NOT paused AND job = $1
"""
# Schedules and paused from the kept counts (migration 0020: a few rows per job); due and late
# from the due end of `schedules_due`, which is what is due and nothing more.
STATS_SQL = """
SELECT j.job, coalesce(c.schedules, 0) AS schedules, coalesce(c.paused, 0) AS paused,
       coalesce(c.deltas, 0) AS deltas,
       (SELECT count(*) FROM {schema}.schedules AS s
        WHERE s.due_at <= now() AND NOT s.paused AND s.job = j.job) AS due,
       (SELECT count(*) FROM {schema}.schedules AS s
        WHERE s.due_at <= now() - make_interval(secs => j.grace) AND NOT s.paused
          AND s.job = j.job) AS late
FROM unnest($1::text[], $2::float8[]) AS j(job, grace)
LEFT JOIN LATERAL (
    SELECT sum(k.schedules) AS schedules, sum(k.paused) AS paused, count(*) AS deltas
    FROM {schema}.schedule_counts AS k WHERE k.job = j.job
) AS c ON true
"""
# Fold the counts' deltas into one row per job. Safe beside the triggers' appends (rows
# appended meanwhile are not in the DELETE's snapshot, so they stay) and beside another
# compaction (its deleted rows are skipped once it commits); skipped while one runs.
COMPACT_SQL = """
WITH lock AS (
    SELECT pg_try_advisory_xact_lock(hashtextextended($1, $2)) AS got
), gone AS (
    DELETE FROM {schema}.schedule_counts WHERE (SELECT got FROM lock)
    RETURNING job, schedules, paused
)
INSERT INTO {schema}.schedule_counts (job, schedules, paused)
SELECT job, sum(schedules), sum(paused) FROM gone GROUP BY job
HAVING sum(schedules) <> 0 OR sum(paused) <> 0
"""
# More delta rows than this for a job, and `stats` compacts them first.
COMPACT_ABOVE = 1000


def _row(r: Mapping[str, Any]) -> Row:
    params = r["params"]
    return Row(
        job=r["job"],
        key=r["key"],
        schedule=r["schedule"],
        every=r["every"],
        tz=r["tz"],
        params=json.loads(params) if isinstance(params, str) else params,
        paused=r["paused"],
        next_at=r["next_at"],
        due_at=r["due_at"],
        version=r["version"],
        created_at=r["created_at"],
        updated_at=r["updated_at"],
        last_run_id=r.get("last_run_id"),
        last_run_status=r.get("last_run_status"),
    )


# --- setting -------------------------------------------------------------------------------------


class Schedules:
    """`cron.schedules`: set, remove, pause, resume, get and list the schedules of dynamic jobs,
    in the caller's transaction (see the module docstring)."""

    def __init__(self, registry: Callable[[], Registry], settings: Settings) -> None:
        self._registry = registry
        self._settings = settings

    @property
    def _schema(self) -> str:
        return self._settings.db_schema

    def job_of(self, name: str) -> Job:
        """The dynamic job `name`, or InvalidSchedule naming `job`."""
        return dynamic_job(self._registry(), name)

    def check(
        self,
        job: str,
        key: Any,
        *,
        schedule: str | None = None,
        every: Any = None,
        tz: Any = "UTC",
        params: Any = None,
        paused: Any = False,
    ) -> Entry:
        """Validate without writing (what `set` checks first)."""
        return check(
            self.job_of(job),
            key,
            schedule=schedule,
            every=every,
            tz=tz,
            params=params,
            paused=paused,
        )

    async def set(
        self,
        conn: Any,
        job: str,
        key: Any,
        *,
        schedule: str | None = None,
        every: Any = None,
        tz: Any = "UTC",
        params: Any = None,
        paused: Any = False,
    ) -> Row:
        """Create or replace `key`'s schedule of `job`; its next tick counts from now (the
        database's). Replacing bumps its version: a run of the old schedule under way finishes,
        none more starts."""
        entry = self.check(
            job, key, schedule=schedule, every=every, tz=tz, params=params, paused=paused
        )
        return await self.write(conn, entry)

    async def write(self, conn: Any, entry: Entry) -> Row:
        """Write a checked `Entry` in `conn`'s transaction."""
        tx = _Tx(conn)
        limit = self._settings.schedules_max
        if limit:
            count = (await tx.fetch(qualify(COUNT_SQL, self._schema), entry.job, entry.key))[0]
            if not count["present"] and count["n"] >= limit:
                raise _refuse(
                    "key",
                    f"there are {count['n']} schedules, the limit (SCHEDULES_MAX) is {limit}: "
                    "remove some first",
                )
        now: datetime = (await tx.fetch(NOW_SQL))[0]["now"]
        job = self.job_of(entry.job)
        next_at = entry.slots.next_tick(now)
        rows = await tx.fetch(
            qualify(SET_SQL, self._schema),
            entry.job,
            entry.key,
            entry.schedule,
            entry.every,
            entry.tz,
            json.dumps(entry.params),
            entry.paused,
            next_at,
            next_at + spread_offset(job, entry.key),
        )
        return _row(rows[0])

    async def remove(self, conn: Any, job: str, key: Any) -> bool:
        """Remove `key`'s schedule; whether there was one. A run under way finishes."""
        text, _ = check_key(self.job_of(job), key)
        rows = await _Tx(conn).fetch(qualify(REMOVE_SQL, self._schema), job, text)
        return bool(rows)

    async def pause(self, conn: Any, job: str, key: Any) -> Row | None:
        """Pause `key`'s schedule (None: there is none); a run under way finishes."""
        text, _ = check_key(self.job_of(job), key)
        rows = await _Tx(conn).fetch(qualify(PAUSE_SQL, self._schema), job, text)
        return _row(rows[0]) if rows else None

    async def resume(self, conn: Any, job: str, key: Any) -> Row | None:
        """Resume `key`'s schedule from its next tick after now (slots while paused are not
        run); None: there is none."""
        row = await self.get(conn, job, key)
        if row is None:
            return None
        entry = self.check(
            job,
            key,
            schedule=row.schedule,
            every=row.every,
            tz=row.tz,
            params=row.params,
            paused=False,
        )
        return await self.write(conn, entry)

    async def get(self, conn: Any, job: str, key: Any) -> Row | None:
        text, _ = check_key(self.job_of(job), key)
        rows = await _Tx(conn).fetch(qualify(GET_SQL, self._schema), job, text)
        return _row(rows[0]) if rows else None

    async def list(
        self,
        conn: Any,
        job: str,
        *,
        prefix: str = "",
        due_before: datetime | None = None,
        after: str = "",
        limit: int = 100,
    ) -> list[Row]:
        """Schedules of `job` by key: those after the key `after` (keyset pagination), with keys
        starting with `prefix`, due (and not paused) before `due_before`."""
        self.job_of(job)
        if not 1 <= limit <= MAX_PAGE:
            raise _refuse("limit", f"limit is 1 to {MAX_PAGE}")
        for name, value in (("prefix", prefix), ("after", after)):
            if text_problem(value) is not None or len(value) > 200:
                raise _refuse(name, f"{name} is a key's text (at most 200 characters)")
        rows = await _Tx(conn).fetch(
            qualify(LIST_SQL, self._schema), job, after, prefix, due_before, limit
        )
        return [_row(r) for r in rows]


# --- the runner's side ---------------------------------------------------------------------------


async def holds(conn: Conn, schema: str, planned: Planned) -> bool:
    """Under the run's lock: the row still says what was claimed (else: "schedule changed")."""
    return bool(
        await conn.fetchval(
            qualify(HOLDS_SQL, schema),
            planned.job,
            planned.key,
            planned.version,
            planned.claimed_next_at,
        )
    )


async def advance(conn: Conn, schema: str, planned: Planned) -> bool:
    """Move the row past the run's slot, in the transaction that records the run."""
    status = await conn.execute(
        qualify(ADVANCE_SQL, schema),
        planned.job,
        planned.key,
        planned.version,
        planned.claimed_next_at,
        planned.next_at,
        planned.next_due_at,
    )
    return status.endswith(" 1")


@dataclass(frozen=True)
class Current:
    """A key's schedule as a retry of one of its failed slots sees it."""

    slots: Slots
    paused: bool


async def current(conn: Conn, schema: str, job: str, key: str) -> Current | None:
    """The key's schedule now (None: removed), for a retry deciding under the key's lock."""
    r = await conn.fetchrow(qualify(CURRENT_SQL, schema), job, key)
    if r is None:
        return None
    return Current(slots_of(r["schedule"], r["every"], r["tz"]), r["paused"])


async def late_keys(conn: Conn, schema: str, job: Job, limit: int) -> list[dict[str, Any]]:
    """At most `limit` of `job`'s keys due (not paused) for longer than its grace, the most
    overdue first: `key`, `slot` (the tick it waits for) and `due_at`."""
    rows = await conn.fetch(qualify(LATE_KEYS_SQL, schema), job.name, job.grace, limit)
    return [
        {"key": r["key"], "slot": r["next_at"].isoformat(), "due_at": r["due_at"].isoformat()}
        for r in rows
    ]


async def late_count(conn: Conn, schema: str, job: Job) -> int:
    """How many of `job`'s keys are due (not paused) for longer than its grace."""
    return int(await conn.fetchval(qualify(LATE_COUNT_SQL, schema), job.name, job.grace))


async def stats(conn: Conn, schema: str, jobs: Sequence[Job]) -> dict[str, dict[str, int]]:
    """Per dynamic job: its schedules, paused, due now, and late (due for longer than the job's
    grace: the dispatchers are not keeping up, or none is running)."""
    names, graces = [j.name for j in jobs], [j.grace for j in jobs]
    rows = await conn.fetch(qualify(STATS_SQL, schema), names, graces)
    if any(r["deltas"] > COMPACT_ABOVE for r in rows):
        # Nobody compacted for a while (no dispatcher running): this reader does, or leaves it.
        with contextlib.suppress(*DATABASE_ERRORS):
            await compact_counts(conn, schema)
    return {r["job"]: {k: int(r[k]) for k in ("schedules", "paused", "due", "late")} for r in rows}


async def compact_counts(conn: Conn, schema: str) -> None:
    """Fold the kept counts' deltas into one row per job (the dispatchers, now and then). Its
    lock's text names the schema, so namespace 0 (as the migrations' lock)."""
    await conn.execute(qualify(COMPACT_SQL, schema), internal_lock(schema, "schedule-counts"), 0)


# --- dispatching ---------------------------------------------------------------------------------


def plan(job: Job, r: Mapping[str, Any]) -> Planned:
    """The run a claimed row is due for: its latest due tick (slots missed while nobody
    dispatched are run once, the latest), and where the row goes after it."""
    slots = slots_of(r["schedule"], r["every"], r["tz"])
    now: datetime = r["db_now"]
    slot: datetime = r["next_at"]
    following = slots.next_tick(slot)
    if following <= now:
        slot = slots.prev_tick(now)
        following = slots.next_tick(slot)
    offset = spread_offset(job, r["key"])
    return Planned(
        job=job.name,
        key=r["key"],
        version=r["version"],
        claimed_next_at=r["next_at"],
        slot=slot,
        start_at=slot + offset,
        next_at=following,
        next_due_at=following + offset,
    )
