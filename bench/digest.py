"""The daily digest at scale: 1,000,000 users (90 % enabled) through HTTP, against the same
set-based SQL run straight from psql (the floor), and against the article's per-user loop.

Every variant starts from an equal copy of the loaded data (`CREATE DATABASE ... TEMPLATE`),
after a CHECKPOINT, on one server with settings for a bulk update (below). Goals (issue 6): the
HTTP run within 1.2 x the floor; at least 20 x faster per user than the loop (measured on
20,000 users). The instance's peak RSS (VmHWM) shows the rows never come into Python.

    .venv/bin/python bench/digest.py [--users 1000000] [--loop-users 20000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import asyncpg
import httpx

from bench.common import (
    PinnedInstance,
    Server,
    create_database,
    drop_database,
    instance_env,
    machine,
    new_secret,
    peak_rss_kib,
    postgres,
    server_version,
    stats,
    table,
    write_json,
)
from cronlock.core.schedule import Schedule
from cronlock.db.schema import notify_channel
from cronlock.demo.digest import DIGEST_SQL, SENDER
from cronlock.sql import qualify

JOB = "daily-digest"
SCHEDULE = Schedule.parse("0 7 * * *", "UTC")  # as cronlock/demo/digest.py declares it

# The same for every variant: room for a bulk update of 1M rows without a checkpoint in the
# middle of a run (each run starts after an explicit CHECKPOINT).
PG_SETTINGS = {
    "shared_buffers": "512MB",
    "max_wal_size": "4GB",
    "min_wal_size": "1GB",
    "checkpoint_timeout": "30min",
    "wal_buffers": "64MB",
    "maintenance_work_mem": "512MB",
    "work_mem": "64MB",
    "effective_cache_size": "8GB",
}

SCHEMA = "cronlock"  # the default DB_SCHEMA, which the instances under test use

LOAD_SQL = """
INSERT INTO cronlock_demo.users (id, email, digest_enabled)
SELECT g, 'user' || g || '@example.com', g % 10 <> 0
FROM generate_series(1, $1::bigint) AS g
"""

# The article's loop: one select, then an update and an enqueue per user.
DUE_SQL = """
SELECT id, email FROM cronlock_demo.users
WHERE digest_enabled AND (last_digest_at IS NULL OR last_digest_at < $1)
"""
STAMP_SQL = "UPDATE cronlock_demo.users SET last_digest_at = now() WHERE id = $1"
ENQUEUE_SQL = """
INSERT INTO cronlock.email_outbox (idempotency_key, job, slot, user_id, sender, recipient,
                                   subject, body)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
ON CONFLICT DO NOTHING
"""
BODY = "Hello {email},\n\nhere is what happened since your last digest.\n"


@dataclass
class Result:
    variant: str
    users: int
    processed: int
    seconds: float
    peak_rss_kib: int | None = None
    rss_before_kib: int | None = None

    @property
    def us_per_user(self) -> float:
        return self.seconds / self.processed * 1e6 if self.processed else 0.0


async def load(server: Server, users: int) -> str:
    """A migrated database with `users` users, vacuumed and analysed: the template."""
    name = await create_database(server)
    conn = await asyncpg.connect(server.dsn(name), statement_cache_size=0)
    try:
        await conn.execute(LOAD_SQL, users)
        await conn.execute(
            "SELECT setval(pg_get_serial_sequence('cronlock_demo.users', 'id'), $1)", users
        )
        await conn.execute("VACUUM (FREEZE, ANALYZE) cronlock_demo.users")
    finally:
        await conn.close()
    return name


async def fresh_copy(server: Server, template: str) -> tuple[str, datetime]:
    """An equal copy of the template, after a checkpoint; and the slot a run now is for."""
    name = await create_database(server, template=template)
    conn = await asyncpg.connect(server.dsn(name), statement_cache_size=0)
    try:
        await conn.execute("CHECKPOINT")
        now: datetime = await conn.fetchval("SELECT now()")
    finally:
        await conn.close()
    return name, SCHEDULE.slot_for(now, 5.0)


async def count_queued(dsn: str) -> int:
    conn = await asyncpg.connect(dsn, statement_cache_size=0)
    try:
        found: int = await conn.fetchval("SELECT count(*) FROM cronlock.email_outbox")
        return found
    finally:
        await conn.close()


def psql_binary(server: Server) -> str:
    if server.local is not None:
        candidate = server.local.bindir / "psql"
        if candidate.exists():
            return str(candidate)
    found = shutil.which("psql")
    if found is None:
        raise RuntimeError("psql is not installed")
    return found


def floor_script(slot: datetime) -> str:
    """The digest's own statement with its parameters as literals, in one transaction."""
    body = (
        qualify(DIGEST_SQL, SCHEMA)
        .replace("$1", f"'{slot.isoformat()}'::timestamptz")
        .replace("$2", f"'{JOB}'")
        .replace("$3", "'" + SENDER.replace("'", "''") + "'")
    )
    notify = f"SELECT pg_notify('{notify_channel(SCHEMA)}', '')"
    return f"BEGIN;\n{body.strip()};\n{notify};\nCOMMIT;\n"


