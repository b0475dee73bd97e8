"""Dynamic schedules at scale (issue 24): 100,000 schedules, 10,000 of them due in one minute,
dispatched by 3 uvicorn instances with the built-in scheduler.

1. Start lateness: 10,000 keys due at one tick, spread over 60 s (`spread=60`): how late each
   run started after its spread start (the ledger's `started_at` against tick + offset).
2. Throughput: 10,000 keys due at once (no spread), the instances' runs/s against a floor
   measured in the same run: a bare asyncpg loop doing the same transactions (the claim, then
   per row the key's advisory lock, the row and ledger checks, the ledger's insert, its finish
   and the advance) at the same concurrency. Rounds alternate product and floor.
3. Idle cost: one dispatcher poll (the claim, none due) at 1,000,000 schedules against 10,000,
   alternating between the two databases; the `/cron/jobs` counts (`schedules.stats`) beside it.
4. One `cron.schedules.set` (its own transaction) at 1,000,000 schedules.

    .venv/bin/python bench/schedules.py [--schedules 100000] [--due 10000] [--instances 3]
        [--concurrency 10] [--rounds 1] [--idle-large 1000000] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import asyncpg

from bench.common import (
    PinnedInstance,
    Server,
    create_database,
    instance_env,
    machine,
    new_secret,
    postgres,
    server_version,
    table,
    write_json,
)
from bench.schedule_jobs import SPREAD
from cronlock import Cronlock
from cronlock.core.schedules import ADVANCE_SQL, CLAIM_SQL, HOLDS_SQL, STATS_SQL, spread_offset
from cronlock.db.pool import Conn
from cronlock.settings import Settings
from cronlock.sql import qualify

JOBS = "bench.schedule_jobs"
PLAIN, SPREAD_JOB = "bench-dyn", "bench-dyn-spread"
SCHEMA = "cronlock"

# Rows not due: a daily tick at 03:00 UTC, tomorrow.
FILL_SQL = """
INSERT INTO cronlock.schedules (job, key, schedule, tz, params, next_at, due_at)
SELECT $1, k::text, '0 3 * * *', 'UTC', jsonb_build_object('tenant_id', k),
       date_trunc('day', now()) + interval '1 day 3 hours',
       date_trunc('day', now()) + interval '1 day 3 hours'
FROM generate_series($2::bigint, $3::bigint - 1) AS k
"""
# Make keys due at `tick` (a minute boundary) with a daily schedule that fires then.
DUE_SQL = """
UPDATE cronlock.schedules AS s
SET job = $1, schedule = $2, next_at = $3, due_at = d.due_at, version = s.version + 1
FROM unnest($4::text[], $5::timestamptz[]) AS d(key, due_at)
WHERE s.job = $6 AND s.key = d.key
"""
ATTEMPTED_SQL = """
SELECT EXISTS (SELECT 1 FROM cronlock.runs WHERE job = $1 AND key = $2 AND slot = $3
               AND trigger IN ('scheduled', 'backfill'))
"""
START_SQL = """
INSERT INTO cronlock.runs (job, slot, trigger, source, instance, key, started_at, params)
VALUES ($1, $2, 'scheduled', 'scheduler', 'floor', $3, now(), $4::jsonb) RETURNING id
"""
FINISH_SQL = """
UPDATE cronlock.runs SET status = 'succeeded', finished_at = now(),
    duration_ms = 1000 * extract(epoch FROM now() - started_at), result = '0'
