"""The digest as a lease job at scale: `chunked-digest` (cronlock/demo/chunked.py) over 10,000,000
users (90 % enabled), against the set-based floor (the one-transaction digest's statement run
from psql), with the longest transaction sampled from pg_stat_activity throughout; then a run
whose holder is killed (-9) about half way, which another instance takes over once the lease
(30 s) has run out, and which must still end with exactly one outbox row per enabled user.

Each variant starts from an equal copy of the loaded data (CREATE DATABASE ... TEMPLATE),
after a CHECKPOINT, with bench/digest.py's server settings. Goals (issue 13): the chunked run
within 1.5 x the floor (it commits every chunk: many small transactions instead of one);
no transaction longer than a few seconds (the floor's is the whole run); after the kill, one
outbox row per enabled user for the slot, and none twice.

    .venv/bin/python bench/chunked.py [--users 10000000] [--chunk 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import asyncpg
import httpx

from bench.common import (
    PinnedInstance,
    Server,
    drop_database,
    instance_env,
    machine,
    new_secret,
    postgres,
    server_version,
    table,
    write_json,
)
from bench.digest import PG_SETTINGS, fresh_copy, load, run_floor

JOB = "chunked-digest"

LONGEST_SQL = """
SELECT coalesce(max(extract(epoch FROM clock_timestamp() - xact_start)), 0)
FROM pg_stat_activity
WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()
  AND xact_start IS NOT NULL AND datname = current_database()
