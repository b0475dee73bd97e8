"""Outbox delivery throughput against a provider that answers after 50 ms.

For 1 and 3 sender processes (each `python -m tests.outbox_worker`, the same loop as `python
-m cronlock outbox drain`), queue enough emails for a few seconds of ideal work, let the senders
drain them, and report emails/s next to the ideal: senders x OUTBOX_CONCURRENCY / delay (each
send slot can do at most one request per provider round trip). A ratio near 1 means claiming,
marking and the database cost nothing next to the provider's latency.

The provider is tests/support/provider.py (a real HTTP server, idempotency keys honoured) in
a thread of this process; PostgreSQL is a throwaway local server, or DATABASE_URL's.

    .venv/bin/python bench/outbox.py [--senders 1,3] [--concurrency 8] [--seconds 5]
                                     [--delay 0.05] [--json out.json]

Then, at a provider's request limit (`--rates`, requests/s, enforced as a strict one-second
window with Resend's rate headers, 429 beyond it), 2 senders with OUTBOX_RATE_LIMIT at that
rate: emails/s with batches of `--email-batch` (POST /emails/batch) against the ideal (rate x
batch size), the share of requests answered 429, and, at the first rate, one email per request
(ideal: the rate). `--batch-emails` emails per batched run (6,000: ~30 s at 2 requests/s).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import asyncpg

from bench.common import (
    Server,
    create_database,
    drop_database,
    machine,
    postgres,
    server_version,
    table,
    write_json,
)
from tests.support.provider import Provider

ROOT = Path(__file__).resolve().parent.parent

QUEUE_SQL = """
INSERT INTO cronlock.email_outbox (job, slot, user_id, sender, recipient, subject, body)
SELECT 'bench', now(), g, 'cronlock <digest@example.com>', 'user' || g || '@example.com',
       'Your daily digest', 'Hello user ' || g || E',\\n\\nhere is what happened.\\n'