WHERE id = $1
"""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def median(values: list[float]) -> float:
    return percentile(values, 50)


def cron_of(tick: datetime) -> str:
    return f"{tick.minute} {tick.hour} * * *"


async def connect(dsn: str) -> asyncpg.Connection:
    return await asyncpg.connect(dsn)


async def fill(dsn: str, job: str, count: int, start: int = 0) -> None:
    conn = await connect(dsn)
    try:
        step = 200_000
        for lo in range(start, start + count, step):
            await conn.execute(FILL_SQL, job, lo, min(start + count, lo + step))
        await conn.execute("VACUUM ANALYZE cronlock.schedules")
    finally:
        await conn.close()


async def make_due(
    conn: Conn, job_name: str, offsets: dict[str, timedelta], tick: datetime
) -> None:
    keys = list(offsets)
    await conn.execute(
        DUE_SQL, job_name, cron_of(tick), tick, keys, [tick + offsets[k] for k in keys], PLAIN
    )


async def wait_runs(conn: Conn, job_name: str, due: int, deadline: float) -> list[asyncpg.Record]:
    """Until every due key has a finished run (or the deadline); the runs."""
    while time.monotonic() < deadline:
        done = await conn.fetchval(
            "SELECT count(*) FROM cronlock.runs WHERE job = $1 AND status <> 'running'", job_name
        )
        if done >= due:
            break
        await asyncio.sleep(0.5)
    rows: list[asyncpg.Record] = await conn.fetch(
        "SELECT key, slot, status, instance, started_at, finished_at FROM cronlock.runs "
        "WHERE job = $1",
        job_name,
    )
    return rows


def start_instances(
    dsn: str, secret: str, args: argparse.Namespace, workdir: Path, tag: str
) -> list[PinnedInstance]:
    env = instance_env(
        dsn,
        secret,
        jobs=JOBS,
        SCHEDULER_ENABLED="true",
        SCHEDULER_CONCURRENCY=str(args.concurrency),
        DB_POOL_MAX_SIZE=str(2 * args.concurrency + 4),
        DB_STATEMENT_CACHE_SIZE=str(args.statement_cache),
        LOG_SKIPS="false",
    )
    started: list[PinnedInstance] = []
    try:
        for n in range(1, args.instances + 1):
            instance = PinnedInstance(f"{tag}-{n}", env, cpus=None, dir=workdir / f"{tag}-{n}")
            started.append(instance)
            instance.start()
    except BaseException:
        for instance in started:
            instance.stop()
        raise
    return started


def facts_of(runs: list[asyncpg.Record], due: int) -> dict[str, Any]:
    pairs = [(r["key"], r["slot"]) for r in runs]
    return {
        "runs": len(runs),
        "succeeded": sum(1 for r in runs if r["status"] == "succeeded"),
        "keys": len({r["key"] for r in runs}),
        "twice": len(pairs) - len(set(pairs)),
        "missing": due - len({r["key"] for r in runs}),
    }


# --- 1. start lateness ---------------------------------------------------------------------


async def lateness(
    server: Server, template: str, cron: Cronlock, args: argparse.Namespace, workdir: Path
) -> dict[str, Any]:
    dsn = server.dsn(await create_database(server, template=template))
    job = cron.schedules.job_of(SPREAD_JOB)
    offsets = {str(k): spread_offset(job, str(k)) for k in range(args.due)}
    instances = start_instances(dsn, new_secret(), args, workdir, "late")
    conn = await connect(dsn)
    try:
        now: datetime = await conn.fetchval("SELECT now()")
        tick = (now + timedelta(seconds=5)).replace(second=0, microsecond=0) + timedelta(minutes=1)
        await make_due(conn, SPREAD_JOB, offsets, tick)
        wait = (tick - now).total_seconds() + SPREAD + 180
        runs = await wait_runs(conn, SPREAD_JOB, args.due, time.monotonic() + wait)
    finally:
        await conn.close()
        for instance in instances:
            instance.stop()
    late = [
        (r["started_at"] - (tick + offsets[r["key"]])).total_seconds()
        for r in runs
        if r["slot"] == tick
    ]
    return {
        "tick": tick.isoformat(),
        "p50": percentile(late, 50),
        "p90": percentile(late, 90),
        "p99": percentile(late, 99),
        "max": max(late, default=float("nan")),
        "early": sum(1 for x in late if x < 0),
        **facts_of(runs, args.due),
    }


# --- 2. throughput: the product against a bare asyncpg floor ---------------------------------


async def product_round(
    server: Server, template: str, args: argparse.Namespace, workdir: Path, n: int
) -> dict[str, Any]:
    dsn = server.dsn(await create_database(server, template=template))
    instances = start_instances(dsn, new_secret(), args, workdir, f"tp{n}")
    conn = await connect(dsn)
    try:
        now: datetime = await conn.fetchval("SELECT now()")
        tick = now.replace(second=0, microsecond=0)
        zero = dict.fromkeys(map(str, range(args.due)), timedelta(0))
        async with conn.transaction():
            await make_due(conn, PLAIN, zero, tick)
            began: datetime = await conn.fetchval("SELECT now()")
        runs = await wait_runs(conn, PLAIN, args.due, time.monotonic() + 600)
    finally:
        await conn.close()
        for instance in instances:
            instance.stop()
    return throughput_of(runs, began, args.due)


def throughput_of(runs: list[asyncpg.Record], began: datetime, due: int) -> dict[str, Any]:
    ended = max((r["finished_at"] for r in runs if r["finished_at"] is not None), default=began)
    seconds = (ended - began).total_seconds()
    facts = facts_of(runs, due)
    return {"seconds": seconds, "per_s": facts["succeeded"] / seconds if seconds else 0.0, **facts}


class Floor:
    """The same transactions as a dispatched run, with nothing around them: `instances` loops,
    each claiming up to its free places and running each row on two pooled connections."""

    def __init__(self, pool: asyncpg.Pool, concurrency: int) -> None:
        self.pool = pool
        self.concurrency = concurrency
        self.claim = qualify(CLAIM_SQL, SCHEMA)
        self.holds = qualify(HOLDS_SQL, SCHEMA)
        self.advance = qualify(ADVANCE_SQL, SCHEMA)
        self.done = 0

    async def loop(self, name: str, due: int) -> None:
        running: set[asyncio.Task[None]] = set()
        while self.done < due:
            free = self.concurrency - len(running)
            rows = []
            if free > 0:
                async with self.pool.acquire() as conn:
                    rows = await conn.fetch(self.claim, [PLAIN], free, 10.0, name)
            for r in rows:
                running.add(asyncio.create_task(self.run(r)))
            if running:
                finished, running = await asyncio.wait(running, return_when="FIRST_COMPLETED")
                for task in finished:
                    task.result()
            elif not rows:
                await asyncio.sleep(0.05)
        await asyncio.gather(*running)

    async def run(self, r: asyncpg.Record) -> None:
        job, key, slot = r["job"], r["key"], r["next_at"]
        async with self.pool.acquire() as conn, conn.transaction():
            locked = await conn.fetchval(
                "SELECT pg_try_advisory_xact_lock(hashtextextended($1, 0))", f"{job}/{key}"
            )
            assert locked
            assert await conn.fetchval(self.holds, job, key, r["version"], slot)
            assert not await conn.fetchval(ATTEMPTED_SQL, job, key, slot)
            async with self.pool.acquire() as other:
                run_id = await other.fetchval(START_SQL, job, slot, key, r["params"])
            await conn.execute(FINISH_SQL, run_id)
            following = slot + timedelta(days=1)
            await conn.execute(self.advance, job, key, r["version"], slot, following, following)
        self.done += 1


async def _no_reset(conn: asyncpg.Connection) -> None:
    return None


async def floor_round(
    server: Server, template: str, args: argparse.Namespace, n: int
) -> dict[str, Any]:
    dsn = server.dsn(await create_database(server, template=template))
    size = args.instances * (2 * args.concurrency + 1)
    # No reset on release (asyncpg's default is a round trip): the product's pool has none.
    # The product's statement cache too (0 by default: PgBouncer-safe, a Parse round trip more
    # per statement).
    pool = await asyncpg.create_pool(
        dsn,
        min_size=size,
        max_size=size,
        reset=_no_reset,
        statement_cache_size=args.statement_cache,
    )
    assert pool is not None
    try:
        async with pool.acquire() as conn:
            now: datetime = await conn.fetchval("SELECT now()")
            tick = now.replace(second=0, microsecond=0)
            zero = dict.fromkeys(map(str, range(args.due)), timedelta(0))
            async with conn.transaction():
                await make_due(conn, PLAIN, zero, tick)
                began: datetime = await conn.fetchval("SELECT now()")
        floor = Floor(pool, args.concurrency)
        await asyncio.gather(*(floor.loop(f"floor-{i}", args.due) for i in range(args.instances)))
        async with pool.acquire() as conn:
            runs = await wait_runs(conn, PLAIN, args.due, time.monotonic() + 60)
    finally:
        await pool.close()
    return throughput_of(runs, began, args.due)


# --- 3 and 4. idle poll, counts, set -------------------------------------------------------


async def timed(conn: asyncpg.Connection, sql: str, *params: Any, times: int) -> list[float]:
    out = []
    for _ in range(times):
        began = time.perf_counter()
        await conn.fetch(sql, *params)
        out.append((time.perf_counter() - began) * 1000)
    return out


async def buffers(conn: asyncpg.Connection, sql: str, *params: Any) -> tuple[int, float]:
    """(shared buffers read or hit, execution ms) of one run of `sql`, rolled back."""
    tx = conn.transaction()
    await tx.start()
    try:
        plan = await conn.fetchval(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}", *params)
    finally:
        await tx.rollback()
    import json

    top = json.loads(plan)[0]
    node = top["Plan"]
    return node.get("Shared Hit Blocks", 0) + node.get("Shared Read Blocks", 0), float(
        top["Execution Time"]
    )


async def idle(server: Server, args: argparse.Namespace, cron: Cronlock) -> dict[str, Any]:
    small, large = await create_database(server), await create_database(server)
    await fill(server.dsn(small), PLAIN, args.idle_small)
    await fill(server.dsn(large), PLAIN, args.idle_large)
    claim = qualify(CLAIM_SQL, SCHEMA)
    claim_args = ([PLAIN, SPREAD_JOB], args.concurrency, 10.0, "bench")
    stats = qualify(STATS_SQL, SCHEMA)
    stats_args = ([PLAIN, SPREAD_JOB], [300.0, 300.0])
    conns = {
        name: await connect(server.dsn(db)) for name, db in (("small", small), ("large", large))
    }
    polls: dict[str, list[float]] = {"small": [], "large": []}
    counts: dict[str, list[float]] = {"small": [], "large": []}
    sets: list[float] = []
    replaces: list[float] = []
    try:
        for conn in conns.values():  # warm the caches and the statement cache
            await timed(conn, claim, *claim_args, times=20)
            await timed(conn, stats, *stats_args, times=2)
        for _ in range(args.idle_rounds):
            for name, conn in conns.items():
                polls[name] += await timed(conn, claim, *claim_args, times=100)
                counts[name] += await timed(conn, stats, *stats_args, times=3)
        plans = {name: await buffers(conn, claim, *claim_args) for name, conn in conns.items()}
        large_conn = conns["large"]
        for n in range(200):  # a new key, then the same key replaced
            for key, into in ((args.idle_large + n, sets), (n, replaces)):
                began = time.perf_counter()
                async with large_conn.transaction():
                    await cron.schedules.set(
                        large_conn, PLAIN, key, schedule="0 9 * * 1-5", tz="America/New_York"
                    )
                into.append((time.perf_counter() - began) * 1000)
        # The counts with the sets' deltas not folded yet (migration 0019), then with 10,000
        # keys due (due and late are counted from the due end of `schedules_due`).
        after_sets = median(await timed(large_conn, stats, *stats_args, times=20))
        await large_conn.execute(
            "UPDATE cronlock.schedules SET due_at = now() - interval '1 hour'"
            " WHERE job = $1 AND key::bigint < 10000",
            PLAIN,
        )
        await large_conn.execute("VACUUM ANALYZE cronlock.schedules")
        with_due = median(await timed(large_conn, stats, *stats_args, times=20))
    finally:
        for conn in conns.values():
            await conn.close()
    return {
        "poll_ms": {k: median(v) for k, v in polls.items()},
        "poll_p99_ms": {k: percentile(v, 99) for k, v in polls.items()},
        "poll_plan": plans,
        "stats_ms": {k: median(v) for k, v in counts.items()},
        "stats_after_sets_ms": after_sets,
        "stats_10k_due_ms": with_due,
        "set_ms": (median(sets), percentile(sets, 99)),
        "replace_ms": (median(replaces), percentile(replaces, 99)),
    }


# --- the run -------------------------------------------------------------------------------


async def run(args: argparse.Namespace, server: Server) -> dict[str, Any]:
    template = await create_database(server)
    dsn = server.dsn(template)
    version = await server_version(dsn)
    await fill(dsn, PLAIN, args.schedules)
    settings = Settings(_env_file=None, database_url=dsn, cron_jobs=JOBS, cron_secret=new_secret())
    cron = Cronlock(settings, housekeeping=False)
    workdir = Path(tempfile.mkdtemp(prefix="cronlock-bench-schedules-"))
    load_before = os.getloadavg()
    out: dict[str, Any] = {"args": vars(args)}
    try:
        if "lateness" in args.phases:
            out["lateness"] = await lateness(server, template, cron, args, workdir)
            print("lateness", out["lateness"], flush=True)
        if "throughput" in args.phases:
            out["product"], out["floor"] = [], []
            for n in range(args.rounds):
                out["product"].append(await product_round(server, template, args, workdir, n))
                print("product", out["product"][-1], flush=True)
                out["floor"].append(await floor_round(server, template, args, n))
                print("floor", out["floor"][-1], flush=True)
        if "idle" in args.phases:
            out["idle"] = await idle(server, args, cron)
            print("idle", out["idle"], flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out["load"] = (load_before, os.getloadavg())
    out["machine"] = machine(version)
    report(args, out)
    return out


def report(args: argparse.Namespace, out: dict[str, Any]) -> None:
    print(f"\n## Dynamic schedules ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})\n")
    before, after = out["load"]
    print(
        f"{args.schedules:,} schedules, {args.due:,} due, {args.instances} instances x "
        f"SCHEDULER_CONCURRENCY={args.concurrency}, DB_STATEMENT_CACHE_SIZE="
        f"{args.statement_cache}; load average before "
        f"{' '.join(f'{x:.2f}' for x in before)}, after {' '.join(f'{x:.2f}' for x in after)}; "
        f"nproc {out['machine']['nproc']}, PostgreSQL {out['machine']['postgresql']}\n"
    )
    if "lateness" in out:
        late = out["lateness"]
        print(
            table(
                [
                    "start lateness after spread",
                    "p50 s",
                    "p90 s",
                    "p99 s",
                    "max s",
                    "runs",
                    "keys",
                    "twice",
                    "missing",
                    "goal p99 <= 10 s",
                ],
                [
                    [
                        f"{args.due:,} keys at one tick, spread {SPREAD:g} s",
                        late["p50"],
                        late["p90"],
                        late["p99"],
                        late["max"],
                        late["runs"],
                        late["keys"],
                        late["twice"],
                        late["missing"],
                        "met" if late["p99"] <= 10 else "MISSED",
                    ]
                ],
            )
        )
        print()
    if "product" in out:
        rows = []
        for n, (p, f) in enumerate(zip(out["product"], out["floor"], strict=True)):
            ratio = p["per_s"] / f["per_s"] if f["per_s"] else 0.0
            rows.append(
                [
                    n + 1,
                    p["per_s"],
                    p["seconds"],
                    f["per_s"],
                    f["seconds"],
                    ratio,
                    p["twice"] + f["twice"],
                    p["missing"] + f["missing"],
                ]
            )
        ratios = [r[5] for r in rows]
        print(
            table(
                [
                    "round",
                    "product runs/s",
                    "product s",
                    "floor runs/s",
                    "floor s",
                    "ratio",
                    "twice",
                    "missing",
                ],
                rows,
            )
        )
        print(
            f"\nmedian ratio {median(ratios):.2f} (goal >= 0.7: "
            f"{'met' if median(ratios) >= 0.7 else 'MISSED'})\n"
        )
    if "idle" in out:
        idle = out["idle"]
        poll, plan = idle["poll_ms"], idle["poll_plan"]
        ratio = poll["large"] / poll["small"]
        print(
            table(
                [
                    "idle",
                    f"{args.idle_small:,} schedules",
                    f"{args.idle_large:,} schedules",
                    "ratio",
                    "goal",
                ],
                [
                    [
                        "one poll (claim, none due), median ms",
                        poll["small"],
                        poll["large"],
                        ratio,
                        "<= 1.5: " + ("met" if ratio <= 1.5 else "MISSED"),
                    ],
                    [
                        "one poll, p99 ms",
                        idle["poll_p99_ms"]["small"],
                        idle["poll_p99_ms"]["large"],
                        "",
                        "",
                    ],
                    [
                        "one poll, server ms (EXPLAIN ANALYZE)",
                        plan["small"][1],
                        plan["large"][1],
                        "",
                        "",
                    ],
                    ["one poll, buffers", plan["small"][0], plan["large"][0], "", ""],
                    [
                        "/cron/jobs counts (schedules.stats), median ms",
                        idle["stats_ms"]["small"],
                        idle["stats_ms"]["large"],
                        idle["stats_ms"]["large"] / idle["stats_ms"]["small"],
                        "(not a goal)",
                    ],
                ],
            )
        )
        print(
            f"\none `cron.schedules.set` in its own transaction at {args.idle_large:,} schedules: "
            f"new key median {idle['set_ms'][0]:.2f} ms (p99 {idle['set_ms'][1]:.2f}), "
            f"replacing median {idle['replace_ms'][0]:.2f} ms (p99 {idle['replace_ms'][1]:.2f})"
            f"\n/cron/jobs counts at {args.idle_large:,} schedules after those 400 sets (their "
            f"deltas not folded): median {idle['stats_after_sets_ms']:.2f} ms; with 10,000 keys "
            f"due (and late): median {idle['stats_10k_due_ms']:.2f} ms"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", type=int, default=100_000)
    parser.add_argument("--due", type=int, default=10_000)
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--statement-cache",
        type=int,
        default=0,
        help="DB_STATEMENT_CACHE_SIZE of the instances and the floor's (0: cronlock's default)",
    )
    parser.add_argument("--idle-small", type=int, default=10_000)
    parser.add_argument("--idle-large", type=int, default=1_000_000)
    parser.add_argument("--idle-rounds", type=int, default=5)
    parser.add_argument(
        "--phases", default="lateness,throughput,idle", help="comma-separated subset"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.phases = args.phases.split(",")
    with postgres() as server:
        out = asyncio.run(run(args, server))
    write_json(args.json, out)


if __name__ == "__main__":
    main()
