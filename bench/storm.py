"""A trigger storm: 1,000 concurrent triggers of one slow job over 3 instances (optionally
behind nginx). Reports the skip latency and proves exactly one run: one ledger row, one effect.

All connections are opened first, then every request is written at once; each latency runs
from that write to the last byte of the answer.

    .venv/bin/python bench/storm.py [--triggers 1000] [--instances 3] [--hold 5] [--nginx]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
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
from tests.support.cluster import Instance, Nginx

JOB = "bench-storm"


@dataclass
class Answer:
    status: int
    kind: str  # "ran", a skip reason, or an error
    seconds: float


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[index]


async def one(port: int, request: bytes, start: asyncio.Event, deadline: float) -> Answer:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        await start.wait()
        began = time.perf_counter()
        writer.write(request)
        raw = await asyncio.wait_for(reader.read(-1), deadline)
        seconds = time.perf_counter() - began
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head else 0
    kind = f"HTTP {status}"
    if status == 200:
        data = json.loads(body)
        kind = "ran" if "processed" in data else str(data.get("reason"))
    return Answer(status, kind, seconds)


async def storm(
    ports: list[int], secret: str, triggers: int, hold: float, deadline: float
) -> list[Answer]:
    body = json.dumps({"seconds": hold}).encode()
    start = asyncio.Event()
    tasks = []
    for number in range(triggers):
        port = ports[number % len(ports)]
        request = (
            f"POST /cron/{JOB} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Authorization: Bearer {secret}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode() + body
        tasks.append(asyncio.create_task(one(port, request, start, deadline)))
    # Let every connection open (and be accepted) before the first request is written.
    await asyncio.sleep(1.0)
    start.set()
    return await asyncio.gather(*tasks)


async def proof(dsn: str) -> dict[str, Any]:
    conn = await asyncpg.connect(dsn, statement_cache_size=0)
    try:
        runs = await conn.fetch(
            "SELECT status, trigger, slot FROM cronlock.runs WHERE job = $1", JOB
        )
        effects = await conn.fetchval("SELECT count(*) FROM bench_effects WHERE job = $1", JOB)
    finally:
        await conn.close()
    return {
        "ledger_rows": len(runs),
        "succeeded": sum(1 for r in runs if r["status"] == "succeeded"),
        "effects": effects,
    }


async def run(args: argparse.Namespace, server: Server) -> dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = args.triggers + 256
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    dbname = await create_database(server)
    dsn = server.dsn(dbname)
    version = await server_version(dsn)
    secret = new_secret()
    workdir = Path(tempfile.mkdtemp(prefix="cronlock-bench-storm-"))
    instances: list[Instance] = []
    proxy: Nginx | None = None
    try:
        for number in range(1, args.instances + 1):
            started = PinnedInstance(
                f"storm-{number}", instance_env(dsn, secret), cpus=None, dir=workdir / str(number)
            )
            instances.append(started)
            started.start()
        ports = [i.port for i in instances]
        if args.nginx:
            proxy = Nginx([i.address for i in instances], dir=workdir / "nginx")
            proxy.start()
            ports = [proxy.port]
        began = time.perf_counter()
        answers = await asyncio.wait_for(
            storm(ports, secret, args.triggers, args.hold, args.hold + 40),
            args.hold + 50,
        )
        wall = time.perf_counter() - began - 1.0
        facts = await proof(dsn)
    finally:
        if proxy is not None:
            proxy.stop()
        for instance in instances:
            instance.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return report(args, answers, facts, wall, version)


def report(
    args: argparse.Namespace,
    answers: list[Answer],
    facts: dict[str, Any],
    wall: float,
    version: str,
) -> dict[str, Any]:
    kinds = Counter(a.kind for a in answers)
    rows: list[list[Any]] = []
    for kind in sorted(kinds, key=lambda k: (k != "ran", k)):
        ms = [a.seconds * 1000 for a in answers if a.kind == kind]
        rows.append([kind, kinds[kind], percentile(ms, 50), percentile(ms, 99), max(ms)])
    skips = [a.seconds * 1000 for a in answers if a.kind in ("already running", "already done")]
    rows.append(["all skips", len(skips), percentile(skips, 50), percentile(skips, 99), max(skips)])
    figures = table(["answer", "count", "p50 ms", "p99 ms", "max ms"], rows)
    exactly_once = (
        kinds["ran"] == 1
        and facts["ledger_rows"] == 1
        and facts["succeeded"] == 1
        and facts["effects"] == 1
        and len(skips) == args.triggers - 1
    )
    proof_table = table(
        ["proof", "value"],
        [
            ["answers 'ran'", kinds["ran"]],
            ["skips (already running / already done)", len(skips)],
            ["other answers (errors)", args.triggers - kinds["ran"] - len(skips)],
            ["ledger rows for the job", facts["ledger_rows"]],
            ["succeeded ledger rows", facts["succeeded"]],
            ["effects written by the job", facts["effects"]],
            ["exactly one run", "yes" if exactly_once else "NO"],
        ],
    )
    target = "nginx round-robin over" if args.nginx else "round-robin, straight to"
    print("\n### Trigger storm\n")
    print(figures)
    print()
    print(proof_table)
    print(
        f"\n{args.triggers:,} concurrent POST /cron/{JOB} ({target} {args.instances} uvicorn "
        f"instances, one connection each, written at once); the job holds its lock "
        f"{args.hold:g} s. All answered in {wall:.2f} s. PostgreSQL {version}."
    )
    return {
        "machine": machine(version),
        "answers": dict(kinds),
        "skip_p50_ms": percentile(skips, 50),
        "skip_p99_ms": percentile(skips, 99),
        "proof": facts,
        "exactly_once": exactly_once,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--triggers", type=int, default=1000)
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument("--hold", type=float, default=5.0, help="seconds the run holds its lock")
    parser.add_argument("--nginx", action="store_true", help="send the storm through nginx")
    parser.add_argument("--json", type=Path, default=None, help="write the raw figures here")
    args = parser.parse_args(argv)
    with postgres() as server:
        output = asyncio.run(run(args, server))
    write_json(args.json, output)
    return 0 if output["exactly_once"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