FROM generate_series(1, $1::int) AS g
"""


@dataclass(frozen=True)
class Result:
    senders: int
    concurrency: int
    emails: int
    seconds: float
    cpu_ms_per_email: float
    delivered_twice: int

    @property
    def rate(self) -> float:
        return self.emails / self.seconds

    def ideal(self, delay: float) -> float:
        return self.senders * self.concurrency / delay

    def row(self, delay: float) -> list[Any]:
        return [
            self.senders,
            self.concurrency,
            self.emails,
            round(self.seconds, 2),
            round(self.rate, 1),
            round(self.ideal(delay), 1),
            round(self.rate / self.ideal(delay), 2),
            round(self.cpu_ms_per_email, 2),
        ]


def worker_env(dsn: str, provider: Provider, args: argparse.Namespace) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "EMAIL_"))}
    env.update(
        {
            "DATABASE_URL": dsn,
            "EMAIL_BACKEND": "http",
            "EMAIL_API_URL": provider.url,
            "EMAIL_API_KEY": "re_bench_key",
            "OUTBOX_RATE_LIMIT": "0",
            "OUTBOX_CONCURRENCY": str(args.concurrency),
            "OUTBOX_BATCH_SIZE": str(args.batch),
            "OUTBOX_POLL_INTERVAL": "0.1",
            "LOG_LEVEL": "WARNING",
            "PYTHONPATH": str(ROOT),
        }
    )
    return env


def start_worker(env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "tests.outbox_worker"], cwd=ROOT, env=env)


async def run_one(server: Server, template: str, senders: int, args: argparse.Namespace) -> Result:
    ideal = senders * args.concurrency / args.delay
    emails = max(200, int(ideal * args.seconds))
    name = await create_database(server, template=template)
    conn = await asyncpg.connect(server.dsn(name), statement_cache_size=0)
    workers: list[subprocess.Popen[bytes]] = []
    try:
        await conn.execute(QUEUE_SQL, emails)
        with Provider(delay=args.delay) as provider:
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            env = worker_env(server.dsn(name), provider, args)
            workers = [start_worker(env) for _ in range(senders)]
            # Bounded: a tenth of the ideal rate would still finish well within this.
            deadline = time.monotonic() + 10 * args.seconds + 30
            while await conn.fetchval(
                "SELECT count(*) FROM cronlock.email_outbox WHERE status <> 'sent'"
            ):
                if time.monotonic() > deadline:
                    raise SystemExit(f"{senders} sender(s) did not drain {emails} emails in time")
                if any(w.poll() is not None for w in workers):
                    raise SystemExit("a sender process exited early")
                await asyncio.sleep(0.25)
            for w in workers:
                w.send_signal(signal.SIGTERM)
            for w in workers:
                w.wait(30)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            requests = provider.requests
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
        await conn.close()
        await drop_database(server, name)
    # From the first request in to the last answer out: the senders' start-up is not counted.
    seconds = max(r.answered for r in requests) - min(r.received for r in requests)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    twice = sum(1 for r in requests if not r.delivered)
    return Result(senders, args.concurrency, emails, seconds, cpu / emails * 1000, twice)


async def run_limited(
    server: Server, template: str, args: argparse.Namespace, rate: float, batch: int, emails: int
) -> tuple[float, int, int]:
    """Emails/s through 2 senders at the provider's request limit; 429s; requests."""
    name = await create_database(server, template=template)
    conn = await asyncpg.connect(server.dsn(name), statement_cache_size=0)
    workers: list[subprocess.Popen[bytes]] = []
    try:
        await conn.execute(QUEUE_SQL, emails)
        with Provider(rate=rate) as provider:
            env = worker_env(server.dsn(name), provider, args)
            env.update(
                {
                    "OUTBOX_RATE_LIMIT": str(rate),
                    "EMAIL_BATCH_SIZE": str(batch),
                    "OUTBOX_BATCH_SIZE": str(max(2 * batch, args.batch)),
                    "OUTBOX_CONCURRENCY": "4",
                }
            )
            workers = [start_worker(env) for _ in range(2)]
            deadline = time.monotonic() + 3 * emails / (rate * batch) + 30
            while await conn.fetchval(
                "SELECT count(*) FROM cronlock.email_outbox WHERE status <> 'sent'"
            ):
                if time.monotonic() > deadline:
                    raise SystemExit(f"batch {batch}: {emails} emails not drained in time")
                await asyncio.sleep(0.25)
            for w in workers:
                w.send_signal(signal.SIGTERM)
            for w in workers:
                w.wait(30)
            ok = [r for r in provider.requests if r.status == 200]
            limited = provider.limited
            requests = len(provider.requests)
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
        await conn.close()
        await drop_database(server, name)
    # First request to last, plus the interval the last one opens (the bucket's pacing).
    seconds = max(r.received for r in ok) - min(r.received for r in ok) + 1 / rate
    return emails / seconds, limited, requests


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    counts = [int(n) for n in args.senders.split(",")]
    with postgres() as server:
        version = await server_version(server.admin_dsn)
        template = await create_database(server)
        try:
            results = [await run_one(server, template, n, args) for n in counts]
            rates = [float(r) for r in args.rates.split(",")]
            batched = [
                (rate, await run_limited(server, template, args, rate, args.email_batch, emails))
                for rate, emails in zip(rates, [args.batch_emails] * len(rates), strict=True)
            ]
            first = rates[0]
            single = await run_limited(server, template, args, first, 1, int(first * 10))
        finally:
            await drop_database(server, template)
    headers = [
        "senders",
        "concurrency",
        "emails",
        "seconds",
        "emails/s",
        "ideal/s",
        "ratio",
        "sender CPU ms/email",
    ]
    print(f"provider answers after {args.delay * 1000:.0f} ms; batch {args.batch}")
    print(table(headers, [r.row(args.delay) for r in results]))
    facts = machine(version)
    print("  ".join(f"{k}: {v}" for k, v in facts.items()))
    if any(r.delivered_twice for r in results):
        print("WARNING: some requests repeated a key (the provider did not deliver them twice)")
    print("\nat the provider's limit (a strict one-second window), 2 senders:")
    rows: list[list[Any]] = [
        [
            f"{rate:g}/s, batches of {args.email_batch}",
            round(got, 1),
            rate * args.email_batch,
            round(got / (rate * args.email_batch), 2),
            f"{limited} of {requests}",
        ]
        for rate, (got, limited, requests) in batched
    ]
    rows.append(
        [
            f"{first:g}/s, one per request",
            round(single[0], 2),
            first,
            round(single[0] / first, 2),
            f"{single[1]} of {single[2]}",
        ]
    )
    print(table(["mode", "emails/s", "ideal/s", "ratio", "429s"], rows))
    print(f"batching carries {batched[0][1][0] / single[0]:.0f}x the emails of one per request")
    return {
        "limited": {
            "email_batch": args.email_batch,
            "batched": [
                {"rate": rate, "emails_per_s": got, "answered_429": limited, "requests": requests}
                for rate, (got, limited, requests) in batched
            ],
            "single_rate": single[0],
        },
        "delay": args.delay,
        "batch": args.batch,
        "machine": facts,
        "results": [
            {
                "senders": r.senders,
                "concurrency": r.concurrency,
                "emails": r.emails,
                "seconds": r.seconds,
                "rate": r.rate,
                "ideal": r.ideal(args.delay),
                "ratio": r.rate / r.ideal(args.delay),
                "cpu_ms_per_email": r.cpu_ms_per_email,
                "repeated_requests": r.delivered_twice,
            }
            for r in results
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--senders", default="1,3", help="sender process counts, e.g. 1,3")
    parser.add_argument("--concurrency", type=int, default=8, help="OUTBOX_CONCURRENCY")
    parser.add_argument("--batch", type=int, default=50, help="OUTBOX_BATCH_SIZE")
    parser.add_argument("--seconds", type=float, default=5.0, help="ideal seconds of work")
    parser.add_argument("--delay", type=float, default=0.05, help="provider answer time (s)")
    parser.add_argument("--rates", default="2,5", help="provider requests/s limits, e.g. 2,5")
    parser.add_argument("--email-batch", type=int, default=100, help="EMAIL_BATCH_SIZE")
    parser.add_argument("--batch-emails", type=int, default=6000, help="emails, batched run")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args()
    write_json(args.json, asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
