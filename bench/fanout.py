"""Fan-out at scale (issue 25's Speed section), ratios within one run:

- (io) I/O-bound items (each awaits 100 ms): a 600-item run on 3 instances against 1 instance,
  same FANOUT_CONCURRENCY each. Goal: >= 2.4 x faster.
- (db) database-bound items (one small write each): items/s of one instance against a floor
  measured in the same run, a bare asyncpg loop doing the same claim + write + mark
  transactions at the same concurrency. Goal: >= 0.7 x the floor. Item throughput: from the
  trigger's 202 (the items committed) to the run's end; planning is (plan)'s to measure, and
  the floor's items are there before its clock starts.
- (plan) planning 1,000,000 items (the trigger's 202, the items committed) against a bare COPY
  of the same rows into a table with the same indexes. Goal: <= 2 x.
- (proof) the issue's full-size proof: 20,000 items on 3 instances, one killed (-9) and one
  frozen (SIGSTOP) then woken mid-run: every item once, `done` once.

Rounds are interleaved; min/median/max are printed.

    .venv/bin/python bench/fanout.py [--rounds 3] [--db-items 20000] [--plan-items 1000000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import asyncpg
import httpx

from bench.common import (
    PinnedInstance,
    Server,
    create_database,
    instance_env,
    machine,
    new_secret,
    postgres,
    server_version,
    stats,
    table,
    write_json,
)
from bench.fanout_jobs import EFFECTS_SQL
from cronlock.core.fanout import copy_line, encode

PG_SETTINGS = {"shared_buffers": "512MB", "max_wal_size": "4GB", "checkpoint_timeout": "30min"}
CONCURRENCY = 8


IO, DB = "bench-fan-io", "bench-fan-db"
JOBS = [IO, DB]


async def reset(conn: asyncpg.Connection, *, paused: bool = False) -> None:
    """Empty tables; the jobs paused meanwhile (the workers leave their items alone), and
    still paused after it when `paused` (a forced trigger plans all the same)."""
    await conn.execute(EFFECTS_SQL)
    await conn.execute(
        "INSERT INTO cronlock.pauses (job, paused_by) SELECT j, 'bench' FROM unnest($1::text[]) j "
        "ON CONFLICT DO NOTHING",
        JOBS,
    )
    await asyncio.sleep(0.6)  # past the workers' poll: no new claims
    for _ in range(50):
        try:
            await conn.execute(
                "SET lock_timeout = '2s'; TRUNCATE bench_fan_effects; "
                "TRUNCATE cronlock.fanouts, cronlock.fanout_items CASCADE; "
                "DELETE FROM cronlock.runs; RESET lock_timeout"
            )
            break
        except (asyncpg.DeadlockDetectedError, asyncpg.LockNotAvailableError):
            await asyncio.sleep(0.5)
    await conn.execute("VACUUM ANALYZE cronlock.fanout_items")
    if not paused:
        await conn.execute("DELETE FROM cronlock.pauses WHERE paused_by = 'bench'")


async def run_fanout(
    conn: asyncpg.Connection, url: str, secret: str, job: str, n: int, within: float = 900
) -> tuple[float, float, float]:
    """Trigger `job` with n items; (seconds to its 202, seconds to the run's end, seconds from
    the 202 to the end seen here: one clock, a 20 ms poll)."""
    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {secret}"}, timeout=within
    ) as client:
        start = time.monotonic()
        r = await client.post(f"/cron/{job}?force=true", json={"n": n})
        planned = time.monotonic() - start
        if r.status_code != 202:
            raise RuntimeError(f"{job}: {r.status_code} {r.text}")
        run_id = r.json()["run_id"]
    while True:
        status = await conn.fetchval("SELECT status FROM cronlock.runs WHERE id = $1", run_id)
        if status != "running":
            worked = time.monotonic() - start - planned
            break
        if time.monotonic() - start > within:
            raise RuntimeError(f"{job} did not finish within {within} s")
        await asyncio.sleep(0.02)
    if status != "succeeded":
        raise RuntimeError(f"{job} ended {status}")
    ended = await conn.fetchval(
        "SELECT extract(epoch FROM finished_at - started_at) FROM cronlock.runs WHERE id = $1",
        run_id,
    )
    print(
        f"  {job} {n}: planned in {planned:.2f} s, ended in {float(ended):.2f} s", file=sys.stderr
    )
    return planned, float(ended), worked


FLOOR_SETUP = """
DROP TABLE IF EXISTS floor_items;
CREATE TABLE floor_items (
    n integer PRIMARY KEY, item jsonb NOT NULL, status text NOT NULL DEFAULT 'pending'
);
CREATE INDEX floor_items_pending ON floor_items (n) WHERE status = 'pending';
"""
FLOOR_CLAIM = """
SELECT n, item FROM floor_items WHERE status = 'pending' ORDER BY n LIMIT 1
FOR UPDATE SKIP LOCKED
"""


async def floor(dsn: str, n: int, concurrency: int) -> float:
    """Items/s of a bare asyncpg loop: claim (SKIP LOCKED) + one write + mark, per transaction."""
    conn = await asyncpg.connect(dsn, statement_cache_size=0)
    try:
        await conn.execute(FLOOR_SETUP)
        await conn.execute(
            "INSERT INTO floor_items (n, item) "
            "SELECT g, to_jsonb(g) FROM generate_series(0, $1 - 1) g",
            n,
        )
        await conn.execute("VACUUM ANALYZE floor_items")
    finally:
        await conn.close()
    pool = await asyncpg.create_pool(
        dsn, min_size=concurrency, max_size=concurrency, statement_cache_size=0
    )
    assert pool is not None

    async def worker() -> None:
        while True:
            async with pool.acquire() as c, c.transaction():
                row = await c.fetchrow(FLOOR_CLAIM)
                if row is None:
                    return
                await c.execute(
                    "INSERT INTO bench_fan_effects (item, run_id) VALUES ($1, 0)", row["n"]
                )
                await c.execute(
                    "UPDATE floor_items SET status = 'succeeded' WHERE n = $1", row["n"]
                )

    try:
        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return n / (time.monotonic() - start)
    finally:
        await pool.close()


async def bare_copy(dsn: str, n: int) -> float:
    """Seconds to COPY n rows like the planner's (encoded the same way) into a table with the
    items table's indexes, in one transaction."""
    conn = await asyncpg.connect(dsn, statement_cache_size=0)
    try:
        await conn.execute(
            "DROP TABLE IF EXISTS copy_items; "
            "CREATE TABLE copy_items (LIKE cronlock.fanout_items INCLUDING ALL)"
        )
        start = time.monotonic()
        async with conn.transaction():
            items = [encode(i) for i in range(n)]

            async def chunks() -> Any:
                for s in range(0, n, 5000):
                    yield b"".join(copy_line(1, k, items[k]) for k in range(s, min(n, s + 5000)))

            await conn.copy_to_table(
                "copy_items", columns=["fanout_id", "n", "item"], source=chunks(), format="text"
            )
        return time.monotonic() - start
    finally:
        await conn.close()


