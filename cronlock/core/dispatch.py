"""The dispatcher of dynamic schedules (cronlock/core/schedules.py says the rules): on every
instance running the built-in scheduler, it claims due rows of this instance's dynamic jobs and
runs each through the runner's ordinary trigger path. Its own module because it drives the
runner, which itself reads and advances schedule rows (schedules.py) inside a run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from cronlock.core.jobs import Job
from cronlock.core.outcome import Outcome
from cronlock.core.runner import Runner
from cronlock.core.schedule import ScheduleError
from cronlock.core.schedules import (
    ADVANCE_AFTER,
    CLAIM_SQL,
    Planned,
    advance,
    compact_counts,
    plan,
)
from cronlock.errors import DATABASE_ERRORS, DatabaseUnavailable, describe
from cronlock.sql import qualify

log = logging.getLogger("cronlock.schedules")

# Seconds between two foldings of the schedules' kept counts by one dispatcher (migration 0020).
COMPACT_INTERVAL = 60.0


class Dispatcher:
    """Claims due rows of this instance's dynamic jobs and runs them, at most
    SCHEDULER_CONCURRENCY at once; rows beyond that wait in the table, unclaimed."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.settings = runner.settings
        self.jobs = {name: j for name, j in runner.registry.items() if j.dynamic}
        self.running: set[asyncio.Task[None]] = set()
        self.freed = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        if not self.jobs:
            return
        compacted = time.monotonic()
        try:
            while not stop.is_set():
                wait = self.settings.scheduler_poll_interval
                try:
                    if self.runner.db.migrated and time.monotonic() - compacted > COMPACT_INTERVAL:
                        compacted = time.monotonic()
                        await self._compact()
                    if self.runner.db.migrated:
                        free = self.settings.scheduler_concurrency - len(self.running)
                        if free > 0 and await self._claim(free) == free:
                            wait = 0.0  # more may be due: claim again once a run ends
                    else:
                        wait = 0.5
                except DATABASE_ERRORS as exc:
                    log.warning("dispatcher: could not claim due schedules: %s", describe(exc))
                    wait = 1.0
                except DatabaseUnavailable as exc:
                    log.warning("dispatcher: could not claim due schedules: %s", exc.reason)
                    wait = 1.0
                await self._pause(stop, wait)
        finally:
            if self.running:
                await asyncio.wait(
                    set(self.running), timeout=self.settings.graceful_shutdown_timeout
                )

    async def _pause(self, stop: asyncio.Event, wait: float) -> None:
        """Until the poll interval passed, or (when the last claim filled every place) until a
        run ends and frees one."""
        self.freed.clear()
        if wait == 0.0:
            if len(self.running) < self.settings.scheduler_concurrency:
                return
            wait = self.settings.scheduler_poll_interval
        waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self.freed.wait())]
        try:
            await asyncio.wait(waiters, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()

    async def _claim(self, limit: int) -> int:
        async with self.runner.db.connection() as conn:
            rows = await conn.fetch(
                qualify(CLAIM_SQL, self.settings.db_schema),
                list(self.jobs),
                limit,
                self.settings.scheduler_claim_timeout,
                self.settings.instance_name,
            )
        for r in rows:
            task = asyncio.create_task(
                self._dispatch(dict(r.items())), name=f"dispatch:{r['job']}:{r['key']}"
            )
            self.running.add(task)
            task.add_done_callback(self._done)
        return len(rows)

    async def _compact(self) -> None:
        async with self.runner.db.connection() as conn:
            await compact_counts(conn, self.settings.db_schema)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.running.discard(task)
        self.freed.set()

    async def _dispatch(self, r: Mapping[str, Any]) -> None:
        job = self.jobs[r["job"]]
        try:
            planned = plan(job, r)
        except ScheduleError as exc:  # a row written by hand, or a zone tzdata dropped
            log.warning("dispatcher: %s %s: %s", job.name, r["key"], exc)
            return
        try:
            await self._run(job, r, planned)
        except Exception:
            log.exception("dispatcher: %s %s failed", job.name, r["key"])

    async def _run(self, job: Job, r: Mapping[str, Any], planned: Planned) -> None:
        assert job.params is not None
        try:
            params = job.params.model_validate(json.loads(r["params"]))
        except ValidationError as exc:
            # Valid when set; the model changed since. Its slot is skipped, the row advanced.
            log.warning("dispatcher: %s %s: params refused: %s", job.name, r["key"], exc)
            await self._advance(planned)
            return
        metrics = self.runner.metrics
        if metrics is not None:
            metrics.observe_start_lateness(job.name, (r["db_now"] - planned.start_at))
        outcome: Outcome | None = None
        try:
            outcome = await self.runner.trigger(
                job, params=params, source="scheduler", first_attempt=True, planned=planned
            )
        except DatabaseUnavailable as exc:
            log.warning("dispatcher: %s %s not run: %s", job.name, r["key"], exc.reason)
        # Another run of this key holding its lock ("already running": a manual run, a long
        # previous slot) leaves the row claimed: it comes back once the claim times out.
        if outcome is not None and outcome.kind == "skipped" and outcome.reason in ADVANCE_AFTER:
            await self._advance(planned)

    async def _advance(self, planned: Planned) -> None:
        with contextlib.suppress(*DATABASE_ERRORS, DatabaseUnavailable):
            async with self.runner.db.connection() as conn:
                await advance(conn, self.settings.db_schema, planned)
