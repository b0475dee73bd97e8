"""Fan-out runs: one run of a job split into items that every instance works, each exactly once.

```python
@cron.job("reindex", schedule="0 2 * * *", fanout=True)
async def plan(ctx: JobContext) -> AsyncIterator[Any]: ...   # yields the items (JSON values)

@plan.each(timeout=60, retries=3)
async def reindex_one(ctx: ItemContext) -> Any: ...          # one item, in one transaction

@plan.done                                                    # optional
async def finished(ctx: DoneContext) -> Any: ...              # once, when every item settled
```

The trigger takes the job's lock as every trigger does; in that transaction the planner runs
and its items are written at once (COPY, `<DB_SCHEMA>.fanout_items`, migration 0014), with
the fan-out's row and its counters; the commit publishes them and the answer is 202. From then
on the items are the run's state, not any process:

- a worker (cronlock/core/fanout_runner.py, on every instance serving the job) claims an
  item with `FOR UPDATE SKIP LOCKED` in a transaction whose server-side timeouts are the
  item's timeout (plus DB_TIMEOUT_MARGIN), runs the item function on that connection, and
  commits the item's `succeeded` mark with its effects: a worker that dies rolls both back and
  the item's row lock goes with its connection; a frozen one loses it to those timeouts;
- a failed attempt is recorded (attempts, error, a backoff in `not_before`) in a transaction
  of its own; past the item's retries the item is `failed`, which settles it too;
- settling an item takes one off its shard's counter (`fanout_shards`, item n in shard
  n % shards: concurrent commits spread over several rows) and, when that counter reaches 0,
  one off the fan-out's `shards_left`, under the fan-out row's lock. The transaction that
  takes it to 0 settled the last item, whichever instance runs it: it runs `done` there (in a
  savepoint) and ends the run, `succeeded` when no item failed, else `failed` with the counts.

A later attempt at the slot (cronlock's retries, a backfill, a scheduled trigger of a slot
whose run failed) continues the slot's fan-out instead of planning anew: its failed items are
pending again with their attempts reset, the finished ones stay finished. `force` plans anew.

This module is the fan-out's SQL and the contexts its functions get.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from cronlock.core.jobs import JobContext, Trigger
from cronlock.db import literal
from cronlock.db.lock import timeout_args
from cronlock.db.pool import Conn
from cronlock.sql import qualify

# Counter rows per fan-out (fewer for fewer items): enough that item commits rarely queue on
# one row, few enough that recounting and summing them stays trivial.
SHARDS = 16
# A failed item's error, as kept (the run's error names the counts).
MAX_ERROR = 2000


@dataclass
class ItemContext(JobContext):
    """What an item function gets: `item` (the planned JSON value), `n` (its place in the
    plan, from 0), `attempt` (1 at first), and `conn` / `session`: the item's own transaction,
    which commits the item's effects with its `succeeded` mark or rolls both back."""

    item: Any = None
    n: int = 0


@dataclass
class DoneContext(JobContext):
    """What `@plan.done` gets: the counts of the settled run (`total`, `done`, `failed`), and
    `conn` / `session` in the transaction that settled the last item."""

    total: int = 0
    done: int = 0
    failed: int = 0


def notify_channel(schema: str) -> str:
    """Where a planning commit says "items to work" (channels are per database: per schema)."""
    return f"{schema}.fanout"


# --- planning (in the run's lock transaction) ----------------------------------------------

# (A fan-out whose run is gone from the ledger, emptied by hand, holds nothing.)
RUNNING_SQL = """
SELECT f.id, f.run_id FROM {schema}.fanouts f JOIN {schema}.runs r ON r.id = f.run_id
WHERE f.job = $1 AND coalesce(f.key, '') = coalesce($2::text, '') AND f.state = 'running'
ORDER BY f.id DESC LIMIT 1
"""

# The newest fan-out of the slot, if it did not succeed: the one a later attempt continues.
PREVIOUS_SQL = """
SELECT f.id, f.run_id, f.state, r.attempt FROM {schema}.fanouts f
JOIN {schema}.runs r ON r.id = f.run_id
WHERE f.job = $1 AND coalesce(f.key, '') = coalesce($2::text, '') AND f.slot = $3
ORDER BY f.id DESC LIMIT 1
"""

CREATE_SQL = """
INSERT INTO {schema}.fanouts (run_id, job, key, slot, total, shards, shards_left, traceparent)
VALUES ($1, $2, $3, $4, $5, $6, $6, $7)
RETURNING id
"""

