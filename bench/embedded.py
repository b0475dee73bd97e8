"""The trigger path in a host app against the standalone service and the floor.

Three uvicorn processes pinned to the same core (one busy at a time), wrk (one thread) and
PostgreSQL on the other, and interleaved rounds of these paths, each answering 200:

  (b)  POST /bench/select1          the floor: one `SELECT 1` through the pool (bench/app.py)
  (b') POST /bench/select1          the same route as one of the host app's own
  (d)  POST /cron/bench-NN-done    the standalone service's skip, "already done"
  (d') POST /cron/bench-NN-done    the same skip through `cron.router` in the host app
                                    (bench/host_app.py: CORS and GZip middlewares, routes
                                    of its own, `include_router(cron.router)`)
  (d'') POST /cron/bench-NN-done   the same skip in a bare host app: the two lines alone
                                    (bench/host_app.py `create_bare_app`)

(d), (d') and (d'') rotate over 12 jobs, so every request takes the database probe; the instances
share one database, whose ledger holds the one run of each job for today's slot.

Goal (issue 23): (d')/(d) >= 0.9; (d)/(b) and (d')/(b) >= 1.0 (medians of per-round ratios).
(d'')/(d) is what embedding costs; (d')/(d'') what the host's own layers cost.

    .venv/bin/python bench/embedded.py [--rounds 6] [--seconds 4] [--pgbouncer] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import asyncpg
import httpx

from bench.common import (
    PERCENTILES,
    PinnedInstance,
    Server,
    create_database,
    instance_env,
    machine,
    new_secret,
    pin,
    postgres,
    server_version,
    stats,
    table,
    write_json,
    wrk,
    wrk_script,
)
from bench.trigger import DONE, SKIP_LINE, Route, Run, check_answer, cpu_seconds, share
from tests.support.cluster import PgBouncer

STANDALONE = "standalone"
HOST = "host"
BARE = "bare"
APPS = {
    STANDALONE: "bench.app:create_app",
    HOST: "bench.host_app:create_app",
    BARE: "bench.host_app:create_bare_app",
}
METRICS_PATH = {STANDALONE: "/metrics", HOST: "/ops/metrics/", BARE: "/ops/metrics/"}


@dataclass(frozen=True)
class Target:
    """A route of trigger.py's kind, served by one of the three apps."""

    route: Route
    app: str


PATHS = (
    Target(Route("b", "SELECT 1, standalone (floor)", ("/bench/select1",), "select"), STANDALONE),
    Target(Route("b'", "SELECT 1, host app's route", ("/bench/select1",), "select"), HOST),
    Target(Route("d", "already done, standalone", DONE, "already done"), STANDALONE),
    Target(Route("d'", "already done, host app", DONE, "already done"), HOST),
    Target(Route("d''", "already done, bare host app", DONE, "already done"), BARE),
)
FLOOR = "b"

# (numerator, denominator, goal or None)
RATIOS = (
    ("d'", "d", 0.9),
    ("d", "b", 1.0),
    ("d'", "b", 1.0),
    ("d'", "b'", None),
    ("b'", "b", None),
    ("d''", "d", None),
    ("d'", "d''", None),
)


async def skips(client: httpx.AsyncClient, path: str, jobs: tuple[str, ...]) -> Counter[str]:
    """An instance's skip counters for `jobs`, summed by reason."""
    response = await client.get(path)
    response.raise_for_status()
    found: Counter[str] = Counter()
    for job, reason, value in SKIP_LINE.findall(response.text):
        if job in jobs:
            found[reason] += int(float(value))
    return found


