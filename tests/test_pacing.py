"""Provider etiquette, end to end: two `python -m cronlock outbox drain` processes in batches of
100 against the provider stand-in enforcing its limit as a strict one-second window and
answering with Resend's rate headers (tests/support/provider.py). Each run: each email accepted
once, at most one request answered 429, and a rate well above what waiting out 429s gives; at
2 and 5 requests/s, and with one sender `kill -9`ed mid-run. The speed goals (0.9x the emails
per second the limit allows, < 1% answered 429) are bench/outbox.py's, on a larger run
(BENCHMARKS.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import asyncpg
import pytest

from tests.support import TEST_SECRET
from tests.support.delivery import ROOT, stop_workers, until, worker_env
from tests.support.provider import Provider
from tests.test_batch import each_once, queue

BATCH = 100


def start_drain(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """`python -m cronlock outbox drain`, as an operator runs it (until SIGTERM)."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "cronlock", "outbox", "drain"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


@pytest.mark.slow  # real sender processes, seconds of sending by design (~40 s for all three)
@pytest.mark.parametrize(
    ("rate", "total", "kill"),
    [(2.0, 2000, False), (2.0, 3000, True), (5.0, 6000, False)],
    ids=["2/s", "2/s-kill-9", "5/s"],
)
async def test_two_senders_keep_the_providers_window(
    db: asyncpg.Connection, database_url: str, tmp_path: Path, rate: float, total: int, kill: bool
) -> None:
    recipients = await queue(db, total)
    lease = 3.0
    with Provider(rate=rate) as provider:
        env = worker_env(
            database_url,
            provider,
            cron_secret=TEST_SECRET,
            email_batch_size=BATCH,
            outbox_batch_size=2 * BATCH,
            outbox_rate_limit=rate,
            outbox_concurrency=4,
            outbox_lease=lease,
            outbox_send_timeout=1.0,
        )
        log = tmp_path / "drain.log"
        workers = [start_drain(env, log) for _ in range(2)]
        try:
            if kill:
                # A third of the way in, with requests of both still going out.
                await until(lambda: provider.received() >= total / BATCH / 3, 30, "a third sent")
                os.kill(workers[0].pid, signal.SIGKILL)
                workers[0].wait(5)
            await until(
                lambda: db.fetchval(
                    "SELECT count(*) = $1 FROM cronlock.email_outbox WHERE status = 'sent'", total
                ),
                total / (rate * BATCH) * 2 + 20,
                "every email to be sent",
                every=0.2,
            )
        finally:
            codes = stop_workers(workers, log)
        requests = provider.batch_requests()
    assert codes == ([-signal.SIGKILL, 0] if kill else [0, 0])
    assert each_once(provider, recipients)
    taken = [r for r in requests if r.status == 200]
    # From the first request to the last, plus the interval the last one opens.
    seconds = max(r.received for r in taken) - min(r.received for r in taken) + 1 / rate
    achieved = total / seconds
    share = provider.limited / len(requests)
    print(
        f"\n{rate:g}/s{' kill -9' if kill else ''}: {total} emails in {seconds:.1f} s, "
        f"{achieved:.0f}/s of {rate * BATCH:.0f} ({achieved / (rate * BATCH):.2f}x); "
        f"{provider.limited} of {len(requests)} requests answered 429"
    )
    # The goal (0.9x) is a speed figure, bench/outbox.py's on a quiet machine (BENCHMARKS.md);
    # a kill -9 costs the victim's reserved requests. This floor is above the 0.63-0.68x of the
    # token bucket the window replaced: a pacer that waits out its own 429s fails it.
    assert achieved >= 0.75 * rate * BATCH
    # At most one 429 a run (here 20-60 requests, where one is 2-5%): on a busy machine a request
    # can leave late enough for the provider to count it in the next one's window. The share
    # goal (< 1%) is bench/outbox.py's, over more requests; the token bucket the window replaced
    # drew 22 of 83.
    assert provider.limited <= 1, f"{share:.1%} of requests answered 429"
