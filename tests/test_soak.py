"""A minute of the randomized soak (tests/support/soak.py): faults every few seconds under
triggers of every job shape and dynamic schedules changed all along, then every check of the
history; `bench/soak.py` runs it for ten minutes or more with any seed."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.support.cluster import Cluster, Instance
from tests.support.postgres import ScratchPostgres
from tests.support.provider import Provider
from tests.support.soak import (
    SOAK_POSTGRES_SETTINGS,
    dynamic_violations,
    overlaps,
    soak,
    soak_env,
)

SEED = 16
SECONDS = 45.0


@pytest.fixture(scope="module")
def postgres() -> Iterator[ScratchPostgres]:
    """A PostgreSQL of the soak's own: it is restarted and crashed on purpose."""
    root = Path(tempfile.mkdtemp(prefix="cronlock-soak-"))
    server = ScratchPostgres(root / "pg", settings=SOAK_POSTGRES_SETTINGS)
    server.start()
    try:
        yield server
    finally:
        server.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)


async def test_randomized_soak(
    postgres: ScratchPostgres,
    make_cluster: Callable[..., Cluster],
    provider: Provider,
    report_logs: Callable[[list[Instance]], None],
) -> None:
    # The cluster's set-up runs its own event loop (its migrations): not on this one.
    cluster = await asyncio.to_thread(make_cluster, postgres.dsn(), env=soak_env(provider))
    report_logs(cluster.instances)
    report = await soak(cluster, postgres, provider, seed=SEED, seconds=SECONDS)
    # The whole report with every assertion: a failure names each violation in full.
    detail = "\n".join(report.lines())
    print(detail)
    assert report.violations == [], detail
    assert sum(report.faults.values()) >= 8, detail
    assert report.runs["succeeded"] > 50, detail
    # Dynamic schedules ran amid the faults and their changes (153 runs, 211 changes once).
    assert report.dynamic["succeeded"] > 20, detail
    assert report.changes[200] > 50, detail


def test_the_checker_sees_two_holders_at_once() -> None:
    """The overlap check (a soak with no violation must be able to report one)."""
    t0 = datetime(2026, 1, 1, tzinfo=UTC)

    def effect(run_id: int, key: str | None, start: float, end: float) -> dict[str, Any]:
        return {
            "job": "soak-keyed",
            "key": key,
            "run_id": run_id,
            "instance": f"i{run_id}",
            "started": t0 + timedelta(seconds=start),
            "ended": t0 + timedelta(seconds=end),
        }

    apart = [effect(1, "a", 0, 1), effect(2, "a", 1.5, 2), effect(3, "b", 0.5, 1.8)]
    assert overlaps(apart) == []
    assert overlaps([*apart, effect(4, "a", 1.9, 3)]) == [
        "soak-keyed/a: runs 2 (i2) and 4 (i4) overlap"
    ]


def test_the_checker_sees_runs_the_schedules_did_not_hold() -> None:
    """The dynamic-schedule checks (a soak with no violation must be able to report each): a
    slot attempted twice, a run after its row's removal, a run of the replaced schedule's tick,
    a run while paused, a slot from before the version was set; a run that began after its
    version's successor was committed, by its commit time, but before that commit was seen (its
    backend descheduled in between) is no violation."""
    t0 = datetime(2026, 1, 1, tzinfo=UTC)

    def at(seconds: float) -> datetime:
        return t0 + timedelta(seconds=seconds)

    def version(
        n: int, op: str, committed: float, seen: float | None = None, **row: Any
    ) -> dict[str, Any]:
        base = {"schedule": None, "every": 2, "tz": "UTC", "paused": False}
        return {
            "id": n,
            "xid": n,
            "version": n,
            "op": op,
            "key": "t0",
            "committed": at(committed),
            "seen": at(committed + 0.02 if seen is None else seen),
            "tx_now": at(committed - 0.01),
            **base,
            **row,
        }

    log = [
        version(1, "INSERT", 0.5),  # every 2 s: ticks 2, 4, 6 ...
        # Its commit time is 10.5, but it was visible only by 10.9: runs beginning until then
        # may still read version 1 (PostgreSQL takes a commit's time before the commit is
        # visible; a backend descheduled in between makes that gap as long as it waits).
        version(2, "UPDATE", 10.5, seen=10.9, every=3, paused=True),
        version(3, "UPDATE", 20.5, every=3),  # ticks 21, 24 ...
        version(4, "DELETE", 30.5),  # seen at 30.52
    ]
    n = iter(range(100, 200))

    def run(slot: float, began: float, trigger: str = "scheduled") -> dict[str, Any]:
        return {
            "id": next(n),
            "key": "t0",
            "slot": at(slot),
            "status": "succeeded",
            "trigger": trigger,
            "instance": "i1",
            "started_at": at(began),
            "finished_at": at(began + 0.2),
        }

    fine = [run(2, 2.1), run(4, 4.1), run(10, 10.8), run(21, 21.2), run(30, 30.4)]
    assert dynamic_violations(log, fine, at(60)) == []
    bad = [
        run(4, 4.5),  # attempted twice
        run(32, 32.1),  # after the removal
        run(12, 12.1),  # paused
        run(22, 22.1),  # a tick of no version (every 2 s was replaced at 10.5)
        run(18, 21.0),  # every 3 s's tick, but before that version was set
        run(6, 6.1, trigger="backfill"),  # not the dispatcher's
        run(27, 30.53),  # a tick of every 3 s, begun 10 ms after its removal was seen
    ]
    found = dynamic_violations(log, fine + bad, at(60))
    assert len(found) == 7, found
    assert any("attempted 2 times" in v for v in found), found
    assert any("trigger backfill" in v for v in found), found
    # A run held by no version names the row's versions around it, for whoever reads it.
    paused = next(v for v in found if "slot 2026-01-01T00:00:12" in v)
    assert "v2 update every 3s paused: set 2026-01-01T00:00:10.490+00:00" in paused, paused
