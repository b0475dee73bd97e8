"""The built-in scheduler (cronlock/core/scheduler.py) in-process: ticks on the database's clock,
one run per slot across instances, through the runner (source `scheduler`). The proof with real
processes, kill -9 and an outage is tests/test_on_its_own.py."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from cronlock.core.jobs import load
from cronlock.core.metrics import Metrics
from cronlock.core.runner import Runner
from cronlock.core.scheduler import Clock, jitter_bound
from cronlock.db.pool import Database
from cronlock.settings import Settings
from tests.support.asgi import StartApp
from tests.util import own_runner, wait_for


async def succeeded_slots(db: asyncpg.Connection, job: str) -> list[tuple[datetime, str]]:
    rows = await db.fetch(
        "SELECT slot, source FROM cronlock.runs WHERE job = $1 AND status = 'succeeded'"
        " ORDER BY slot",
        job,
    )
    return [(r["slot"], r["source"]) for r in rows]


async def test_two_instances_one_run_per_slot_no_gap(
    start_app: StartApp, db: asyncpg.Connection
) -> None:
    """Every=1 job, two schedulers, 3 ticks or more: one succeeded run per slot, consecutive
    slots."""
    env = {"cron_jobs": "tests.own_jobs", "scheduler_enabled": True, "scheduler_jitter": 0.1}
    await start_app("a", **env)
    await start_app("b", **env)

    async def by_the_scheduler() -> list[tuple[datetime, str]]:
        found = await succeeded_slots(db, "tick")
        # At start-up the catch-up loop may run the due slot (a job that never ran is overdue).
        first = next((i for i, (_, source) in enumerate(found) if source == "scheduler"), None)
        return [] if first is None else found[first:]

    async def three_ticks() -> bool:
        return len(await by_the_scheduler()) >= 3

    await wait_for(three_ticks, 10, "three ticks of the scheduler")
    await asyncio.sleep(0.5)  # half a tick more: a second run of a slot would show by now
    found = await by_the_scheduler()
    slots = [s for s, _ in found]
    assert len(slots) >= 3, found
    assert len(slots) == len(set(slots))
    assert all(b - a == timedelta(seconds=1) for a, b in itertools.pairwise(slots)), slots
    assert {source for _, source in found} == {"scheduler"}
    others = await db.fetchval(
        "SELECT count(*) FROM cronlock.runs WHERE job = 'tick' AND status <> 'succeeded'"
    )
    assert others == 0


async def test_a_ticker_that_fails_is_logged_and_starts_again(
    start_app: StartApp, db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault inside the `tick` job's ticker (here its first jitter): logged with the job's
    name, and the ticker starts again, so the job goes on being ticked."""
    from cronlock.core import scheduler

    real = scheduler.jitter_bound
    faults: list[datetime] = []

    def faulty(job: Any, slot: datetime, jitter: float) -> float:
        if job.name == "tick" and not faults:
            faults.append(slot)
            raise RuntimeError("a fault of the ticker")
        return real(job, slot, jitter)

    monkeypatch.setattr(scheduler, "jitter_bound", faulty)
    app = await start_app(
        "a", cron_jobs="tests.own_jobs", scheduler_enabled=True, scheduler_jitter=0.1
    )

    async def ticked_twice() -> bool:
        found = await succeeded_slots(db, "tick")
        return sum(1 for _, source in found if source == "scheduler") >= 2

    await wait_for(ticked_twice, 10, "two ticks after the fault")
    assert faults
    assert "the ticker of tick failed; it starts again" in app.log()
    assert "a fault of the ticker" in app.log()


