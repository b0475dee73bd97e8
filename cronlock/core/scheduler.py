"""The built-in scheduler (SCHEDULER_ENABLED=true): every instance ticks every scheduled job.

At each slot every instance triggers the job through the runner, the same path as an HTTP
trigger (`Runner.trigger`, source `scheduler`): the probe, the lock and the ledger's unique
index make it one run per slot whatever the number of instances, and while one instance is up
no slot goes untriggered.

Ticks follow the database's clock, the one the slot check uses: the offset between this
instance's clock and the database's is measured (the midpoint of a round trip, best of a few)
and every wait is corrected by it, so an instance whose clock is off by seconds still triggers
right after the slot, not before it (which would land in the previous, done slot) or late.
Waits run on the monotonic clock in steps (`Clock.sleep_until`), so a clock stepped by NTP or
drifting over a day's wait is followed.

Each trigger waits a random jitter after its slot (SCHEDULER_JITTER, at most a quarter of the
job's interval), so the instances do not all reach the database in the same millisecond.

A trigger runs its slot only if nobody attempted it yet, checked under the job's lock (the
runner's `first_attempt`): an instance whose tick comes after another's attempt failed skips
it as "already attempted", so a failed attempt is the retries' business (cronlock/core/retries.py),
not one more attempt per instance. A trigger answered "already running" while nobody has attempted
its slot (another slot's run holds the job's lock: a long previous run, a catch-up, a backfill,
a manual run) tries again until shortly before the next tick. A slot no instance triggered
(all down, a stalled loop) is the missed-slot policy's (cronlock/core/catchup.py).

Keyed jobs are not ticked: a trigger carries its key, which only the job's operator knows
(a dynamic job's keys are its schedules' rows: cronlock/core/schedules.py dispatches them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from datetime import UTC, datetime, timedelta

from cronlock.core import ledger
from cronlock.core.dispatch import Dispatcher
from cronlock.core.jobs import Job
from cronlock.core.outcome import Outcome
from cronlock.core.runner import Runner
from cronlock.errors import DATABASE_ERRORS, DatabaseUnavailable, InvalidTrigger, describe

log = logging.getLogger("cronlock.scheduler")

# Samples per clock measurement; the one with the shortest round trip is kept.
CLOCK_SAMPLES = 3
CLOCK_SQL = "SELECT clock_timestamp()"
# "already running" with the slot not attempted: first retry after this, doubling to the max.
BUSY_RETRY = 0.05
BUSY_RETRY_MAX = 1.0
# The shortest step of a wait for a tick (Clock.sleep_until).
WAIT_STEP = 1.0


class Clock:
    """The database's clock as seen from here: this instance's monotonic clock plus `base`.

    Monotonic, because waits run on it (asyncio's) and no NTP step moves it; its drift is
    corrected at each measurement. `offset` is the database's clock minus this instance's wall
    clock, for the metric and for people."""

    def __init__(self) -> None:
        self.base = time.time() - time.monotonic()  # until measured: the wall clock
        self.offset = 0.0
        self.round_trip: float | None = None  # of the sample kept, seconds

    def now(self) -> datetime:
        return datetime.fromtimestamp(time.monotonic() + self.base, UTC)

    def local_delay(self, at: datetime) -> float:
        """Seconds to wait here until the database's clock reads `at`."""
        return at.timestamp() - (time.monotonic() + self.base)

    async def sleep_until(self, at: datetime) -> None:
        """Until the database's clock reads `at`, as measured when each step ends: steps halve
        the time left (down to WAIT_STEP), so a clock re-measured meanwhile, or one that drifted
        over a long wait, is followed rather than a wait computed once being trusted."""
        while (left := self.local_delay(at)) > 0:  # noqa: ASYNC110 - waits on a clock
            await asyncio.sleep(min(left, max(WAIT_STEP, left / 2)))

    async def measure(self, runner: Runner) -> None:
        best: tuple[float, float, float] | None = None
        async with runner.db.connection() as conn:
            for _ in range(CLOCK_SAMPLES):
                wall, before = time.time(), time.monotonic()
                db_now: datetime = await conn.fetchval(CLOCK_SQL)
                after = time.monotonic()
                mid = (before + after) / 2
                db = db_now.timestamp()
                sample = (after - before, db - mid, db - (wall + (after - before) / 2))
                if best is None or sample[0] < best[0]:
                    best = sample
        assert best is not None
        self.round_trip, self.base, self.offset = best
        if runner.metrics is not None:
            runner.metrics.clock_offset.set(self.offset)


def jitter_bound(job: Job, slot: datetime, jitter: float) -> float:
    """The jitter for `job` after `slot`: the setting, at most a quarter of the interval."""
    assert job.schedule is not None
    gap = (job.schedule.next_tick(slot) - slot).total_seconds()
    return max(0.0, min(jitter, gap / 4))


class Scheduler:
    def __init__(self, runner: Runner, *, rng: random.Random | None = None) -> None:
        self.runner = runner
        self.settings = runner.settings
        self.clock = Clock()
        self.measured = asyncio.Event()  # set once the clock offset is known
        self.rng = rng or random.Random()
        self.fired: set[asyncio.Task[None]] = set()
        self.jobs = [
            j for j in runner.registry.values() if j.schedule is not None and j.key is None
        ]

    async def run(self, stop: asyncio.Event) -> None:
        """Tick until `stop`; waits for the database like everything else."""
        if not self.jobs:
            return
        tickers = [
            asyncio.create_task(self._tick(job, stop), name=f"scheduler:{job.name}")
            for job in self.jobs
        ]
        try:
            while not stop.is_set():
                try:
                    if self.runner.db.migrated:
                        await self.clock.measure(self.runner)
                        self.measured.set()
                        wait = self.settings.scheduler_clock_interval
                    else:
                        wait = 0.5
                except DATABASE_ERRORS as exc:
                    log.warning("could not read the database's clock: %s", describe(exc))
                    wait = 1.0
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), wait)
        finally:
            for task in tickers:
                task.cancel()
            await asyncio.gather(*tickers, return_exceptions=True)
            # Triggers in flight are runs: they end as any run does at shutdown (the runner's
            # own grace period), so only those still deciding are waited for here.
            if self.fired:
                await asyncio.wait(set(self.fired), timeout=self.settings.graceful_shutdown_timeout)

    async def _tick(self, job: Job, stop: asyncio.Event) -> None:
        """Tick `job` until `stop`; a fault of the ticker is logged and it starts again (a
        ticker that ended would leave the job to the missed-slot policy alone, unnoticed)."""
        while not stop.is_set():
            try:
                await self._ticks(job, stop)
            except Exception:
                log.exception("scheduler: the ticker of %s failed; it starts again", job.name)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)

    async def _ticks(self, job: Job, stop: asyncio.Event) -> None:
        assert job.schedule is not None
        await self.measured.wait()
        slot = job.schedule.next_tick(self.clock.now())
        while not stop.is_set():
            delay = self.rng.uniform(0, jitter_bound(job, slot, self.settings.scheduler_jitter))
            await self.clock.sleep_until(slot + timedelta(seconds=delay))
            task = asyncio.create_task(self._fire(job, slot), name=f"tick:{job.name}")
            self.fired.add(task)
            task.add_done_callback(self.fired.discard)
            # The next slot after this one, or after now if this loop fell behind (those in
            # between are the missed-slot policy's).
            slot = job.schedule.next_tick(max(slot, self.clock.now()))

    async def _fire(self, job: Job, slot: datetime) -> None:
        """Trigger `job` for `slot`; again while another slot's run holds its lock."""
        assert job.schedule is not None
        upcoming = job.schedule.next_tick(slot)
        # A trigger within the early tolerance of the next tick would count for that one.
        early = min(job.early_tolerance, (upcoming - slot).total_seconds() / 2)
        until = upcoming - timedelta(seconds=early)
        pause = BUSY_RETRY
        while True:
            outcome: Outcome | None = None
            try:
                outcome = await self.runner.trigger(job, source="scheduler", first_attempt=True)
            except DatabaseUnavailable as exc:
                log.warning("scheduler: %s not triggered: %s", job.name, exc.reason)
            except InvalidTrigger as exc:  # cannot happen without params; never retried
                log.warning("scheduler: %s refused: %s", job.name, exc.args[0])
                return
            except Exception:
                log.exception("scheduler: triggering %s failed", job.name)
                return
            if outcome is not None and not (
                outcome.kind == "skipped" and outcome.reason == "already running"
            ):
                return
            if outcome is not None and await self._attempted(job, slot):
                return  # the holder is running this slot (or a retry of it)
            if self.clock.local_delay(until) < pause:
                return
            await asyncio.sleep(pause)
            pause = min(pause * 2, BUSY_RETRY_MAX)

    async def _attempted(self, job: Job, slot: datetime) -> bool:
        try:
            async with self.runner.db.connection() as conn:
                return await ledger.slot_attempted(conn, self.settings.db_schema, job.name, slot)
        except DATABASE_ERRORS:
            return True  # unknown: leave the slot to the policies rather than loop


async def scheduler_loop(runner: Runner, stop: asyncio.Event) -> None:
    """The built-in scheduler in the background of a service instance: code schedules ticked
    here, dynamic schedules (rows) dispatched by cronlock/core/schedules.py."""
    await asyncio.gather(Scheduler(runner).run(stop), Dispatcher(runner).run(stop))
