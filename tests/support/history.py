"""Load that keeps going through faults, the history it leaves, and the checks that read it.

Clients fire triggers and record every answer (`Answer`); slot workers keep triggering a
slot until it is settled (`200 processed` or `already done`), retrying through 503s and
dropped connections as a scheduler's retries would. The checks read the surviving database
(ledger, effects and their writers' times, pg_locks, sessions) and the provider's counts.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import asyncpg
import httpx

from tests.util import AUTH


@dataclass
class Answer:
    job: str
    slot: str | None
    status: int  # 0: no HTTP answer (connection refused or dropped, timed out)
    body: dict[str, Any]
    sent: float  # time.monotonic()
    answered: float

    @property
    def processed(self) -> bool:
        return self.status == 200 and "run_id" in self.body and not self.body.get("skipped")

    @property
    def settled(self) -> bool:
        """The slot needs no further trigger: it ran, or had run already."""
        return self.processed or (self.status == 200 and self.body.get("reason") == "already done")


@dataclass
class History:
    answers: list[Answer] = field(default_factory=list)

    def by_status(self) -> Counter[int]:
        return Counter(a.status for a in self.answers)

    def processed(self) -> list[Answer]:
        return [a for a in self.answers if a.processed]


async def fire(
    client: httpx.AsyncClient,
    base: str,
    job: str,
    history: History,
    *,
    slot: str | None = None,
    params: dict[str, Any] | None = None,
    wait: float = 15.0,
) -> Answer:
    sent = time.monotonic()
    query = {"slot": slot} if slot else None
    try:
        response = await client.post(
            f"{base}/cron/{job}", headers=AUTH, params=query, json=params, timeout=wait
        )
        status = response.status_code
        try:
            body = response.json()
        except ValueError:
            body = {"text": response.text[:200]}
    except httpx.HTTPError as exc:
        status, body = 0, {"error": type(exc).__name__}
    answer = Answer(
        job, slot, status, body if isinstance(body, dict) else {}, sent, time.monotonic()
    )
    history.answers.append(answer)
    return answer


async def settle_slots(
    client: httpx.AsyncClient,
    base: str,
    job: str,
    slots: Iterable[str],
    history: History,
    *,
    workers: int,
    deadline: float,
    pause: float = 0.1,
) -> list[str]:
    """Trigger each slot until it is settled; returns the slots still unsettled at the
    deadline (time.monotonic())."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for slot in slots:
        queue.put_nowait(slot)
    unsettled: list[str] = []

    async def work() -> None:
        while not queue.empty():
            slot = queue.get_nowait()
            while True:
                answer = await fire(client, base, job, history, slot=slot)
                if answer.settled:
                    break
                if time.monotonic() > deadline:
                    unsettled.append(slot)
                    break
                await asyncio.sleep(pause)

    await asyncio.gather(*(work() for _ in range(workers)))
    return unsettled


def minute_slots(now: datetime, count: int, offset_minutes: int = 0) -> list[str]:
    """`count` past minute slots (ISO), oldest first, ending `offset_minutes` before `now`'s
    minute: backfills, each once per slot."""
    from datetime import timedelta

    top = now.replace(second=0, microsecond=0) - timedelta(minutes=offset_minutes + 1)
    return [(top - timedelta(minutes=i)).isoformat() for i in reversed(range(count))]


# --- checks -------------------------------------------------------------------------------


async def violations(
    db: asyncpg.Connection, history: History, *, lost_allowed: bool = False
) -> list[str]:
    """What the history and the surviving database say went wrong (empty: nothing)."""
    found: list[str] = []
    has_effects = await db.fetchval("SELECT to_regclass('job_effects') IS NOT NULL")
    effects = await db.fetch("SELECT job, run_id, slot, at FROM job_effects") if has_effects else []
    runs = await db.fetch(
        "SELECT id, job, key, slot, status, trigger, started_at, finished_at FROM cronlock.runs"
    )
    succeeded = {r["id"] for r in runs if r["status"] == "succeeded"}
    # Each test job records one effect per run, in the run's transaction.
    per_run = Counter(e["run_id"] for e in effects)
    found += [f"run {rid} has {n} effects" for rid, n in per_run.items() if n != 1]
    found += [
        f"effect of run {rid} without a succeeded run" for rid in per_run if rid not in succeeded
    ]
    per_slot = Counter((e["job"], e["slot"]) for e in effects if e["slot"] is not None)
    found += [f"{job} slot {slot} has {n} effects" for (job, slot), n in per_slot.items() if n > 1]
    once = Counter(
        (r["job"], r["key"], r["slot"])
        for r in runs
        if r["status"] == "succeeded" and r["slot"] is not None and r["trigger"] != "manual"
    )
    found += [f"{k} has {n} succeeded runs" for k, n in once.items() if n > 1]
    if not lost_allowed:
        for answer in history.processed():
            rid = answer.body["run_id"]
            if rid not in succeeded:
                found.append(
                    f"{answer.job} run {rid} answered 200 is not in the ledger as succeeded"
                )
            elif has_effects and answer.job in {e["job"] for e in effects} and rid not in per_run:
                found.append(f"{answer.job} run {rid} answered 200 has no effect")
    return found


async def leftovers(db: asyncpg.Connection) -> list[str]:
    """What a settled system must not hold: advisory locks, `running` rows, sessions idle in
    a transaction."""
    found: list[str] = []
    locks = await db.fetchval(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid <> pg_backend_pid()"
    )
    if locks:
        found.append(f"{locks} advisory locks held")
    running = await db.fetchval("SELECT count(*) FROM cronlock.runs WHERE status = 'running'")
    if running:
        found.append(f"{running} runs left 'running'")
    idle = await db.fetchval(
        """SELECT count(*) FROM pg_stat_activity
           WHERE state LIKE 'idle in transaction%' AND application_name LIKE 'cronlock:%'"""
    )
    if idle:
        found.append(f"{idle} cronlock sessions idle in a transaction")
    return found
