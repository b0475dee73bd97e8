"""What the outbox's tests share: a sender on a pool of its own, running it in the
background, sender processes (`tests.outbox_worker`), polling, the queue's counts. The
`provider` and `outbox_settings` fixtures are in tests/conftest.py."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg

from cronlock.db import pool as appdb
from cronlock.delivery import sender as delivery
from cronlock.delivery.mailer import HttpMailer
from cronlock.settings import Settings
from tests.support.provider import Provider

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "re_test_key"
MakeSettings = Callable[..., Settings]


async def until(
    check: Callable[[], Any], within: float, what: str, *, every: float = 0.02
) -> float:
    """Poll `check` (sync or async) without blocking the loop; returns the seconds it took."""
    start = time.monotonic()
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return time.monotonic() - start
        if time.monotonic() - start > within:
            raise AssertionError(f"timed out after {within} s waiting for {what}")
        await asyncio.sleep(every)


async def counts(conn: asyncpg.Connection) -> Counter[str]:
    rows = await conn.fetch(
        "SELECT status, count(*) AS n FROM cronlock.email_outbox GROUP BY status"
    )
    return Counter({r["status"]: r["n"] for r in rows})


@asynccontextmanager
async def sender(settings: Settings, name: str = "s1") -> AsyncIterator[delivery.Sender]:
    """A Sender on a pool of its own, with the HTTP backend."""
    pool = await appdb.create_pool(settings)
    mailer = HttpMailer(
        settings.email_api_url,
        API_KEY,
        timeout=settings.outbox_send_timeout,
        max_connections=settings.outbox_concurrency,
    )
    try:
        yield delivery.Sender(pool, settings, mailer, name, rng=random.Random(7))
    finally:
        await mailer.aclose()
        await pool.close()


@asynccontextmanager
async def running(s: delivery.Sender) -> AsyncIterator[asyncio.Event]:
    """`s.run()` in the background; stopped (gracefully) on exit."""
    stop = asyncio.Event()
    task = asyncio.create_task(s.run(stop))
    try:
        yield stop
    finally:
        stop.set()
        await asyncio.wait_for(task, s.settings.outbox_shutdown_timeout + 5)


def worker_env(database_url: str, provider: Provider, **settings: Any) -> dict[str, str]:
    """The environment of a `tests.outbox_worker` process (settings from env only)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "EMAIL_"))}
    env.update(
        {
            "DATABASE_URL": database_url,
            "EMAIL_BACKEND": "http",
            "EMAIL_API_URL": provider.url,
            "EMAIL_API_KEY": API_KEY,
            "OUTBOX_RATE_LIMIT": "0",
            "OUTBOX_POLL_INTERVAL": "0.1",
            "LOG_LEVEL": "WARNING",
            "PYTHONPATH": str(ROOT),
        }
    )
    env.update({k.upper(): str(v) for k, v in settings.items()})
    return env


def start_worker(env: dict[str, str], log: Path, *args: str) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.outbox_worker", *args],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def stop_workers(workers: list[subprocess.Popen[bytes]], log: Path) -> list[int]:
    for w in workers:
        if w.poll() is None:
            w.send_signal(signal.SIGTERM)
    codes = []
    for w in workers:
        try:
            codes.append(w.wait(15))
        except subprocess.TimeoutExpired:
            w.kill()
            codes.append(w.wait())
    if any(code not in (0, -signal.SIGKILL) for code in codes):
        print(log.read_text()[-4000:])
    return codes
