"""Jobs the tests trigger (CRON_JOBS=tests.jobs). Each writes its effect through ctx.conn, so
a test can count effects in the `job_effects` table."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pydantic import BaseModel, Field, model_validator

from cronlock.core.jobs import JobContext, job

EFFECTS_SQL = """
CREATE TABLE IF NOT EXISTS job_effects (
    id     bigserial PRIMARY KEY,
    job    text NOT NULL,
    run_id bigint NOT NULL,
    slot   timestamptz,
    at     timestamptz NOT NULL DEFAULT now()
)
"""


async def record(ctx: JobContext) -> None:
    # Creating the table is serialised with a lock of its own: two different jobs may run at
    # once, and CREATE TABLE IF NOT EXISTS races with itself.
    await ctx.conn.execute("SELECT pg_advisory_xact_lock(424242)")
    await ctx.conn.execute(EFFECTS_SQL)
    await ctx.conn.execute(
        "INSERT INTO job_effects (job, run_id, slot) VALUES ($1, $2, $3)",
        ctx.job.name,
        ctx.run_id,
        ctx.slot,
    )


class Sleep(BaseModel):
    seconds: float = Field(default=0.0, ge=0, le=30)


@job("fast")
async def fast(ctx: JobContext) -> int:
    """Record one effect and return at once."""
    await record(ctx)
    return 1


@job("slow", params=Sleep, timeout=20)
async def slow(ctx: JobContext) -> dict[str, float]:
    """Record one effect, then hold the lock for `seconds`."""
    await record(ctx)
    await asyncio.sleep(ctx.params.seconds)
    return {"slept": ctx.params.seconds}


@job("slow-sql", params=Sleep, timeout=20)
async def slow_sql(ctx: JobContext) -> int:
    """Like slow, but the wait is a statement running in the database."""
    await record(ctx)
    await ctx.conn.execute("SELECT pg_sleep($1)", ctx.params.seconds)
    return 1


@job("minutely", schedule="* * * * *", early_tolerance=2.0)
async def minutely(ctx: JobContext) -> int:
    await record(ctx)
    return 1


@job("late-minutely", schedule="* * * * *", max_lateness=0.001, early_tolerance=0.0)
async def late_minutely(ctx: JobContext) -> int:
    await record(ctx)
    return 1


@job("yearly", schedule="0 0 1 1 *")
async def yearly(ctx: JobContext) -> int:
    await record(ctx)
    return 1


@job("fails")
async def fails(ctx: JobContext) -> int:
    """Write, then raise: nothing of it may persist."""
    await record(ctx)
    raise RuntimeError("boom")


@job("sql-fails")
async def sql_fails(ctx: JobContext) -> int:
    """Write, then run a failing statement: the transaction aborts."""
    await record(ctx)
    await ctx.conn.execute("SELECT 1/0")
    return 1


@job("times-out", params=Sleep, timeout=0.5)
async def times_out(ctx: JobContext) -> int:
    """Write, then sleep past the 0.5 s timeout."""
    await record(ctx)
    await asyncio.sleep(ctx.params.seconds or 10)
    return 1


@job("blocks-loop", params=Sleep, timeout=0.5)
async def blocks_loop(ctx: JobContext) -> int:
    """Write, then block the event loop: only the database's timeouts can free the lock."""
    await record(ctx)
    time.sleep(ctx.params.seconds or 3)  # noqa: ASYNC251 - blocking the loop is the point
    return 1


@job("bad-result")
async def bad_result(ctx: JobContext) -> object:
    await record(ctx)
    return object()


@job("nan-result")
async def nan_result(ctx: JobContext) -> float:
    """JSON to Python, but not to jsonb: the runner must refuse it before the commit."""
    await record(ctx)
    return float("nan")


@job("cancels-itself")
async def cancels_itself(ctx: JobContext) -> int:
    """Ends its task cancelled, as when a library cancels what the job awaits."""
    await record(ctx)
    raise asyncio.CancelledError


