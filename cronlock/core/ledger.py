"""The run ledger (`<DB_SCHEMA>.runs`): the only module that speaks SQL about runs.

Timestamps come from the database clock: `now()` inside the lock transaction,
`clock_timestamp()` for when a run finished.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from cronlock.db.lock import JOB_KEY_SQL, PG_LOCKS_KEY, PG_LOCKS_OURS
from cronlock.db.pool import Conn
from cronlock.sql import qualify

COLUMNS = (
    "id, job, key, slot, status, trigger, source, instance, backend_pid, started_at,"
    " finished_at, duration_ms, params, result, error, attempt, retry_of,"
    " cancel_requested_at, cancel_requested_by, lease_token, lease_seconds, lease_expires_at,"
    " deadline_at, checkpoint, progress, steps"
)


@dataclass(frozen=True)
class Run:
    id: int
    job: str
    key: str | None  # a keyed job's key (its canonical text); None for a key-less job
    slot: datetime | None
    status: str
    trigger: str
    source: str
    instance: str
    backend_pid: int | None
    started_at: datetime
    finished_at: datetime | None
    duration_ms: float | None
    params: Any
    result: Any
    error: str | None
    attempt: int = 1
    retry_of: int | None = None  # the attempt this one retries or took over from
    cancel_requested_at: datetime | None = None
    cancel_requested_by: str | None = None
    # Lease runs only (cronlock/core/lease.py); None / 0 for a one-transaction run.
    lease_token: int | None = None
    lease_seconds: float | None = None
    lease_expires_at: datetime | None = None
    deadline_at: datetime | None = None
    checkpoint: Any = None
    progress: Any = None
    steps: int = 0

    @classmethod
    def from_record(cls, r: asyncpg.Record) -> Run:
        return cls(**dict(r.items()))


def iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


# Per (job, key, slot), coalesced as the unique index (migration 0005) is, so it answers.
ALREADY_DONE_SQL = """
SELECT EXISTS (
    SELECT 1 FROM {schema}.runs
    WHERE job = $1 AND coalesce(key, '') = coalesce($3::text, '') AND slot = $2
      AND status = 'succeeded' AND trigger IN ('scheduled', 'backfill')
)
"""


async def already_done(
    conn: Conn, schema: str, job: str, slot: datetime, key: str | None = None
) -> bool:
    return bool(await conn.fetchval(qualify(ALREADY_DONE_SQL, schema), job, slot, key))


START_SQL = """
INSERT INTO {schema}.runs
    (job, slot, trigger, source, instance, backend_pid, started_at, params, key, attempt, retry_of,
     message_id)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
