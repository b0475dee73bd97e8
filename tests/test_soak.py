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
from tests.support.delivery import API_KEY
from tests.support.postgres import ScratchPostgres
from tests.support.provider import Provider
from tests.support.soak import soak

SEED = 16
SECONDS = 45.0


def soak_env(provider: Provider) -> dict[str, str]:
    return {
        "CRON_JOBS": "tests.soak_jobs,app.demo.digest",
        "OUTBOX_ENABLED": "true",
        "EMAIL_BACKEND": "http",
        "EMAIL_API_URL": provider.url,
        "EMAIL_API_KEY": API_KEY,
        "OUTBOX_RATE_LIMIT": "0",
        "OUTBOX_POLL_INTERVAL": "0.2",
        "OUTBOX_LEASE": "3",
        "OUTBOX_SEND_TIMEOUT": "2",
        "OUTBOX_BACKOFF_BASE": "0.2",
        "OUTBOX_BACKOFF_MAX": "2",
        # Faults for a minute must not exhaust a row's attempts.
        "OUTBOX_MAX_ATTEMPTS": "100",
    }


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
