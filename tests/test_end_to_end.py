"""The whole path: triggers over three instances, the digest, the outbox, the provider."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import asyncpg
import httpx

from tests.support.provider import Provider
from tests.util import post, wait_for

Starter = Callable[..., Any]
USERS = 300
ENABLED = 270  # every tenth user has the digest switched off


async def test_each_user_gets_exactly_one_email_per_slot(
    start_instances: Starter, provider: Provider, db: asyncpg.Connection
) -> None:
    await db.execute(
        """INSERT INTO cronlock_demo.users (email, digest_enabled)
           SELECT 'u' || g || '@example.com', g % 10 <> 0 FROM generate_series(1, $1) g""",
        USERS,
    )
    env = {
        "CRON_JOBS": "cronlock.demo.digest",
        "OUTBOX_ENABLED": "true",
        "EMAIL_BACKEND": "http",
        "EMAIL_API_URL": provider.url,
        "EMAIL_API_KEY": "re_test_key",
        "OUTBOX_RATE_LIMIT": "0",
        "OUTBOX_POLL_INTERVAL": "0.2",
        "OUTBOX_LEASE": "5",
    }
    instances = start_instances(["e0", "e1", "e2"], env)
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(3):  # triggered again and again, on every instance
            answers = await asyncio.gather(
                *(post(client, i.url + "/cron/daily-digest") for i in instances for _ in range(2))
            )
            assert all(a.status_code == 200 for a in answers), [a.text for a in answers]

        async def all_sent() -> bool:
            pending = await db.fetchval(
                "SELECT count(*) FROM cronlock.email_outbox WHERE status <> 'sent'"
            )
            return len(provider.accepted_keys()) >= ENABLED and pending == 0

        await wait_for(all_sent, 60, "every digest email to be delivered")
    delivered = provider.delivered()
    assert len(delivered) == ENABLED
    assert set(delivered.values()) == {1}
    recipients = Counter(json.loads(r.body)["to"] for r in provider.requests if r.delivered)
    assert len(recipients) == ENABLED
    assert set(recipients.values()) == {1}
    assert all(r.headers["authorization"] == "Bearer re_test_key" for r in provider.requests)
    runs = await db.fetch("SELECT status, result FROM cronlock.runs WHERE job = 'daily-digest'")
    assert [r["status"] for r in runs] == ["succeeded"]
