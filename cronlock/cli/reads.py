"""`jobs`, `runs`, `locks`: what an operator reads, from the database directly (the views of
cronlock/ops/views.py, as the HTTP routes show them); `--json` prints what the routes answer."""

from __future__ import annotations

import argparse
from typing import Any

from cronlock import inputs
from cronlock.cli.common import (
    EXIT_OK,
    ID,
    KEY,
    connection,
    job_name,
    known_job,
    load_registry,
    ms,
    print_json,
    seconds,
    table,
    when,
)
from cronlock.ops import views as ops
from cronlock.settings import Settings


def add_commands(sub: Any) -> None:
    jobs = sub.add_parser("jobs", help="every job: schedule, last run, running now, overdue")
    jobs.add_argument("--json", action="store_true", help="print JSON (as GET /cron/jobs)")
    jobs.set_defaults(handler=cmd_jobs)

    runs = sub.add_parser("runs", help="run history, newest first")
    runs.add_argument("--job", type=job_name)
    runs.add_argument("--key", type=KEY, help="one key's runs (keyed jobs), e.g. 42")
    runs.add_argument(
        "--status",
        choices=["running", "succeeded", "failed", "timed_out", "cancelled", "abandoned"],
    )
    runs.add_argument("--limit", type=inputs.int_range(1, 500), default=20)
    runs.add_argument("--before", type=ID, help="the `next` cursor of the previous page")
    runs.add_argument("--json", action="store_true", help="print JSON (as GET /cron/runs)")
    runs.set_defaults(handler=cmd_runs)

    locks = sub.add_parser("locks", help="advisory locks held now, mapped to jobs")
    locks.add_argument("--json", action="store_true", help="print JSON (as GET /cron/locks)")
    locks.set_defaults(handler=cmd_locks)


async def cmd_jobs(args: argparse.Namespace, settings: Settings) -> int:
    registry = load_registry(settings)
    async with connection(settings) as conn:
        await ops.sweep(conn, settings)
        async with ops.reading(conn):
            view = await ops.jobs(conn, registry)
    if args.json:
        print_json(view.model_dump(mode="json"))
        return EXIT_OK
    rows = []
    for j in view.jobs:
        last = j.last_run
        running = None
        if j.key_field is not None and j.running_keys:
            # Which keys run where: "42@i1 7@i2", the oldest first.
            running = " ".join(f"{h.key}@{h.instance}" for h in j.running_keys)
        elif j.running_on is not None:
            on = j.running_on
            # A lease run has no backend between its steps: its lease is what holds the job.
            how = "lease" if on.kind == "lease" else f"pid {on.pid}"
            running = f"{on.instance} {how} {seconds(on.held_for)}"
        rows.append(
            [
                j.name,
                f"{j.schedule} {j.tz}" if j.schedule else None,
                last.status if last else None,
                when(last.slot or last.started_at) if last else None,
                last.instance if last else None,
                ms(last.duration_ms) if last else None,
                running,
                when(j.next_slot),
                _late(j),
            ]
        )
    headers = [
        "JOB",
        "SCHEDULE",
        "LAST",
        "LAST SLOT/START",
        "ON",
        "TOOK",
        "RUNNING",
        "NEXT",
        "LATE",
    ]
    print(table(headers, rows))
    print(f"(database time {when(view.now)})")
    return EXIT_OK


def _late(j: Any) -> str | None:
    """The jobs table's LATE column: paused, waiting for a retry, overdue, or not."""
    if j.paused:
        return "PAUSED"
    if j.retry:
        return f"retry {j.retry.retry}/{j.retry.of} at {when(j.retry.at)}"
    if j.overdue:
        return "OVERDUE"
    return "no" if j.schedule else None


async def cmd_runs(args: argparse.Namespace, settings: Settings) -> int:
    registry = load_registry(settings)
    known_job(registry, args.job)
    async with connection(settings) as conn:
        await ops.sweep(conn, settings, args.job)
        async with ops.reading(conn):
            page = await ops.runs(
                conn,
                registry,
                job=args.job,
                status=args.status,
                before=args.before,
                limit=args.limit,
                key=args.key,
            )
    if args.json:
        print_json(page.model_dump(mode="json"))
        return EXIT_OK
    rows = [
        [
            r.id,
            r.job if r.key is None else f"{r.job} [{r.key}]",
            when(r.slot),
            "running" if r.running else r.status,
            r.trigger,
            r.source,
            r.instance,
            when(r.started_at),
            ms(r.duration_ms),
            (r.error or "")[:60] or None,
        ]
        for r in page.runs
    ]
    headers = ["ID", "JOB", "SLOT", "STATUS", "TRIGGER", "SOURCE", "INSTANCE", "STARTED"]
    print(table([*headers, "TOOK", "ERROR"], rows))
    if page.next is not None:
        print(f"(more: --before {page.next})")
    return EXIT_OK


async def cmd_locks(args: argparse.Namespace, settings: Settings) -> int:
    registry = load_registry(settings)
    async with connection(settings) as conn, ops.reading(conn):
        found = await ops.locks(conn, registry)
    if args.json:
        print_json(ops.LocksView(locks=found).model_dump(mode="json"))
        return EXIT_OK
    if not found:
        print("no advisory locks held")
        return EXIT_OK
    rows = [
        [
            (lk.job or "(not a job)") if lk.job_key is None else f"{lk.job} [{lk.job_key}]",
            lk.key,
            lk.pid if lk.kind == "advisory" else "lease",
            lk.instance,
            lk.state,
            seconds(lk.held_for),
            lk.run_id,
            "" if lk.granted else "waiting",
        ]
        for lk in found
    ]
    print(table(["JOB", "KEY", "PID", "HOLDER", "STATE", "HELD FOR", "RUN", ""], rows))
    return EXIT_OK