async def bench(
    dsn: str,
    *,
    label: str,
    secret: str,
    rounds: int,
    seconds: float,
    warmup: float,
    connections: int,
    server_cpus: str,
    client_cpus: str,
    workdir: Path,
    host_gc_freeze: bool = False,
) -> dict[str, list[Run]]:
    env = instance_env(dsn, secret, DB_POOL_MAX_SIZE=str(max(10, connections + 2)))
    if host_gc_freeze:
        env["HOST_GC_FREEZE"] = "1"  # bench/host_app.py: gc.freeze() after its start-up
    instances = {
        app: PinnedInstance(
            f"bench-{app}", env, cpus=server_cpus, dir=workdir / label / app, app_factory=factory
        )
        for app, factory in APPS.items()
    }
    results: dict[str, list[Run]] = {p.route.key: [] for p in PATHS}
    with contextlib.ExitStack() as running:
        for instance in instances.values():
            instance.start()
            running.callback(instance.stop)
        headers = {"Authorization": f"Bearer {secret}"}
        async with contextlib.AsyncExitStack() as stack:
            clients = {
                app: await stack.enter_async_context(
                    httpx.AsyncClient(base_url=i.url, headers=headers, timeout=30)
                )
                for app, i in instances.items()
            }
            # The one run of each done job for today's slot (through the standalone; the
            # host's first triggers are then skips too).
            for path in DONE:
                (await clients[STANDALONE].post(path)).raise_for_status()
            with contextlib.ExitStack() as files:
                scripts = {
                    p.route.key: files.enter_context(wrk_script(secret, p.route.paths))
                    for p in PATHS
                }

                async def measure(p: Target, duration: float) -> Run:
                    client, instance = clients[p.app], instances[p.app]
                    await check_answer(client, p.route)
                    jobs = p.route.jobs
                    before = await skips(client, METRICS_PATH[p.app], jobs) if jobs else None
                    cpu_before = cpu_seconds(instance.pid)
                    result = await wrk(
                        instance.url,
                        scripts[p.route.key],
                        seconds=duration,
                        connections=connections,
                        cpus=client_cpus,
                    )
                    cpu = cpu_seconds(instance.pid) - cpu_before
                    answers: Counter[str] = Counter()
                    if before is not None:
                        answers = await skips(client, METRICS_PATH[p.app], jobs)
                        answers.subtract(before)
                    if result.errors:
                        raise RuntimeError(f"({p.route.key}): {result.errors} errors in wrk")
                    cpu_us = cpu / result.requests * 1e6 if result.requests else 0.0
                    return Run(result, +answers, cpu_us)

                for p in PATHS:
                    await measure(p, warmup)
                for number in range(rounds):
                    # Rotate the order so no path always follows the same neighbour.
                    shift = number % len(PATHS)
                    for p in PATHS[shift:] + PATHS[:shift]:
                        run = await measure(p, seconds)
                        results[p.route.key].append(run)
                        print(
                            f"  {label} round {number + 1}/{rounds} ({p.route.key}) "
                            f"{run.result.rps:8.0f} req/s  "
                            f"p99 {run.result.percentiles_ms[99.0]:6.2f} ms"
                            f"  {run.cpu_us:5.0f} µs CPU/req"
                            f"  {dict(run.answers) or ''}  load {load()}",
                            file=sys.stderr,
                            flush=True,
                        )
    verify(results)
    await verify_ledger(dsn)
    return results


def verify(results: dict[str, list[Run]]) -> None:
    """Every answer wrk counted for a cron route was a skip decided by the database."""
    for p in PATHS:
        if not p.route.jobs:
            continue
        for run in results[p.route.key]:
            total = sum(run.answers.values())
            if total < run.result.requests:
                raise RuntimeError(
                    f"({p.route.key}): wrk counted {run.result.requests} answers, "
                    f"the instance {total} skips"
                )
            # A rotating route meets the in-process short-circuit ("already running") only
            # when one request stalls while a dozen others go by: a stray few on a busy machine
            # (the table shows the share); more, and the figure is not the probe's.
            if run.answers[p.route.reason] < 0.97 * total:
                raise RuntimeError(f"({p.route.key}): unexpected answers {dict(run.answers)}")


async def verify_ledger(dsn: str) -> None:
    """One run (the priming one) of each bench job, whichever app was asked."""
    conn = await asyncpg.connect(dsn, statement_cache_size=0)
    try:
        found = await conn.fetch(
            "SELECT job, count(*) AS n FROM cronlock.runs WHERE job LIKE 'bench-%' GROUP BY job"
        )
    finally:
        await conn.close()
    rows: dict[str, int] = {r["job"]: r["n"] for r in found}
    expected = {p.removeprefix("/cron/"): 1 for p in DONE}
    if rows != expected:
        raise RuntimeError(f"unexpected ledger rows: {rows}")


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def summarise(results: dict[str, list[Run]]) -> tuple[str, str, dict[str, Any]]:
    rows = []
    for p in PATHS:
        key, route = p.route.key, p.route
        runs = [r.result for r in results[key]]
        answered = f"{share(results[key], route.reason):.0%} {route.reason}" if route.jobs else "-"
        rows.append(
            [
                f"({key}) {route.label}",
                route.shown,
                *stats([r.rps for r in runs]),
                *stats([r.percentiles_ms[50.0] for r in runs]),
                *stats([r.percentiles_ms[99.0] for r in runs]),
                stats([r.cpu_us for r in results[key]])[1],
                answered,
            ]
        )
    figures = table(
        [
            "path",
            "route",
            "req/s min",
            "req/s med",
            "req/s max",
            "p50 ms min",
            "p50 med",
            "p50 max",
            "p99 ms min",
            "p99 med",
            "p99 max",
            "CPU µs/req med",
            "answers",
        ],
        rows,
    )
    ratio_rows = []
    verdict: dict[str, Any] = {}
    for top, bottom, goal in RATIOS:
        pairs = list(zip(results[top], results[bottom], strict=True))
        rps = stats([x.result.rps / y.result.rps for x, y in pairs])
        p99 = stats(
            [x.result.percentiles_ms[99.0] / y.result.percentiles_ms[99.0] for x, y in pairs]
        )
        cpu = stats([x.cpu_us / y.cpu_us for x, y in pairs if y.cpu_us])
        name = f"({top})/({bottom})"
        if goal is None:
            shown = "(not a goal)"
        else:
            met = rps[1] >= goal
            shown = f">= {goal:g}: {'met' if met else 'MISSED'}"
            verdict[name] = {"rps": rps, "p99": p99, "cpu": cpu, "goal": goal, "met": met}
        ratio_rows.append([name, *rps, *p99, cpu[1], shown])
    ratios = table(
        [
            "per-round ratio",
            "req/s min",
            "req/s med",
            "req/s max",
            "p99 min",
            "p99 med",
            "p99 max",
            "CPU/req med",
            "goal (req/s, median)",
        ],
        ratio_rows,
    )
    return figures, ratios, verdict


