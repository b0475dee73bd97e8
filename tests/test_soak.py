"""A minute of the randomized soak (tests/support/soak.py): faults every few seconds under
triggers of every job shape, then every check of the history; `bench/soak.py` runs it for ten
minutes or more with any seed."""

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
from tests.support.soak import overlaps, soak, soak_env

SEED = 16
SECONDS = 45.0


@pytest.fixture(scope="module")
def postgres() -> Iterator[ScratchPostgres]:
    """A PostgreSQL of the soak's own: it is restarted and crashed on purpose."""
    root = Path(tempfile.mkdtemp(prefix="cronlock-soak-"))
    server = ScratchPostgres(root / "pg", settings={"max_connections": "300"})
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
    print("\n".join(report.lines()))
    assert sum(report.faults.values()) >= 8, report.faults
    assert report.runs["succeeded"] > 50, report.runs
    assert report.violations == [], "\n".join(report.lines())


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