async def run_floor(server: Server, template: str, users: int) -> Result:
    name, slot = await fresh_copy(server, template)
    try:
        script = Path(tempfile.mkdtemp(prefix="cronlock-digest-")) / "floor.sql"
        script.write_text(floor_script(slot))
        args = [psql_binary(server), "-X", "-q", "-v", "ON_ERROR_STOP=1"]
        args += ["-d", server.dsn(name), "-f", str(script)]
        start = asyncio.get_running_loop().time()
        process = await asyncio.create_subprocess_exec(
            *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        _, stderr = await asyncio.wait_for(process.communicate(), 600)
        seconds = asyncio.get_running_loop().time() - start
        shutil.rmtree(script.parent, ignore_errors=True)
        if process.returncode != 0:
            raise RuntimeError(f"psql failed: {stderr.decode(errors='replace')}")
        return Result(
            "floor: psql, set-based SQL", users, await count_queued(server.dsn(name)), seconds
        )
    finally:
        await drop_database(server, name)


async def run_http(server: Server, template: str, users: int, workdir: Path) -> Result:
    name, _ = await fresh_copy(server, template)
    secret = new_secret()
    instance = PinnedInstance(
        "bench-digest",
        instance_env(server.dsn(name), secret, jobs="cronlock.demo.digest"),
        cpus=None,
        dir=workdir / name,
    )
    try:
        instance.start()
        before, _ = peak_rss_kib(instance.pid)
        async with httpx.AsyncClient(
            base_url=instance.url, headers={"Authorization": f"Bearer {secret}"}, timeout=330
        ) as client:
            start = asyncio.get_running_loop().time()
            response = await client.post(f"/cron/{JOB}")
            seconds = asyncio.get_running_loop().time() - start
        body = response.json()
        if response.status_code != 200 or "processed" not in body:
            raise RuntimeError(f"digest run failed: {response.status_code} {body}")
        peak, _ = peak_rss_kib(instance.pid)
        queued = await count_queued(server.dsn(name))
        if queued != body["processed"]:
            raise RuntimeError(f"answered {body['processed']}, outbox holds {queued}")
        return Result("cronlock: POST /cron/daily-digest", users, queued, seconds, peak, before)
    finally:
        instance.stop()
        await drop_database(server, name)


async def run_loop(server: Server, template: str, users: int, *, cache: int) -> Result:
    """The per-user loop in one transaction, through asyncpg (`cache` = statement cache size:
    0 as cronlock's pool, or prepared statements, kinder to the loop)."""
    name, slot = await fresh_copy(server, template)
    try:
        conn = await asyncpg.connect(server.dsn(name), statement_cache_size=cache)
        try:
            start = asyncio.get_running_loop().time()
            async with conn.transaction():
                due = await conn.fetch(DUE_SQL, slot)
                epoch = int(slot.timestamp())
                subject = f"Your daily digest for {slot:%Y-%m-%d}"
                for user in due:
                    await conn.execute(STAMP_SQL, user["id"])
                    await conn.execute(
                        ENQUEUE_SQL,
                        f"{JOB}:{epoch}:{user['id']}",
                        JOB,
                        slot,
                        user["id"],
                        SENDER,
                        user["email"],
                        subject,
                        BODY.format(email=user["email"]),
                    )
                await conn.execute("SELECT pg_notify($1, '')", notify_channel(SCHEMA))
            seconds = asyncio.get_running_loop().time() - start
        finally:
            await conn.close()
        label = "per-user loop, " + (
            "prepared statements" if cache else "no statement cache (as cronlock's pool)"
        )
        return Result(label, users, await count_queued(server.dsn(name)), seconds)
    finally:
        await drop_database(server, name)


async def run(args: argparse.Namespace, server: Server) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="cronlock-bench-digest-"))
    try:
        print(f"loading {args.users:,} and {args.loop_users:,} users ...", file=sys.stderr)
        big = await load(server, args.users)
        small = await load(server, args.loop_users)
        version = await server_version(server.dsn(big))
        results: list[Result] = []
        for number in range(args.rounds):
            for variant in ("floor", "http") if number % 2 == 0 else ("http", "floor"):
                if variant == "floor":
                    result = await run_floor(server, big, args.users)
                else:
                    result = await run_http(server, big, args.users, workdir)
                results.append(result)
                print(f"  {result.variant}: {result.seconds:.2f} s", file=sys.stderr)
        loops = [
            await run_loop(server, small, args.loop_users, cache=0),
            await run_loop(server, small, args.loop_users, cache=100),
        ]
        small_http = await run_http(server, small, args.loop_users, workdir)
        for result in (*loops, small_http):
            print(f"  {result.variant} ({result.users:,}): {result.seconds:.2f} s", file=sys.stderr)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return report(args, results, loops, small_http, version)