def raw(results: dict[str, list[Run]]) -> dict[str, Any]:
    return {
        p.route.key: {
            "label": p.route.label,
            "app": p.app,
            "route": p.route.shown,
            "rounds": [
                {
                    "rps": r.result.rps,
                    "requests": r.result.requests,
                    "answers": dict(r.answers),
                    "cpu_us_per_request": r.cpu_us,
                    "percentiles_ms": {f"{q:g}": r.result.percentiles_ms[q] for q in PERCENTILES},
                }
                for r in results[p.route.key]
            ],
        }
        for p in PATHS
    }


async def run(args: argparse.Namespace, server: Server) -> dict[str, Any]:
    if server.postmaster_pid is not None:
        pin(server.postmaster_pid, args.client_cpus)
    dbname = await create_database(server)
    dsn = server.dsn(dbname)
    secret = new_secret()
    workdir = Path(tempfile.mkdtemp(prefix="cronlock-bench-embedded-"))
    common = {
        "secret": secret,
        "rounds": args.rounds,
        "seconds": args.seconds,
        "warmup": args.warmup,
        "connections": args.connections,
        "server_cpus": args.server_cpus,
        "client_cpus": args.client_cpus,
        "workdir": workdir,
        "host_gc_freeze": args.host_gc_freeze,
    }
    output: dict[str, Any] = {
        "machine": machine(await server_version(dsn)),
        "config": {k: v for k, v in common.items() if k not in ("secret", "workdir")},
        "load_before": load(),
        "runs": {},
    }
    print(f"load average before: {load()}", file=sys.stderr, flush=True)
    try:
        variants = [("direct", dsn)]
        bouncer: PgBouncer | None = None
        if args.pgbouncer:
            upstream = urlsplit(server.admin_dsn)
            bouncer = PgBouncer(
                upstream.hostname or "127.0.0.1",
                upstream.port or 5432,
                # Two instances' pools.
                default_pool_size=2 * (args.connections + 4),
                max_client_conn=200,
                dir=workdir / "pgbouncer",
            )
            bouncer.start()
            pin(bouncer.pid, args.client_cpus)
            variants.append(("pgbouncer", bouncer.dsn(dbname)))
        try:
            for label, url in variants:
                results = await bench(url, label=label, **common)
                figures, ratios, verdict = summarise(results)
                title = "direct to PostgreSQL" if label == "direct" else "through PgBouncer"
                print(f"\n### Trigger path in a host app, {title}\n")
                print(figures)
                print()
                print(ratios)
                output["runs"][label] = {"raw": raw(results), "verdict": verdict}
        finally:
            if bouncer is not None:
                bouncer.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    output["load_after"] = load()
    print(
        f"\n{args.rounds} interleaved rounds of {args.seconds:g} s per path (after a "
        f"{args.warmup:g} s warm-up each); wrk -t1 -c{args.connections} on CPU "
        f"{args.client_cpus} with PostgreSQL, the three apps' uvicorn processes (one each) on "
        f"CPU {args.server_cpus}. Load average (1/5/15 min) before {output['load_before']}, "
        f"after {output['load_after']}."
    )
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=4.0, help="per path and round")
    parser.add_argument("--warmup", type=float, default=2.0, help="per path, once")
    parser.add_argument("--connections", type=int, default=8, help="wrk connections")
    parser.add_argument("--server-cpus", default="1", help="taskset list for uvicorn")
    parser.add_argument("--client-cpus", default="0", help="taskset list for wrk + PostgreSQL")
    parser.add_argument("--pgbouncer", action="store_true", help="also run through PgBouncer")
    parser.add_argument(
        "--host-gc-freeze", action="store_true", help="the host app calls gc.freeze() after start"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the raw figures here")
    args = parser.parse_args(argv)
    with postgres() as server:
        output = asyncio.run(run(args, server))
    write_json(args.json, output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
