"""A minute of the randomized soak (tests/support/soak.py): faults every few seconds under
triggers of every job shape, then every check of the history; `bench/soak.py` runs it for ten
minutes or more with any seed."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.cluster import Cluster, Instance
from tests.support.postgres import ScratchPostgres
from tests.support.provider import Provider
from tests.support.soak import soak, soak_env

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