SHARDS_SQL = """
INSERT INTO {schema}.fanout_shards (fanout_id, shard, remaining)
SELECT $1, s, c FROM unnest($2::int[], $3::int[]) AS t (s, c)
"""

# A later attempt takes the fan-out over (with its span's context, the items' spans' parent):
# its failed items are pending again, from attempt 1; all of them, or only those an operator
# picked (`$2`, cronlock/core/fanout_retry.py), the others staying failed.
CONTINUE_SQL = """
UPDATE {schema}.fanouts SET run_id = $2, state = 'running', settled_at = NULL, traceparent = $3
WHERE id = $1 AND state <> 'running'
RETURNING total, shards
"""
RESET_FAILED_SQL = """
WITH reset AS (
    UPDATE {schema}.fanout_items
    SET status = 'pending', attempts = 0, not_before = NULL, error = NULL
    WHERE fanout_id = $1 AND status = 'failed' AND ($2::int[] IS NULL OR n = ANY($2::int[]))
    RETURNING n
)
SELECT count(*)::int FROM reset
"""
# Items left failed count as failed (settled): only the pending ones keep a shard open.
RECOUNT_SQL = """
WITH c AS (
    SELECT n % $2 AS shard,
           count(*) FILTER (WHERE status = 'pending') AS remaining,
           count(*) FILTER (WHERE status = 'succeeded') AS done,
           count(*) FILTER (WHERE status = 'failed') AS failed
    FROM {schema}.fanout_items WHERE fanout_id = $1 GROUP BY 1
), s AS (
    UPDATE {schema}.fanout_shards s
    SET remaining = c.remaining, done = c.done, failed = c.failed
    FROM c WHERE s.fanout_id = $1 AND s.shard = c.shard
    RETURNING s.remaining
)
UPDATE {schema}.fanouts
SET shards_left = (SELECT count(*) FROM s WHERE remaining > 0)
WHERE id = $1
RETURNING shards_left
"""

NOTIFY_SQL = "SELECT pg_notify($1, $2)"


@dataclass(frozen=True)
class Previous:
    id: int
    run_id: int
    state: str
    attempt: int


async def running(conn: Conn, schema: str, job: str, key: str | None) -> int | None:
    """The run id of the (job, key)'s fan-out in progress, if one is."""
    row = await conn.fetchrow(qualify(RUNNING_SQL, schema), job, key)
    return int(row["run_id"]) if row is not None else None


async def previous(
    conn: Conn, schema: str, job: str, key: str | None, slot: datetime
) -> Previous | None:
    row = await conn.fetchrow(qualify(PREVIOUS_SQL, schema), job, key, slot)
    if row is None or row["state"] in ("running", "succeeded"):
        return None
    return Previous(row["id"], row["run_id"], row["state"], row["attempt"])