async def run(args: argparse.Namespace, server: Server) -> dict[str, Any]:
    name = await create_database(server)
    dsn = server.dsn(name)
    secret = new_secret()
    env = instance_env(
        dsn,
        secret,
        jobs="bench.fanout_jobs",
        FANOUT_CONCURRENCY=str(CONCURRENCY),
        FANOUT_POLL_INTERVAL="0.2",
        DB_POOL_MAX_SIZE=str(CONCURRENCY + 4),
        DATABASE_DIRECT_URL=dsn,
        LOG_SKIPS="false",
    )
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="cronlock-bench-fanout-"))
    instances = [
        PinnedInstance(f"bench-fan-{i}", env, cpus=None, dir=workdir / f"fan-{i}") for i in range(3)
    ]
    conn = await asyncpg.connect(dsn, statement_cache_size=0)
    results: dict[str, list[float]] = {k: [] for k in ("io1", "io3", "db", "floor", "plan", "copy")}
    try:
        await reset(conn)
        for instance in instances:
            instance.start()
        for r in range(args.rounds):
            print(f"round {r + 1}", file=sys.stderr)
            url = instances[0].url
            if args.only in (None, "io"):
                # 1 instance (the other two stopped), then 3.
                for other in instances[1:]:
                    other.stop()
                await reset(conn)
                results["io1"].append((await run_fanout(conn, url, secret, IO, 600))[1])
                for other in instances[1:]:
                    other.start()
                await reset(conn)
                results["io3"].append((await run_fanout(conn, url, secret, IO, 600))[1])
            if args.only in (None, "db"):
                # One instance against the floor at the same concurrency.
                for other in instances[1:]:
                    other.stop()
                await reset(conn)
                worked = (await run_fanout(conn, url, secret, DB, args.db_items))[2]
                results["db"].append(args.db_items / worked)
                await reset(conn)
                results["floor"].append(await floor(dsn, args.db_items, CONCURRENCY))
                for other in instances[1:]:
                    other.start()
            if args.only in (None, "plan"):
                # The 202 of a million items against a bare COPY of the same rows; the job
                # paused meanwhile so that the workers leave the items alone (force plans).
                await reset(conn, paused=True)
                async with httpx.AsyncClient(
                    base_url=url, headers={"Authorization": f"Bearer {secret}"}, timeout=600
                ) as client:
                    start = time.monotonic()
                    resp = await client.post(f"/cron/{DB}?force=true", json={"n": args.plan_items})
                    results["plan"].append(time.monotonic() - start)
                    if resp.status_code != 202:
                        raise RuntimeError(f"plan: {resp.status_code} {resp.text}")
                await reset(conn)
                results["copy"].append(await bare_copy(dsn, args.plan_items))
    finally:
        await conn.close()
        for instance in instances:
            instance.stop()
    io = [a / b for a, b in zip(results["io1"], results["io3"], strict=True)] or [0.0]
    db = [a / b for a, b in zip(results["db"], results["floor"], strict=True)] or [0.0]
    plan = [a / b for a, b in zip(results["plan"], results["copy"], strict=True)] or [0.0]
    for values in results.values():
        values.extend([] if values else [0.0])
    rows: list[list[Any]] = [
        ["(io) 600 items x 100 ms, 1 instance (s)", *stats(results["io1"]), ""],
        ["(io) 600 items x 100 ms, 3 instances (s)", *stats(results["io3"]), ""],
        ["(io) speed-up, 3 vs 1 instance", *stats(io), ">= 2.4"],
        [f"(db) {args.db_items:,} items, 1 instance (items/s)", *stats(results["db"]), ""],
        ["(db) floor: bare claim + write + mark (items/s)", *stats(results["floor"]), ""],
        ["(db) fan-out / floor", *stats(db), ">= 0.7"],
        [
            f"(plan) {args.plan_items:,} items planned, trigger to 202 (s)",
            *stats(results["plan"]),
            "",
        ],
        ["(plan) bare COPY of the same rows (s)", *stats(results["copy"]), ""],
        ["(plan) planning / bare COPY", *stats(plan), "<= 2"],
    ]
    print(
        table(
            ["measure", "min", "median", "max", "goal (median)"],
            [[r[0], *(round(v, 2) for v in r[1:4]), r[4]] for r in rows],
        )
    )
    return {
        "machine": machine(await server_version(server.admin_dsn)),
        "concurrency": CONCURRENCY,
        "results": results,
        "ratios": {"io": io, "db": db, "plan": plan},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=["io", "db", "plan"], default=None)
    parser.add_argument("--db-items", type=int, default=20_000)
    parser.add_argument("--plan-items", type=int, default=1_000_000)
    parser.add_argument("--workdir", default=None, help="instances' logs (a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="write the raw figures here")
    args = parser.parse_args(argv)
    with postgres(PG_SETTINGS) as server:
        output = asyncio.run(run(args, server))
    write_json(args.json, output)
    print(json.dumps(output["ratios"]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