RETURNING id
"""


async def start(
    conn: Conn | asyncpg.Pool,
    schema: str,
    *,
    job: str,
    slot: datetime | None,
    trigger: str,
    source: str,
    instance: str,
    backend_pid: int,
    started_at: datetime,
    params: Any,
    key: str | None = None,
    attempt: int = 1,
    retry_of: int | None = None,
    message_id: str | None = None,
) -> int:
    """Record a run as `running`, committed at once (outside the lock transaction), so that a
    run in progress can be followed, and a run whose instance died is visible afterwards."""
    run_id = await conn.fetchval(
        qualify(START_SQL, schema),
        job,
        slot,
        trigger,
        source,
        instance,
        backend_pid,
        started_at,
        params,
        key,
        attempt,
        retry_of,
        message_id,
    )
    assert isinstance(run_id, int)
    return run_id


# Migration 0015: a signed delivery's message id (QStash's `Upstash-Message-Id`) is kept with
# the run it started.
MESSAGE_DONE_SQL = """
SELECT id FROM {schema}.runs
WHERE message_id = $1 AND status = 'succeeded'
ORDER BY id
LIMIT 1
"""


async def message_done(conn: Conn, schema: str, message_id: str) -> int | None:
    """The run that a delivery with this message id made succeed, if any: a redelivery of it
    is done (the runner asks under the job's lock, so a run still committing is waited out)."""
    run_id = await conn.fetchval(qualify(MESSAGE_DONE_SQL, schema), message_id)
    return run_id if isinstance(run_id, int) else None


SUCCEED_SQL = """
UPDATE {schema}.runs
SET status = 'succeeded', finished_at = clock_timestamp(), result = $2,
    duration_ms = extract(epoch FROM clock_timestamp() - started_at) * 1000
WHERE id = $1
RETURNING duration_ms
"""


async def succeed(conn: Conn, schema: str, run_id: int, result: Any) -> float:
    """Mark the run succeeded inside the job's own transaction: it commits with the job's
    effects or not at all."""
    duration = await conn.fetchval(qualify(SUCCEED_SQL, schema), run_id, result)
    return float(duration or 0.0)


FINISH_SQL = """
UPDATE {schema}.runs
SET status = $2, error = $3, failure = $4, finished_at = clock_timestamp(),
    duration_ms = extract(epoch FROM clock_timestamp() - started_at) * 1000
WHERE id = $1 AND status IN ('running', 'abandoned')
"""


async def finish(
    conn: Conn | asyncpg.Pool,
    schema: str,
    run_id: int,
    status: str,
    error: str | None,
    failure: dict[str, Any] | None = None,
) -> None:
    """Record a run that did not succeed, in its own short transaction, after the rollback.

    A `succeeded` row never changes: if the job's commit did reach the database after all, it
    stays. An `abandoned` one does: the sweeper may have guessed between our rollback and
    this update, and the instance that ran the job knows better.
    """
    await conn.execute(qualify(FINISH_SQL, schema), run_id, status, error, failure)


FAILURE_SQL = "UPDATE {schema}.runs SET failure = $2 WHERE id = $1 AND status = 'failed'"


async def record_failure(conn: Conn, schema: str, run_id: int, failure: dict[str, Any]) -> None:
    """Add what a failed lease run raised to its row (its status was written by its fence)."""
    await conn.execute(qualify(FAILURE_SQL, schema), run_id, failure)


FAILURE_OF_SQL = "SELECT failure FROM {schema}.runs WHERE id = $1"


async def failure_of(conn: Conn | asyncpg.Pool, schema: str, run_id: int) -> Any:
    """A run's failure detail (`{"type", "message", "traceback"}`), or None."""
    return await conn.fetchval(qualify(FAILURE_OF_SQL, schema), run_id)


GET_SQL = f"SELECT {COLUMNS} FROM {{schema}}.runs WHERE id = $1"


async def get(conn: Conn | asyncpg.Pool, schema: str, run_id: int) -> Run | None:
    row = await conn.fetchrow(qualify(GET_SQL, schema), run_id)
    return Run.from_record(row) if row is not None else None


LIST_SQL = f"""
SELECT {COLUMNS} FROM {{schema}}.runs
WHERE ($1::text IS NULL OR job = $1)
  AND ($2::text[] IS NULL OR status = ANY($2::text[]))
  AND ($3::bigint IS NULL OR id < $3)
  AND ($5::text IS NULL OR key = $5)
ORDER BY id DESC
LIMIT $4
"""


async def list_runs(
    conn: Conn | asyncpg.Pool,
    schema: str,
    *,
    job: str | None = None,
    status: str | None = None,
    before: int | None = None,
    limit: int = 50,
    key: str | None = None,
    statuses: Sequence[str] | None = None,
) -> list[Run]:
    """Newest first; `before` is the cursor (a run id) for the next page; `key` keeps one
    key's runs (of keyed jobs); `statuses`: any of these (the dashboard's failures)."""
    wanted = [status] if status is not None else list(statuses) if statuses else None
    rows = await conn.fetch(qualify(LIST_SQL, schema), job, wanted, before, limit, key)
    return [Run.from_record(r) for r in rows]


LAST_RUNS_SQL = f"""
SELECT DISTINCT ON (job) {COLUMNS} FROM {{schema}}.runs
WHERE job = ANY($1::text[]) AND status <> 'running'
ORDER BY job, id DESC
"""


async def last_runs(conn: Conn | asyncpg.Pool, schema: str, jobs: list[str]) -> dict[str, Run]:
    rows = await conn.fetch(qualify(LAST_RUNS_SQL, schema), jobs)
    return {r["job"]: Run.from_record(r) for r in rows}


# A `running` row whose backend holds the job's advisory lock no more was left by an instance
# that died (kill -9, lost connection): its transaction rolled back, so nothing of it
# persisted. Matching the backend too closes it even while a newer run holds the lock. A
# keyed run's lock is its key's (the row's key is part of the hashed text). A lease run holds
# no lock while it runs: its lease says whether it is live (cronlock/core/lease_runner.py takes over
# or times out the expired ones), so it is never closed here.
_RUN_KEY_SQL = JOB_KEY_SQL.format(schema="$4", job="r.job", key="r.key", namespace="$1")
ABANDON_SQL = f"""
UPDATE {{schema}}.runs r
SET status = 'abandoned', finished_at = clock_timestamp(),
    error = 'the instance running it went away; its transaction rolled back'
WHERE r.status = 'running' AND r.lease_token IS NULL
  AND r.started_at < now() - make_interval(secs => $3)
  -- A fan-out run holds no lock once planned: its items are its state (cronlock/core/fanout.py).
  AND NOT EXISTS (SELECT 1 FROM {{schema}}.fanouts f WHERE f.run_id = r.id)
  AND NOT EXISTS (
      SELECT 1 FROM pg_locks l
      WHERE {PG_LOCKS_OURS} AND l.granted
        AND {PG_LOCKS_KEY} = {_RUN_KEY_SQL}
        AND (r.backend_pid IS NULL OR l.pid = r.backend_pid)
  )
  AND ($2::text IS NULL OR r.job = $2)
RETURNING r.id
"""


async def close_abandoned(
    conn: Conn | asyncpg.Pool,
    schema: str,
    namespace: int,
    job: str | None = None,
    min_age: float = 1.0,
) -> list[int]:
    """Close `running` rows whose lock is gone; `min_age` spares a run whose row was committed
    a moment before its lock transaction was seen."""
    rows = await conn.fetch(qualify(ABANDON_SQL, schema), namespace, job, min_age, schema)
    return [r["id"] for r in rows]


# A fan-out run's fan-out (and so its items) goes with it (cronlock/core/fanout.py).
PRUNE_SQL = """
WITH gone AS (
    DELETE FROM {schema}.runs
    WHERE status <> 'running' AND started_at < now() - make_interval(days => 0, secs => $1)
    RETURNING id
), fanouts AS (
    DELETE FROM {schema}.fanouts f USING gone WHERE f.run_id = gone.id RETURNING f.id
), items AS (
    DELETE FROM {schema}.fanout_items i USING fanouts WHERE i.fanout_id = fanouts.id
)
SELECT count(*) FROM gone
"""


async def prune(conn: Conn | asyncpg.Pool, schema: str, retention_seconds: float) -> int:
    return int(await conn.fetchval(qualify(PRUNE_SQL, schema), retention_seconds) or 0)


# --- operator views (jobs, runs, locks, catch-up) ------------------------------------------

# The newest slot each job has a counted success for; the partial unique index on
# (job, slot) makes this an index scan.
LAST_SUCCEEDED_SQL = """
SELECT job, max(slot) AS slot FROM {schema}.runs
WHERE job = ANY($1::text[]) AND status = 'succeeded' AND trigger IN ('scheduled', 'backfill')
GROUP BY job
"""


async def last_succeeded_slots(
    conn: Conn | asyncpg.Pool, schema: str, jobs: list[str]
) -> dict[str, datetime]:
    """The newest slot with a succeeded scheduled or backfill run, per job (manual runs do not
    count, as for "already done")."""
    rows = await conn.fetch(qualify(LAST_SUCCEEDED_SQL, schema), jobs)
    return {r["job"]: r["slot"] for r in rows if r["slot"] is not None}


# When this database first saw each job (`jobs_seen`, migration 0018): a job's history starts
# there, so slots before it are neither missed nor overdue. Every instance (and the CLI's
# `run`) records the jobs it declares once it finds the database migrated; the first to do so
# sets the time, by the database's clock, and later ones change nothing.
SEE_JOBS_SQL = """
INSERT INTO {schema}.jobs_seen (job) SELECT unnest($1::text[]) ON CONFLICT (job) DO NOTHING
"""
FIRST_SEEN_SQL = """
SELECT job, first_seen_at FROM {schema}.jobs_seen WHERE job = ANY($1::text[])
"""


async def see_jobs(conn: Conn | asyncpg.Pool, schema: str, jobs: list[str]) -> None:
    """Record `jobs` as seen now, unless this database saw them before."""
    await conn.execute(qualify(SEE_JOBS_SQL, schema), jobs)


async def first_seen(
    conn: Conn | asyncpg.Pool, schema: str, jobs: list[str]
) -> dict[str, datetime]:
    """When this database first saw each of `jobs` (absent: never, so nothing is late yet)."""
    rows = await conn.fetch(qualify(FIRST_SEEN_SQL, schema), jobs)
    return {r["job"]: r["first_seen_at"] for r in rows}


RUNNING_BY_PID_SQL = """
SELECT backend_pid, id, job, key FROM {schema}.runs
WHERE status = 'running' AND backend_pid = ANY($1::int[])
ORDER BY id
"""


@dataclass(frozen=True)
class Running:
    """A `running` row as the lock views need it: which run, and of which job and key."""

    id: int
    job: str
    key: str | None


async def running_by_pid(
    conn: Conn | asyncpg.Pool, schema: str, pids: list[int]
) -> dict[int, Running]:
    """The `running` row of each lock-holding backend: pid -> its run (the newest wins). A
    keyed run's lock cannot be named from its hash alone: its row's key names it."""
    if not pids:
        return {}
    return {
        r["backend_pid"]: Running(r["id"], r["job"], r["key"])
        for r in await conn.fetch(qualify(RUNNING_BY_PID_SQL, schema), pids)
    }


SLOT_ATTEMPTED_SQL = """
SELECT EXISTS (
    SELECT 1 FROM {schema}.runs
    WHERE job = $1 AND slot = $2 AND trigger IN ('scheduled', 'backfill')
)
"""


async def slot_attempted(conn: Conn | asyncpg.Pool, schema: str, job: str, slot: datetime) -> bool:
    """Whether any scheduled or backfill run, whatever its outcome, was made for this slot."""
    return bool(await conn.fetchval(qualify(SLOT_ATTEMPTED_SQL, schema), job, slot))


KEY_SLOT_ATTEMPTED_SQL = """
SELECT EXISTS (
    SELECT 1 FROM {schema}.runs
    WHERE job = $1 AND key = $2 AND slot = $3 AND trigger IN ('scheduled', 'backfill')
)
"""


async def key_slot_attempted(conn: Conn, schema: str, job: str, key: str, slot: datetime) -> bool:
    """Whether any scheduled or backfill run of this key was made for this slot (a dynamic
    job's first attempt: index runs_key_slot, migration 0013)."""
    return bool(await conn.fetchval(qualify(KEY_SLOT_ATTEMPTED_SQL, schema), job, key, slot))


# The missed-slot policy `all` (cronlock/core/catchup.py): which recent slots have any attempt
# (where the job's history starts is `first_seen`).
ATTEMPTED_SINCE_SQL = """
SELECT DISTINCT slot FROM {schema}.runs
WHERE job = $1 AND slot >= $2 AND trigger IN ('scheduled', 'backfill')
"""


async def attempted_slots(
    conn: Conn | asyncpg.Pool, schema: str, job: str, since: datetime
) -> set[datetime]:
    """Slots from `since` on with a scheduled or backfill run, whatever its outcome."""
    rows = await conn.fetch(qualify(ATTEMPTED_SINCE_SQL, schema), job, since)
    return {r["slot"] for r in rows}


# --- retries (cronlock/core/retries.py) -----------------------------------------------------------

RETRIED_SQL = "SELECT EXISTS (SELECT 1 FROM {schema}.runs WHERE retry_of = $1)"


async def retried(conn: Conn | asyncpg.Pool, schema: str, run_id: int) -> bool:
    """Whether an attempt retrying `run_id` exists (the runner asks under the job's lock)."""
    return bool(await conn.fetchval(qualify(RETRIED_SQL, schema), run_id))


RETRIED_BY_SQL = "SELECT min(id) FROM {schema}.runs WHERE retry_of = $1"


async def retried_by(conn: Conn | asyncpg.Pool, schema: str, run_id: int) -> int | None:
    """The attempt that retried `run_id`, if one did."""
    found = await conn.fetchval(qualify(RETRIED_BY_SQL, schema), run_id)
    return int(found) if found is not None else None


# The newest attempt of each recent (job, key, slot) that did not succeed and was not retried
# yet, and whose slot has no success at all (a scheduler's own retry may have made one).
LAST_FAILED_ATTEMPTS_SQL = f"""
SELECT {COLUMNS} FROM (
    SELECT DISTINCT ON (job, coalesce(key, ''), slot) {COLUMNS} FROM {{schema}}.runs
    WHERE job = ANY($1::text[]) AND slot >= $2 AND trigger IN ('scheduled', 'backfill')
      AND status <> 'running'
    ORDER BY job, coalesce(key, ''), slot, attempt DESC, id DESC
) AS r
WHERE r.status IN ('failed', 'timed_out', 'abandoned')
  AND NOT EXISTS (SELECT 1 FROM {{schema}}.runs n WHERE n.retry_of = r.id)
  AND NOT EXISTS (
      SELECT 1 FROM {{schema}}.runs s
      WHERE s.job = r.job AND coalesce(s.key, '') = coalesce(r.key, '') AND s.slot = r.slot
        AND s.status IN ('succeeded', 'running') AND s.trigger IN ('scheduled', 'backfill'))
ORDER BY r.slot, r.id
"""


async def last_failed_attempts(
    conn: Conn | asyncpg.Pool, schema: str, jobs: list[str], since: datetime
) -> list[Run]:
    """The attempts a retry may follow: see LAST_FAILED_ATTEMPTS_SQL; oldest slot first."""
    rows = await conn.fetch(qualify(LAST_FAILED_ATTEMPTS_SQL, schema), jobs, since)
    return [Run.from_record(r) for r in rows]


# --- alerts (cronlock/delivery/alerts.py): what started or finished since the scanner's last look -

STARTED_SINCE_SQL = f"""
SELECT {COLUMNS} FROM {{schema}}.runs
WHERE started_at >= $1 AND job = ANY($2::text[]) ORDER BY id
"""
FINISHED_SINCE_SQL = f"""
SELECT {COLUMNS} FROM {{schema}}.runs
WHERE finished_at >= $1 AND job = ANY($2::text[]) AND status <> 'running' ORDER BY id
"""
# The outcome before this run's, of its job and key (cancelled runs say nothing of health).
PREVIOUS_STATUS_SQL = """
SELECT status FROM {schema}.runs
WHERE job = $1 AND coalesce(key, '') = coalesce($3::text, '') AND id < $2
  AND status NOT IN ('running', 'cancelled')
ORDER BY id DESC LIMIT 1
"""


async def started_since(conn: Conn, schema: str, jobs: list[str], since: datetime) -> list[Run]:
    rows = await conn.fetch(qualify(STARTED_SINCE_SQL, schema), since, jobs)
    return [Run.from_record(r) for r in rows]


async def finished_since(conn: Conn, schema: str, jobs: list[str], since: datetime) -> list[Run]:
    rows = await conn.fetch(qualify(FINISHED_SINCE_SQL, schema), since, jobs)
    return [Run.from_record(r) for r in rows]


async def previous_status(conn: Conn, schema: str, run: Run) -> str | None:
    found: str | None = await conn.fetchval(
        qualify(PREVIOUS_STATUS_SQL, schema), run.job, run.id, run.key
    )
    return found