def shard_sizes(total: int) -> list[int]:
    """How many of `total` items (numbered from 0) fall in each shard (n % shards)."""
    shards = min(SHARDS, total)
    return [total // shards + (1 if s < total % shards else 0) for s in range(shards)]


def copy_line(fanout_id: int, n: int, encoded: str) -> bytes:
    """One row in COPY's text format: JSON text holds no tab, newline or other control
    character unescaped, so only its backslashes need doubling."""
    return f"{fanout_id}\t{n}\t{encoded.replace(chr(92), chr(92) * 2)}\n".encode()


async def create(
    conn: Conn,
    schema: str,
    *,
    run_id: int,
    job: str,
    key: str | None,
    slot: datetime | None,
    items: Sequence[str],
    traceparent: str | None = None,
) -> int:
    """Write a fan-out, its counters and its items (`items`: each one's JSON text) in the
    caller's transaction, in three statements whatever their number. `traceparent`: the
    planning run's span, its items' spans' parent."""
    sizes = shard_sizes(len(items))
    fanout_id = int(
        await conn.fetchval(
            qualify(CREATE_SQL, schema),
            run_id,
            job,
            key,
            slot,
            len(items),
            len(sizes),
            traceparent,
        )
    )
    if sizes:
        await conn.execute(qualify(SHARDS_SQL, schema), fanout_id, list(range(len(sizes))), sizes)
        await conn.copy_to_table(
            "fanout_items",
            schema_name=schema,
            columns=["fanout_id", "n", "item"],
            source=_chunks(fanout_id, items),
            format="text",
        )
    return fanout_id


async def _chunks(fanout_id: int, items: Sequence[str], size: int = 5000) -> Any:
    for start in range(0, len(items), size):
        yield b"".join(
            copy_line(fanout_id, n, items[n]) for n in range(start, min(len(items), start + size))
        )


@dataclass(frozen=True)
class Resumed:
    total: int
    left: int  # shards with items still unsettled
    retried: int  # failed items made pending again


async def resume(
    conn: Conn,
    schema: str,
    fanout_id: int,
    run_id: int,
    *,
    items: Sequence[int] | None = None,
    traceparent: str | None = None,
) -> Resumed:
    """Give the fan-out to the attempt `run_id` (traced as `traceparent`), its failed items
    pending again: all of them, or those numbered in `items`."""
    row = await conn.fetchrow(qualify(CONTINUE_SQL, schema), fanout_id, run_id, traceparent)
    assert row is not None, "a fan-out is continued only when it is not running"
    which = list(items) if items is not None else None
    retried = await conn.fetchval(qualify(RESET_FAILED_SQL, schema), fanout_id, which)
    left = await conn.fetchval(qualify(RECOUNT_SQL, schema), fanout_id, row["shards"] or 1)
    return Resumed(int(row["total"]), int(left or 0), int(retried or 0))


async def notify(conn: Conn, schema: str, fanout_id: int) -> None:
    await conn.execute(NOTIFY_SQL, notify_channel(schema), str(fanout_id))


# --- working items -------------------------------------------------------------------------

# The fan-outs in progress of these jobs, with what their items' contexts need.
ACTIVE_SQL = """
SELECT f.id, f.run_id, f.job, f.key, f.slot, f.shards, r.params, r.trigger, r.started_at,
       r.cancel_requested_at IS NOT NULL AS cancel_requested,
       coalesce(r.cancel_requested_by, 'an operator') AS cancelled_by, f.traceparent
FROM {schema}.fanouts f JOIN {schema}.runs r ON r.id = f.run_id
WHERE f.state = 'running' AND f.job = ANY($1::text[])
ORDER BY f.id
"""

# One pending item, locked, the transaction's timeouts set first (migration 0021's function,
# whose plan the server keeps per connection). A fan-out that was cancelled or settled
# meanwhile gives no item; `run_id` is the attempt working the fan-out now (a retry may have
# taken it over since the worker last looked), `traceparent` its span's.
CLAIM_SQL = """
SELECT n, item, attempts, run_id, traceparent FROM {schema}.fanout_claim($1, $2, $3, $4)
"""

# An item succeeded: the session reset (what the item function set goes, the timeouts set
# again), then the item marked and taken off its shard's counter, in one call (migration
# 0021), which gives the counter's new value (NULL when the item was settled already).
SUCCEEDED_SQL = "SELECT {schema}.fanout_item_succeeded($1, $2, $3, $4, $5, $6, $7, $8)"
# The same for an item that returned nothing (most do), in one round trip where bind
# parameters take two: sent with the simple protocol, cronlock's own values written in
# (cronlock/db/literal.py), its answer the command tag, "SELECT 1" when the item was its
# shard's last. What an item returned is the job's data, and stays a bind parameter: never in
# statement text, which the server may log or show in pg_stat_activity.
SUCCEEDED_BARE_SQL = """
SELECT 1 FROM {schema}.fanout_item_succeeded({args}) AS s(remaining)
WHERE s.remaining OPERATOR(pg_catalog.=) 0
"""


# An item failed for good (its retries spent): settled, and taken off its shard's counter: the
# counter's new value, or no row when the item was settled already. (A success settles
# through migration 0021's function, SUCCEEDED_SQL.)
FAILED_SQL = """
WITH item AS (
    UPDATE {schema}.fanout_items
    SET status = 'failed', attempts = attempts + 1, result = NULL, error = $3, instance = $4,
        finished_at = clock_timestamp(), not_before = NULL
    WHERE fanout_id = $1 AND n = $2 AND status = 'pending'
    RETURNING n
)
UPDATE {schema}.fanout_shards s
SET remaining = s.remaining - 1, failed = s.failed + 1
FROM item
WHERE s.fanout_id = $1 AND s.shard = item.n % $5
RETURNING s.remaining
"""

# A shard emptied: one fewer to go, under the fan-out row's lock (which orders the last
# item's commit against a cancel, and against another shard's last item).
SHARD_SETTLED_SQL = """
UPDATE {schema}.fanouts SET shards_left = shards_left - 1
WHERE id = $1
RETURNING shards_left, state, total, run_id
"""

COUNTS_SQL = """
SELECT coalesce(sum(done), 0)::int AS done, coalesce(sum(failed), 0)::int AS failed
FROM {schema}.fanout_shards WHERE fanout_id = $1
"""

CLOSE_SQL = """
UPDATE {schema}.fanouts SET state = $2, settled_at = clock_timestamp()
WHERE id = $1 AND state = 'running'
RETURNING run_id
"""

# A failed attempt, in a transaction of its own after the item's rolled back: the item's row
# locked unless another worker has it already (then that worker's attempt is the one that
# counts).
ATTEMPT_SQL = """
SELECT attempts FROM {schema}.fanout_items
WHERE fanout_id = $1 AND n = $2 AND status = 'pending'
FOR UPDATE SKIP LOCKED
"""
RETRY_LATER_SQL = """
UPDATE {schema}.fanout_items
SET attempts = attempts + 1, error = $3, instance = $4,
    not_before = now() + make_interval(secs => $5)
WHERE fanout_id = $1 AND n = $2
"""


@dataclass(frozen=True)
class Active:
    """A fan-out in progress, as the workers see it."""

    id: int
    run_id: int
    job: str
    key: str | None
    slot: datetime | None
    shards: int
    params: Any
    trigger: Trigger
    started_at: datetime
    cancel_requested: bool
    cancelled_by: str
    # The span of the attempt working it (a W3C traceparent), when that attempt was traced.
    traceparent: str | None = None


async def active(conn: Conn, schema: str, jobs: list[str]) -> list[Active]:
    rows = await conn.fetch(qualify(ACTIVE_SQL, schema), jobs)
    return [Active(**dict(r.items())) for r in rows]


async def claim(
    conn: Conn,
    schema: str,
    fanout_id: int,
    *,
    db_timeout: float,
    client_check_interval: float,
    server_version: int,
) -> asyncpg.Record | None:
    """One pending item of the fan-out, locked, with the transaction's timeouts set."""
    return await conn.fetchrow(
        qualify(CLAIM_SQL, schema),
        fanout_id,
        *timeout_args(db_timeout, client_check_interval, server_version),
    )


async def succeeded(
    conn: Conn,
    schema: str,
    a: Active,
    n: int,
    result: Any,
    *,
    instance: str,
    db_timeout: float,
    client_check_interval: float,
    server_version: int,
) -> bool:
    """Reset the item's session and settle item `n` succeeded; whether that emptied its
    shard's counter (False too when another settled it already)."""
    settings = timeout_args(db_timeout, client_check_interval, server_version)
    if result is not None:
        left = await conn.fetchval(
            qualify(SUCCEEDED_SQL, schema), a.id, n, result, instance, a.shards, *settings
        )
        return bool(left == 0)
    timeout, check, transaction_ms = settings
    args = literal.join(
        literal.integer(a.id),
        literal.integer(n),
        "NULL",
        literal.text(instance),
        literal.integer(a.shards),
        literal.text(timeout),
        literal.text(check),
        literal.integer(transaction_ms),
    )
    return await literal.selects_one(conn, qualify(SUCCEEDED_BARE_SQL, schema).format(args=args))


async def failed(
    conn: Conn, schema: str, a: Active, n: int, *, error: str, instance: str
) -> int | None:
    """Settle item `n` failed; its shard's counter after it (None: settled already by another)."""
    value = await conn.fetchval(qualify(FAILED_SQL, schema), a.id, n, error, instance, a.shards)
    return int(value) if value is not None else None


async def shard_settled(conn: Conn, schema: str, fanout_id: int) -> asyncpg.Record:
    row = await conn.fetchrow(qualify(SHARD_SETTLED_SQL, schema), fanout_id)
    assert row is not None
    return row


async def counts(conn: Conn, schema: str, fanout_id: int) -> tuple[int, int]:
    row = await conn.fetchrow(qualify(COUNTS_SQL, schema), fanout_id)
    assert row is not None
    return int(row["done"]), int(row["failed"])


async def close(conn: Conn, schema: str, fanout_id: int, state: str) -> int | None:
    """End a fan-out in progress (`succeeded`, `failed`, `cancelled`); None if it was not."""
    value = await conn.fetchval(qualify(CLOSE_SQL, schema), fanout_id, state)
    return int(value) if value is not None else None


async def attempts(conn: Conn, schema: str, fanout_id: int, n: int) -> int | None:
    value = await conn.fetchval(qualify(ATTEMPT_SQL, schema), fanout_id, n)
    return int(value) if value is not None else None


async def retry_later(
    conn: Conn, schema: str, fanout_id: int, n: int, error: str, instance: str, delay: float
) -> None:
    await conn.execute(qualify(RETRY_LATER_SQL, schema), fanout_id, n, error, instance, delay)


# --- retrying failed items (cronlock/core/fanout_retry.py) -------------------------------

# The fan-out a run works, locked (against another retry; every item is settled once it ended).
# No row: the run planned none, or a later attempt works it now (`run_id` moved on).
OF_RUN_SQL = """
SELECT id, state, total FROM {schema}.fanouts WHERE run_id = $1 FOR UPDATE
"""
ITEM_STATUS_SQL = "SELECT status FROM {schema}.fanout_items WHERE fanout_id = $1 AND n = $2"


@dataclass(frozen=True)
class OfRun:
    id: int
    state: str
    total: int


async def of_run(conn: Conn, schema: str, run_id: int) -> OfRun | None:
    row = await conn.fetchrow(qualify(OF_RUN_SQL, schema), run_id)
    return OfRun(row["id"], row["state"], row["total"]) if row is not None else None


async def item_status(conn: Conn, schema: str, fanout_id: int, n: int) -> str | None:
    """Item `n`'s status (pending, succeeded, failed); None when the fan-out has no such item."""
    found: str | None = await conn.fetchval(qualify(ITEM_STATUS_SQL, schema), fanout_id, n)
    return found


# --- what operators see --------------------------------------------------------------------

PUBLISH_SQL = """
WITH gone AS (
    DELETE FROM {schema}.fanout_workers WHERE instance = $1 AND NOT (fanout_id = ANY($2::bigint[]))
)
INSERT INTO {schema}.fanout_workers (fanout_id, instance, running, seen_at)
SELECT f.id, $1, t.running, now()
FROM unnest($2::bigint[], $3::int[]) AS t (fanout_id, running)
JOIN {schema}.fanouts f ON f.id = t.fanout_id
ON CONFLICT (fanout_id, instance) DO UPDATE SET running = excluded.running, seen_at = now()
"""


async def publish(conn: Conn, schema: str, instance: str, running: dict[int, int]) -> None:
    """This instance's items in flight per fan-out (what /cron/runs/{id} counts as running)."""
    ids = [k for k, v in running.items() if v > 0]
    await conn.execute(qualify(PUBLISH_SQL, schema), instance, ids, [running[k] for k in ids])


# `running`: items in flight as published within `$2` seconds (a dead instance's go stale).
ITEMS_SQL = """
SELECT f.id, f.total, f.state,
       (SELECT coalesce(sum(s.done), 0)::int FROM {schema}.fanout_shards s
        WHERE s.fanout_id = f.id) AS done,
       (SELECT coalesce(sum(s.failed), 0)::int FROM {schema}.fanout_shards s
        WHERE s.fanout_id = f.id) AS failed,
       CASE WHEN f.state = 'running' THEN coalesce((
           SELECT sum(w.running) FROM {schema}.fanout_workers w
           WHERE w.fanout_id = f.id AND w.seen_at > now() - make_interval(secs => $2)), 0)::int
       ELSE 0 END AS running
FROM {schema}.fanouts f WHERE f.run_id = $1
"""


@dataclass(frozen=True)
class Counts:
    total: int
    done: int
    failed: int
    running: int


async def items_of(conn: Conn, schema: str, run_id: int, fresh: float) -> Counts | None:
    """The item counts of a fan-out run (None for a run that is not one, or no longer the
    attempt working its fan-out)."""
    row = await conn.fetchrow(qualify(ITEMS_SQL, schema), run_id, fresh)
    if row is None:
        return None
    return Counts(row["total"], row["done"], row["failed"], row["running"])


FAILED_ITEMS_SQL = """
SELECT i.n, i.item, i.attempts, i.error, i.finished_at FROM {schema}.fanout_items i
JOIN {schema}.fanouts f ON f.id = i.fanout_id
WHERE f.run_id = $1 AND i.status = 'failed'
ORDER BY i.n LIMIT $2
"""


async def failed_items(conn: Conn, schema: str, run_id: int, limit: int = 50) -> list[Any]:
    return [
        dict(r.items()) for r in await conn.fetch(qualify(FAILED_ITEMS_SQL, schema), run_id, limit)
    ]


def encode(item: Any) -> str:
    """An item's JSON text, or a TypeError naming what is not JSON (NaN and Infinity
    included: jsonb refuses them)."""
    try:
        return json.dumps(item, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as exc:
        raise TypeError(f"{type(item).__name__} {str(item)[:80]!r} is not JSON: {exc}") from exc