def report(
    args: argparse.Namespace,
    results: list[Result],
    loops: list[Result],
    small_http: Result,
    version: str,
) -> dict[str, Any]:
    floor = [r for r in results if r.variant.startswith("floor")]
    http = [r for r in results if r.variant.startswith("cronlock")]
    floor_s = stats([r.seconds for r in floor])
    http_s = stats([r.seconds for r in http])
    rows: list[list[Any]] = []
    for group, s in ((floor, floor_s), (http, http_s)):
        first = group[0]
        rows.append(
            [
                first.variant,
                first.users,
                first.processed,
                len(group),
                *s,
                s[1] / first.processed * 1e6,
                s[1] / floor_s[1],
            ]
        )
    for r in (*loops, small_http):
        rows.append(
            [
                r.variant,
                r.users,
                r.processed,
                1,
                r.seconds,
                r.seconds,
                r.seconds,
                r.us_per_user,
                "-",
            ]
        )
    figures = table(
        [
            "variant",
            "users",
            "processed",
            "runs",
            "s min",
            "s med",
            "s max",
            "µs per user",
            "vs floor",
        ],
        rows,
    )
    http_per_user = http_s[1] / http[0].processed * 1e6
    ratio = http_s[1] / floor_s[1]
    peak = max(r.peak_rss_kib or 0 for r in http)
    before = max(r.rss_before_kib or 0 for r in http)
    speedups = {r.variant: r.us_per_user / http_per_user for r in loops}
    goals = table(
        ["goal", "figure", "verdict"],
        [
            [
                "HTTP run within 1.2 x the floor (medians)",
                f"{ratio:.2f} x",
                "met" if ratio <= 1.2 else "MISSED",
            ],
            *(
                [
                    f">= 20 x faster per user than the {r.variant}",
                    f"{speedups[r.variant]:.0f} x ({r.us_per_user:.0f} vs {http_per_user:.1f} µs)",
                    "met" if speedups[r.variant] >= 20 else "MISSED",
                ]
                for r in loops
            ),
            [
                "instance peak RSS (VmHWM) during the 1M run",
                f"{peak / 1024:.0f} MiB (at start {before / 1024:.0f} MiB)",
                "rows stay in PostgreSQL" if peak - before < 64 * 1024 else "CHECK",
            ],
        ],
    )
    print("\n### Daily digest at scale\n")
    print(figures)
    print()
    print(goals)
    settings = ", ".join(f"{k}={v}" for k, v in PG_SETTINGS.items())
    where = (
        "DATABASE_URL's server (settings as found)" if os.environ.get("DATABASE_URL") else settings
    )
    print(
        f"\nEach run on a fresh CREATE DATABASE ... TEMPLATE copy after a CHECKPOINT; "
        f"{args.rounds} interleaved rounds of floor and HTTP. PostgreSQL {version}: {where}."
    )
    return {
        "machine": machine(version),
        "pg_settings": PG_SETTINGS,
        "results": [
            vars(r) | {"us_per_user": r.us_per_user} for r in [*results, *loops, small_http]
        ],
        "ratio_http_floor": ratio,
        "loop_speedups": speedups,
        "peak_rss_kib": peak,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--users", type=int, default=1_000_000)
    parser.add_argument("--loop-users", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=2, help="floor + HTTP pairs")
    parser.add_argument("--json", type=Path, default=None, help="write the raw figures here")
    args = parser.parse_args(argv)
    with postgres(PG_SETTINGS) as server:
        output = asyncio.run(run(args, server))
    write_json(args.json, output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
