"""Proof of dynamic schedules at full size (issue 24): 3 uvicorn instances with the built-in
scheduler, 20,000 schedules over 40 IANA zones (24 of them changing offset during the year),
cron expressions of which exactly 5,000 are due in one minute on the database's clock.

1. `plain`: the 3 instances run the minute; each (job, key, slot) runs exactly once, none of
   the 5,000 is missed, each starts within the job's `max_lateness` of its tick.
2. `kill`: the same on a fresh database, with two of the three instances killed (SIGKILL) once
   a fifth of the minute's runs have started: the survivor runs the rest, and retries the runs
   the dead left in flight, within `max_lateness`.

The schedules, the phase and the checker are tests/support/zones.py, which
tests/test_schedules_zones.py runs scaled down on every CI run. Prints a Markdown verdict table
and the violations; exits 1 on any.

    .venv/bin/python bench/schedules_proof.py [--schedules 20000] [--due 5000]
        [--instances 3] [--kills 2] [--phases plain,kill] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

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
from cronlock import Cronlock
from cronlock.settings import Settings
from tests.support import zones
from tests.zone_jobs import MAX_LATENESS

HEADERS = (
    "phase",
    "schedules",
    "zones (changing)",
    "due",
    "instances",
    "killed",
    "runs",
    "succeeded",
    "not succeeded",
    "retries",
    "effects",
    "duplicates",
    "missed",
    "lateness p50 s",
    "p99 s",
    "max s",
    f"max <= {MAX_LATENESS:g} s",
    "verdict",
)


def row(verdict: zones.Verdict) -> list[Any]:
    f = verdict.figures
    killed = "none"
    if f["killed"]:
        killed = f"{f['killed']} at tick + {f['killed_after']:.1f} s ({f['after_kill']:,} left)"
    statuses = ", ".join(f"{n} {s}" for s, n in sorted(f["not_succeeded"].items())) or "0"
    return [
        verdict.phase.title,
        f["schedules"],
        f"{f['zones']} ({f['zones_changing']})",
        f["due"],
        f["instances"],
        killed,
        f["runs"],
        f["succeeded"],
        statuses,
        f["retries"],
        f["effects"],
        f["twice"],
        f["missed"],
        f["p50"],
        f["p99"],
        f["max"],
        "yes" if f["max"] <= MAX_LATENESS else "NO",
        "ok" if verdict.ok else f"VIOLATED ({len(verdict.violations):,})",
    ]


def start_instances(dsn: str, secret: str, workdir: Path, tag: str, n: int) -> list[PinnedInstance]:
    """`n` instances, booting at once (each imports and connects while the others do)."""
    env = instance_env(dsn, secret, jobs=zones.JOBS, **zones.ENV)
    instances = [
        PinnedInstance(f"{tag}-{i}", env, cpus=None, dir=workdir / f"{tag}-{i}")
        for i in range(1, n + 1)
    ]
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(instance.start) for instance in instances]
    try:
        for future in futures:
            future.result()
    except BaseException:
        for instance in instances:
            instance.stop()
        raise
    return instances


async def phase(
    server: Server, args: argparse.Namespace, title: str, kills: int, workdir: Path
) -> zones.Verdict:
    dsn = server.dsn(await create_database(server))
    secret = new_secret()
    settings = Settings(_env_file=None, database_url=dsn, cron_jobs=zones.JOBS, cron_secret=secret)
    cron = Cronlock(settings, housekeeping=False)
    instances = start_instances(dsn, secret, workdir, title, args.instances)
    try:
        tick = await zones.choose_tick(dsn, args.lead)
        print(f"{title}: tick {tick.isoformat()}", flush=True)
        done = await zones.run_phase(
            title,
            cron,
            dsn,
            instances,
            count=args.schedules,
            due=args.due,
            tick=tick,
            kills=kills,
        )
    finally:
        for instance in instances:
            instance.stop()
    verdict = zones.check(done)
    print(verdict.describe(), flush=True)
    return verdict


async def run(args: argparse.Namespace, server: Server) -> tuple[list[zones.Verdict], Any]:
    version = await server_version(server.admin_dsn)
    workdir = Path(tempfile.mkdtemp(prefix="cronlock-bench-proof-"))
    load_before = os.getloadavg()
    began = time.monotonic()
    verdicts = []
    try:
        if "plain" in args.phases:
            verdicts.append(await phase(server, args, "plain", 0, workdir))
        if "kill" in args.phases:
            verdicts.append(await phase(server, args, "kill", args.kills, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    facts = {
        "load": (load_before, os.getloadavg()),
        "seconds": time.monotonic() - began,
        "machine": machine(version),
    }
    return verdicts, facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", type=int, default=20_000)
    parser.add_argument("--due", type=int, default=5_000)
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument("--kills", type=int, default=2)
    parser.add_argument(
        "--lead",
        type=float,
        default=None,
        help="seconds from choosing the tick to it, at least (default: time to set them all)",
    )
    parser.add_argument("--phases", default="plain,kill", help="comma-separated subset")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.phases = args.phases.split(",")
    if args.lead is None:
        # Setting runs at 500 to 1,000 schedules a second on the shared 2-core machine.
        args.lead = 10 + args.schedules / 400
    if not 0 <= args.kills < args.instances:
        parser.error("--kills must leave at least one instance")
    with postgres() as server:
        verdicts, facts = asyncio.run(run(args, server))
    before, after = facts["load"]
    print(
        f"\n## Dynamic schedules over 40 zones: the proof "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})\n\n"
        f"{args.schedules:,} schedules, {args.due:,} due in one minute, {args.instances} "
        f"instances, max_lateness {MAX_LATENESS:g} s; {facts['seconds']:.0f} s; load average "
        f"before {' '.join(f'{x:.2f}' for x in before)}, after "
        f"{' '.join(f'{x:.2f}' for x in after)}; nproc {facts['machine']['nproc']}, "
        f"PostgreSQL {facts['machine']['postgresql']}\n"
    )
    print(table(HEADERS, [row(v) for v in verdicts]))
    print()
    for verdict in verdicts:
        print(verdict.describe())
    write_json(
        args.json,
        {
            "args": vars(args),
            **facts,
            "phases": [
                {
                    "title": v.phase.title,
                    "tick": v.phase.tick,
                    **v.figures,
                    "violations": v.violations,
                }
                for v in verdicts
            ],
        },
    )
    sys.exit(0 if all(v.ok for v in verdicts) else 1)


if __name__ == "__main__":
    main()