async def test_clock_offset_is_measured_and_corrected(
    make_settings: Callable[..., Settings], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An instance whose clock runs 30 s fast still reads the database's time: ticks are
    computed from it, not from the local clock; the offset is exported as a metric."""
    settings = make_settings(cron_jobs="tests.own_jobs")
    db = Database(settings)
    await db.open()
    try:
        metrics = Metrics(["tick"])
        runner = Runner(settings, load(settings.job_modules), db, metrics=metrics)
        clock = Clock()
        await clock.measure(runner)
        assert clock.round_trip is not None
        assert abs(clock.offset) < 0.5  # same machine
        real = time.time
        monkeypatch.setattr("cronlock.core.scheduler.time.time", lambda: real() + 30.0)
        await clock.measure(runner)
        assert abs(clock.offset + 30.0) < 0.5
        exported = metrics.registry.get_sample_value("cronlock_scheduler_clock_offset_seconds")
        assert exported == clock.offset
        async with db.connection() as conn:
            db_now = await conn.fetchval("SELECT clock_timestamp()")
        assert abs((clock.now() - db_now).total_seconds()) < 0.5
        # The wall clock stepped back by NTP after the measurement: the database's time as
        # seen from here does not move (waits run on the monotonic clock).
        monkeypatch.setattr("cronlock.core.scheduler.time.time", real)
        async with db.connection() as conn:
            db_now = await conn.fetchval("SELECT clock_timestamp()")
        assert abs((clock.now() - db_now).total_seconds()) < 0.5
    finally:
        await db.close()


async def test_a_wait_for_a_tick_follows_the_clock_measured_meanwhile() -> None:
    """A wait of 3 s; 0.3 s in, a measurement finds the database's clock 2 s further on than
    thought (drift over a long wait, a corrected offset): the tick fires after its first step
    (1.5 s), not after the 3 s computed at the start, which would land past the slot; nor
    before the database's clock reads it."""
    clock = Clock()
    start = time.monotonic()
    at = clock.now() + timedelta(seconds=3)

    async def remeasured() -> None:
        await asyncio.sleep(0.3)
        clock.base += 2.0

    shift = asyncio.create_task(remeasured())
    await clock.sleep_until(at)
    elapsed = time.monotonic() - start
    await shift
    assert clock.local_delay(at) <= 0
    assert 0.9 < elapsed < 2.0, elapsed


def test_jitter_is_at_most_a_quarter_of_the_interval(
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings(cron_jobs="tests.own_jobs")
    registry = load(settings.job_modules)
    job = registry["tick"]
    assert job.schedule is not None
    slot = job.schedule.next_tick(datetime.now(UTC))
    assert jitter_bound(job, slot, 5.0) == 0.25
    assert jitter_bound(job, slot, 0.1) == 0.1


# --- missed-slot policies (cronlock/core/catchup.py) ----------------------------------------------


@pytest.mark.parametrize("paused_first", [False, True])
async def test_missed_policies_all_and_latest(
    make_settings: Callable[..., Settings], db: asyncpg.Connection, paused_first: bool
) -> None:
    """Slots after the job's last run nobody triggered (every instance down): `all` runs each,
    oldest first, as backfills; `latest` (what catch_up=True is) only the due slot. A paused
    job is skipped (one look per job and pass, nothing written); after its resume the policy
    decides about the slots the pause skipped."""
    from cronlock.core import catchup, pause

    settings = make_settings(cron_jobs="tests.own_jobs")
    async with own_runner(settings) as runner:
        now: datetime = await db.fetchval("SELECT date_trunc('second', now())")
        last = now - timedelta(seconds=6)
        for job in ("tick", "tick-latest"):
            await db.execute(
                "INSERT INTO cronlock.runs (job, slot, status, trigger, instance, started_at)"
                " VALUES ($1, $2, 'succeeded', 'scheduled', 'gone', $2)",
                job,
                last,
            )
            # First seen at that run: the history `all` looks back over starts there.
            await db.execute("INSERT INTO cronlock.jobs_seen VALUES ($1, $2)", job, last)
        if paused_first:
            for job in ("tick", "tick-latest"):
                await pause.pause(db, "cronlock", job, by="test")
            skipped = await catchup.catch_up(runner)
            assert sorted((o.job, o.kind, o.reason) for o in skipped) == [
                ("tick", "skipped", "paused"),
                ("tick-latest", "skipped", "paused"),
            ]
            assert await db.fetchval("SELECT count(*) FROM cronlock.runs") == 2
            for job in ("tick", "tick-latest"):
                assert await pause.resume(db, "cronlock", job)
        outcomes = await catchup.catch_up(runner)
    ran = {(o.job, o.slot) for o in outcomes if o.kind == "succeeded"}
    tick = sorted(slot for job, slot in ran if job == "tick" and slot is not None)
    latest = [slot for job, slot in ran if job == "tick-latest"]
    # due = the newest tick past its 1 s grace: 1-2 s before now, depending on the moment.
    assert tick[0] == last + timedelta(seconds=1)
    assert all(b - a == timedelta(seconds=1) for a, b in itertools.pairwise(tick))
    assert len(latest) == 1
    assert latest[0] == tick[-1]  # the due slot
    assert [o.slot for o in outcomes if o.job == "tick"] == tick  # oldest first


async def test_missed_all_says_where_its_look_back_stopped(
    make_settings: Callable[..., Settings],
    db: asyncpg.Connection,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`all` looks MAX_ALL_TICKS ticks back from the due slot (3 here): with more slots missed
    than that, it runs the 3 latest and warns that those before the oldest it looked at are not
    run, naming that tick; with fewer missed, no warning."""
    from cronlock.core import catchup

    monkeypatch.setattr(catchup, "MAX_ALL_TICKS", 3)
    settings = make_settings(cron_jobs="tests.own_jobs")
    async with own_runner(settings) as runner:
        now: datetime = await db.fetchval("SELECT date_trunc('second', now())")
        await db.execute(
            "INSERT INTO cronlock.runs (job, slot, status, trigger, instance, started_at)"
            " VALUES ('tick', $1, 'succeeded', 'scheduled', 'gone', $1)",
            now - timedelta(seconds=12),
        )
        await db.execute(
            "INSERT INTO cronlock.jobs_seen VALUES ('tick', $1)", now - timedelta(seconds=12)
        )
        with caplog.at_level("WARNING", logger="cronlock.catchup"):
            outcomes = await catchup.catch_up(runner)
            ran = sorted(o.slot for o in outcomes if o.job == "tick" and o.slot is not None)
            assert len(ran) == 3
            [warning] = [r for r in caplog.records if "looks 3 ticks back" in r.getMessage()]
            assert ran[0].isoformat() in warning.getMessage()
            caplog.clear()
            await catchup.catch_up(runner)  # the 3 latest attempted now: nothing more seen
            assert not [r for r in caplog.records if "ticks back" in r.getMessage()]


def test_missed_policy_declarations() -> None:
    from cronlock.core.jobs import Job, JobContext, job
    from cronlock.errors import JobDefinitionError

    async def noop(ctx: JobContext) -> None:
        return None

    with pytest.raises(JobDefinitionError, match="drop catch_up"):
        job("both-policies", every=5, catch_up=True, missed="all")(noop)
    with pytest.raises(JobDefinitionError, match="choose one of"):
        job("bad-policy", every=5, missed="some")(noop)  # type: ignore[call-overload]
    with pytest.raises(JobDefinitionError, match="needs a schedule"):
        job("no-schedule-policy", missed="all")(noop)
    with pytest.raises(JobDefinitionError, match="could never run a slot"):
        job("late-policy", every=60, missed="latest", max_lateness=120)(noop)  # grace 300
    job("late-enough", every=60, missed="all", max_lateness=300)(noop)
    job("legacy-catch-up-no-schedule", catch_up=True)(noop)  # accepted (and ignored) as before
    # Old configurations: catch_up=True is "latest"; a Job built by hand too.
    assert Job("x", noop, catch_up=True).missed_policy == "latest"
    assert Job("x", noop).missed_policy == "none"