@job("leaves-session-state")
async def leaves_session_state(ctx: JobContext) -> int:
    """Session state a careless job leaves behind: a plain SET (search_path would break the
    ledger's own statements), a session advisory lock, a LISTEN, a cursor WITH HOLD."""
    await record(ctx)
    await ctx.conn.execute("SET work_mem = '77MB'")
    await ctx.conn.execute("SET search_path = nowhere")
    await ctx.conn.execute("SELECT pg_advisory_lock(777)")
    await ctx.conn.execute("LISTEN careless")
    await ctx.conn.execute("DECLARE careless CURSOR WITH HOLD FOR SELECT 1")
    pid: int = await ctx.conn.fetchval("SELECT pg_backend_pid()")
    return pid


@job("session-state")
async def session_state(ctx: JobContext) -> dict[str, Any]:
    """What a later run finds on its connection."""
    row = await ctx.conn.fetchrow(
        """SELECT pg_backend_pid() AS pid, current_setting('work_mem') AS work_mem,
                  current_setting('search_path') AS search_path,
                  ARRAY(SELECT pg_listening_channels()) AS channels,
                  ARRAY(SELECT name FROM pg_cursors WHERE name = 'careless') AS cursors"""
    )
    assert row is not None
    return dict(row)


class Buggy(BaseModel):
    """A params model with a bug: pydantic passes a RuntimeError through, unlike a ValueError."""

    @model_validator(mode="before")
    @classmethod
    def _bug(cls, data: Any) -> Any:
        raise RuntimeError("a bug in the params model")


@job("buggy-params", params=Buggy)
async def buggy_params(ctx: JobContext) -> int:
    """Never runs: validating its params raises."""
    await record(ctx)
    return 1


@job("held", params=Sleep, timeout=2)
async def held(ctx: JobContext) -> int:
    """Write, then hold the lock idle in transaction (the database waits for this client)."""
    await record(ctx)
    await asyncio.sleep(ctx.params.seconds)
    return 1


@job("hourly-grace", schedule="0 * * * *", grace=600)
async def hourly_grace(ctx: JobContext) -> int:
    """Hourly, overdue ten minutes after a tick without a succeeded run (ops tests)."""
    await record(ctx)
    return 1


@job("berlin-0230", schedule="30 2 * * *", tz="Europe/Berlin", early_tolerance=30)
async def berlin(ctx: JobContext) -> int:
    """A fixed-hour job in a zone with daylight saving (slot tests)."""
    await record(ctx)
    return 1


class Note(BaseModel):
    text: str = Field(default="", max_length=200)


@job("note", params=Note)
async def note(ctx: JobContext) -> dict[str, str]:
    """Record one effect and return its text: a string param, stored as jsonb in the ledger
    (PostgreSQL refuses a NUL there, which a JSON string can carry as \\u0000)."""
    await record(ctx)
    return {"text": ctx.params.text}


# --- keyed jobs (tests/test_keyed.py) ------------------------------------------------------


class Customer(BaseModel):
    customer_id: int = Field(ge=1)
    seconds: float = Field(default=0.0, ge=0, le=30)


@job("keyed", key="customer_id", params=Customer, timeout=20)
async def keyed(ctx: JobContext) -> dict[str, Any]:
    """One run at a time per customer: hold the key's lock, then record one effect (after
    the wait: `record` serialises its writers until they commit, and keys must overlap)."""
    await asyncio.sleep(ctx.params.seconds)
    await record(ctx)
    return {"key": ctx.key}


@job("keyed-yearly", schedule="0 0 1 1 *", key="customer_id", params=Customer, timeout=20)
async def keyed_yearly(ctx: JobContext) -> dict[str, Any]:
    """Once per (customer, slot): a trigger carries the key it runs for (waits first, as
    `keyed` does)."""
    await asyncio.sleep(ctx.params.seconds)
    await record(ctx)
    return {"key": ctx.key}


class Account(BaseModel):
    account: str = Field(min_length=1, max_length=200)


@job("keyed-fast", key="account", params=Account)
async def keyed_fast(ctx: JobContext) -> str | None:
    """A str key, returned at once (the fuzzer triggers it)."""
    await record(ctx)
    return ctx.key
