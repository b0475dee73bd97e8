"""Cancel that works (cronlock/core/cancel.py): the database-side fallback for a holder that does
not react, and its check that the pid still holds the job's lock (behind PgBouncer a backend pid
may serve someone else by then). The holder's own reaction is in tests/test_cli.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import asyncpg
import pytest

from cronlock.core.cancel import signal_holder
from tests.support.cluster import Instance
from tests.test_cli import cli_env, run_cli  # noqa: F401 - cli_env is a fixture
from tests.util import effects, job_key, lock_held, post, wait_for


async def test_fallback_signals_a_pid_only_while_it_holds_the_lock(
    db: asyncpg.Connection, database_url: str
) -> None:
    other = await asyncpg.connect(database_url)
    try:
        pid = await other.fetchval("SELECT pg_backend_pid()")
        key = job_key("slow")
        # The pid holds nothing (a pooled backend now serving another client): spared.
        assert await signal_holder(db, pid, key, terminate=True) is False
        assert await other.fetchval("SELECT 1") == 1
        await other.execute("SELECT pg_advisory_lock($1)", key.key)
        assert await signal_holder(db, pid, key, terminate=True) is True
        await wait_for(lambda: _gone(db, pid), 5, "the holder's backend to end")
    finally:
        other.terminate()


async def _gone(db: asyncpg.Connection, pid: int) -> bool:
    return not await db.fetchval(
        "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)", pid
    )


@pytest.mark.usefixtures("cli_env")
async def test_a_frozen_holder_gets_the_fallback(
    start_instance: Callable[..., Instance],
    client: Any,
    db: asyncpg.Connection,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGSTOP: the holder cannot see its row. After CANCEL_GRACE the database ends its
    backend (idle in transaction: terminate), the lock goes, nothing of the job persisted."""
    i1 = start_instance("i1")
    pending = asyncio.create_task(post(client, i1.url + "/cron/slow", json={"seconds": 8}))
    await wait_for(lambda: lock_held(db, "slow"), 10, "slow to take its lock")
    key = job_key("slow")

    async def in_its_sleep() -> bool:  # past its bookkeeping: no statement of it running
        state = await db.fetchval(
            "SELECT a.state FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
            " WHERE l.locktype = 'advisory' AND l.granted AND l.classid = $1 AND l.objid = $2",
            key.classid,
            key.objid,
        )
        return bool(state == "idle in transaction")

    await wait_for(in_its_sleep, 10, "slow to wait with its transaction open")
    i1.freeze()
    try:
        monkeypatch.setenv("CANCEL_GRACE", "1")
        result = await run_cli(capsys, "cancel", "slow", "--wait", "6", "--json")
        assert result.code == 0, result.err
        assert result.json()["signal"] == "terminate"
        assert result.json()["released"] is True
        assert not await lock_held(db, "slow")
    finally:
        i1.thaw()
    answer = await pending
    assert answer.status_code == 500
    assert await effects(db, "slow") == 0
