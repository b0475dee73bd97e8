"""`python -m cronlock outbox drain`: a dedicated sender process."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import asyncpg
import pytest

from tests.support import TEST_SECRET


@pytest.mark.slow
async def test_drain_once_sends_everything_due_and_exits(
    database_url: str, db: asyncpg.Connection
) -> None:
    await db.execute(
        """INSERT INTO cronlock.email_outbox (job, slot, user_id, sender, recipient, subject, body)
           SELECT 'daily-digest', now(), g, 'a@example.com', 'u' || g || '@example.com', 's', 'b'
           FROM generate_series(1, 25) g"""
    )
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "CRON_SECRET": TEST_SECRET,
        "EMAIL_BACKEND": "log",
        "OUTBOX_RATE_LIMIT": "0",
        "LOG_FORMAT": "json",
    }
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "cronlock", "outbox", "drain", "--once"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    sent = await db.fetchval("SELECT count(*) FROM cronlock.email_outbox WHERE status = 'sent'")
    assert sent == 25
    assert TEST_SECRET not in done.stdout + done.stderr