"""

COUNTS_SQL = """
SELECT count(*) AS rows, count(DISTINCT user_id) AS users FROM cronlock.email_outbox
WHERE job = $1
"""


@dataclass
class Result:
    variant: str
    users: int
    queued: int
    seconds: float
    longest_transaction: float
    attempts: int = 1
    distinct_users: int = 0


async def sample_longest(dsn: str, stop: asyncio.Event) -> float:
    """The longest transaction seen, sampled every 50 ms until `stop`."""
    conn = await asyncpg.connect(dsn, statement_cache_size=0)
    longest = 0.0
    try:
        while not stop.is_set():
            longest = max(longest, float(await conn.fetchval(LONGEST_SQL)))
            await asyncio.sleep(0.05)
    finally:
        await conn.close()
    return longest


async def run_chunked(
    server: Server, template: str, users: int, chunk: int, workdir: Path, *, kill: bool
) -> Result:
    name, _ = await fresh_copy(server, template)
    dsn = server.dsn(name)
    secret = new_secret()
    env = instance_env(dsn, secret, jobs="cronlock.demo.chunked", LEASE_POLL_INTERVAL="1")
    instances = [
        PinnedInstance(f"bench-chunked-{n}", env, cpus=None, dir=workdir / f"{name}-{n}")
        for n in (1, 2)
    ]
    stop = asyncio.Event()
    sampler: asyncio.Task[float] | None = None
    conn = await asyncpg.connect(dsn, statement_cache_size=0)
    try:
        for instance in instances:
            instance.start()
        sampler = asyncio.create_task(sample_longest(dsn, stop))
        enabled = int(
            await conn.fetchval("SELECT count(*) FROM cronlock_demo.users WHERE digest_enabled")
        )
        async with httpx.AsyncClient(
            base_url=instances[0].url, headers={"Authorization": f"Bearer {secret}"}, timeout=30
        ) as client:
            start = time.monotonic()
            response = await client.post(f"/cron/{JOB}", json={"chunk": chunk})
            if response.status_code != 202:
                raise RuntimeError(f"trigger failed: {response.status_code} {response.text}")
            killed = False
            while True:
                status = await conn.fetchval(
                    "SELECT status FROM cronlock.runs WHERE job = $1 ORDER BY id DESC LIMIT 1", JOB
                )
                if status not in ("running", "abandoned"):
                    break
                if kill and not killed:
                    queued = await conn.fetchval(
                        "SELECT count(*) FROM cronlock.email_outbox WHERE job = $1", JOB
                    )
                    if queued >= enabled // 2:
                        instances[0].kill()
                        killed = True
                        print(f"  killed the holder at {queued:,} queued", file=sys.stderr)
                if time.monotonic() - start > 3600:
                    raise RuntimeError("the chunked digest did not finish within an hour")
                await asyncio.sleep(0.2)
            seconds = time.monotonic() - start
        if status != "succeeded":
            raise RuntimeError(f"the chunked digest ended {status}")
        counts = await conn.fetchrow(COUNTS_SQL, JOB)
        assert counts is not None
        attempts = int(
            await conn.fetchval("SELECT count(*) FROM cronlock.runs WHERE job = $1", JOB)
        )
        stop.set()
        longest = await sampler
        label = "chunked-digest, holder killed half way" if kill else "chunked-digest (lease)"
        return Result(label, users, counts["rows"], seconds, longest, attempts, counts["users"])
    finally:
        stop.set()
        if sampler is not None and not sampler.done():
            sampler.cancel()
        await conn.close()
        for instance in instances:
            instance.stop()
        await drop_database(server, name)


async def floor_longest(server: Server, template: str, users: int) -> Result:
    """The floor run, its longest transaction being the run itself."""
    found = await run_floor(server, template, users)
    return Result(
        "floor: psql, set-based SQL, one transaction",
        users,
        found.processed,
        found.seconds,
        found.seconds,
        1,
        found.processed,
    )


async def run(args: argparse.Namespace, server: Server) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="cronlock-bench-chunked-"))
    try:
        print(f"loading {args.users:,} users ...", file=sys.stderr)
        template = await load(server, args.users)
        version = await server_version(server.dsn(template))
        results = [await floor_longest(server, template, args.users)]
        print(f"  {results[-1].variant}: {results[-1].seconds:.1f} s", file=sys.stderr)
        for kill in (False, True):
            results.append(
                await run_chunked(server, template, args.users, args.chunk, workdir, kill=kill)
            )
            print(f"  {results[-1].variant}: {results[-1].seconds:.1f} s", file=sys.stderr)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    floor, chunked, killed = results
    ratio = chunked.seconds / floor.seconds
    enabled = floor.queued
    print("\n### Chunked digest (lease mode) at scale\n")
    print(
        table(
            [
                "variant",
                "users",
                "queued",
                "distinct users",
                "attempts",
                "s",
                "longest tx s",
                "vs floor",
            ],
            [
                [
                    r.variant,
                    r.users,
                    r.queued,
                    r.distinct_users,
                    r.attempts,
                    r.seconds,
                    r.longest_transaction,
                    r.seconds / floor.seconds,
                ]
                for r in results
            ],
        )
    )
    print()
    once = killed.queued == killed.distinct_users == enabled
    print(
        table(
            ["goal", "figure", "verdict"],
            [
                [
                    "chunked run within 1.5 x the floor",
                    f"{ratio:.2f} x",
                    "met" if ratio <= 1.5 else "MISSED",
                ],
                [
                    "longest transaction of the chunked run",
                    f"{chunked.longest_transaction:.2f} s "
                    f"(floor: {floor.longest_transaction:.0f} s)",
                    "met" if chunked.longest_transaction < 10 else "MISSED",
                ],
                [
                    "kill -9 half way: one outbox row per enabled user",
                    f"{killed.queued:,} rows, "
                    f"{killed.distinct_users:,} users, {enabled:,} enabled, "
                    f"{killed.attempts} attempts",
                    "met" if once and killed.attempts >= 2 else "MISSED",
                ],
            ],
        )
    )
    print(
        f"\nChunks of {args.chunk:,} users; lease 30 s (the takeover waits it out after the "
        f"kill). PostgreSQL {version}, bench/digest.py's settings."
    )
    return {"machine": machine(version), "results": [vars(r) for r in results], "ratio": ratio}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--users", type=int, default=10_000_000)
    parser.add_argument("--chunk", type=int, default=10_000)
    parser.add_argument("--json", type=Path, default=None, help="write the raw figures here")
    args = parser.parse_args(argv)
    with postgres(PG_SETTINGS) as server:
        output = asyncio.run(run(args, server))
    write_json(args.json, output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
