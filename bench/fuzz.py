"""The long fuzz: tests/test_fuzz.py's run (every schemathesis phase on every route of the
OpenAPI document, every answer judged: no 5xx, no leak, no failed check, links followed),
again and again with random seeds, until the time is up. Prints one row per seed and every
problem with the seed that replays it (`--seed N`).

One instance (the test jobs that succeed; the ones failing or timing out on purpose are left
out, as in the test) on a PostgreSQL of its own, or DATABASE_URL's server; each seed gets a
fresh database, so the answers depend on the seed, not on what earlier seeds left behind.

    .venv/bin/python bench/fuzz.py [--minutes 10] [--examples 200] [--seed N] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    Server,
    create_database,
    drop_database,
    instance_env,
    machine,
    new_secret,
    postgres,
    server_version,
    table,
    write_json,
)
from tests.support import fuzz
from tests.support.cluster import Instance


def one_seed(server: Server, template: str, seed: int, args: argparse.Namespace) -> fuzz.Report:
    dbname = asyncio.run(create_database(server, template=template))
    secret = new_secret()
    workdir = Path(tempfile.mkdtemp(prefix="cronlock-bench-fuzz-"))
    # The test jobs, as tests/test_fuzz.py fuzzes them (the plain service: no bench routes).
    env = instance_env(server.dsn(dbname), secret, jobs="tests.jobs")
    instance = Instance(f"fuzz-{seed}", env, dir=workdir, ready_path="/readyz")
    try:
        instance.start()
        report = fuzz.run(
            instance.url,
            seed=seed,
            max_examples=args.examples,
            max_steps=args.steps,
            headers={"Authorization": f"Bearer {secret}"},
        )
        instance.check_alive()
    finally:
        instance.stop()
        asyncio.run(drop_database(server, dbname))
        shutil.rmtree(workdir, ignore_errors=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--minutes", type=float, default=10.0, help="keep starting seeds this long")
    parser.add_argument("--examples", type=int, default=200, help="per operation and phase")
    parser.add_argument("--steps", type=int, default=20, help="stateful: steps per scenario")
    parser.add_argument("--seed", type=int, help="one run with this seed (replay a finding)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    rows: list[list[Any]] = []
    problems: list[str] = []
    runs: list[dict[str, Any]] = []
    with postgres() as server:
        template = asyncio.run(create_database(server))
        version = asyncio.run(server_version(server.dsn(template)))
        deadline = time.monotonic() + args.minutes * 60
        while True:
            seed = args.seed if args.seed is not None else random.randrange(2**32)
            began = time.monotonic()
            report = one_seed(server, template, seed, args)
            took = time.monotonic() - began
            followed = report.links_followed()
            rows.append(
                [
                    str(seed),
                    sum(report.requests.values()),
                    " ".join(f"{k}:{v}" for k, v in sorted(report.statuses.items())),
                    # A short history has no next page to follow: a count, not a problem.
                    f"{len(followed)}/{len(fuzz.LINKS)}",
                    len(report.problems),
                    took,
                ]
            )
            headers = ["seed", "requests", "statuses", "links", "problems", "s"]
            print(table(headers, rows[-1:]), flush=True)
            problems += [f"seed {seed}: {p}" for p in report.problems]
            runs.append(
                {
                    "seed": seed,
                    "requests": dict(report.requests),
                    "statuses": {str(k): v for k, v in report.statuses.items()},
                    "transitions": dict(report.transitions),
                    "problems": report.problems,
                    "seconds": round(took, 1),
                }
            )
            if args.seed is not None or time.monotonic() > deadline:
                break
    print()
    print(table(["seed", "requests", "statuses", "links", "problems", "s"], rows))
    print(f"\n{len(rows)} seeds, {sum(r[1] for r in rows)} requests, {len(problems)} problems")
    for problem in problems:
        print("  " + problem[:2000])
    write_json(args.json, {"machine": machine(version), "runs": runs, "problems": problems})
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
