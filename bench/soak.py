"""The long randomized soak (tests/support/soak.py; tests/test_soak.py runs a minute of it):
3 instances behind nginx and PgBouncer on a PostgreSQL of its own, seeded clients firing jobs
of every shape while a seeded injector kills, freezes and restarts instances, PostgreSQL and
PgBouncer every few seconds. Prints the faults injected by kind, the triggers and their
answers, the runs by status and every violation (the goal: none); exit status 1 if any.

    .venv/bin/python bench/soak.py [--minutes 10] [--seed N] [--every 3] [--clients 6]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.faults import start_cluster
from tests.support.postgres import ScratchPostgres
from tests.support.provider import Provider
from tests.support.soak import SOAK_POSTGRES_SETTINGS, soak, soak_env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long faults go on")
    parser.add_argument("--seed", type=int, help="replay a run's decisions (default: random)")
    parser.add_argument("--every", type=float, default=3.0, help="seconds between faults (mean)")
    parser.add_argument("--clients", type=int, default=6, help="concurrent trigger loops")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    seconds = args.minutes * 60
    root = Path(tempfile.mkdtemp(prefix="cronlock-bench-soak-"))
    server = ScratchPostgres(root / "pg", settings=SOAK_POSTGRES_SETTINGS)
    began = time.monotonic()
    try:
        server.start()
        with Provider() as provider:
            cluster = start_cluster(root / "cluster", server.dsn(), env=soak_env(provider))
            try:
                report = asyncio.run(
                    soak(
                        cluster,
                        server,
                        provider,
                        seed=seed,
                        seconds=seconds,
                        clients=args.clients,
                        every=args.every,
                        # One backfilled slot every two seconds or so.
                        slots=max(10, int(seconds / 2)),
                    )
                )
            finally:
                cluster.stop()
    finally:
        server.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)
    print("\n".join(report.lines()))
    print(f"took {time.monotonic() - began:.0f} s in all; replay with --seed {seed}")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "seed": seed,
                    "seconds": seconds,
                    "faults": dict(report.faults),
                    "triggers": report.triggers,
                    "answers": {str(k): v for k, v in report.answers.items()},
                    "runs": dict(report.runs),
                    "emails": report.emails,
                    "violations": report.violations,
                },
                indent=2,
            )
        )
    return 1 if report.violations else 0


if __name__ == "__main__":
    raise SystemExit(main())
