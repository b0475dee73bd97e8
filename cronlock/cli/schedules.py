"""`cronlock schedules set|rm|ls|show|pause|resume JOB [KEY]`: dynamic schedules from the command
line, each command one short transaction on a direct connection (cronlock/core/schedules.py holds
the rules). A refused value is exit 2 with a line naming the field; nothing is written."""

from __future__ import annotations

import argparse
import json
from typing import Any

from cronlock import inputs
from cronlock.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    KEY,
    connection,
    fail,
    job_name,
    known_job,
    load_registry,
    print_json,
    table,
    usage,
    when,
)
from cronlock.core import schedules
from cronlock.errors import InvalidSchedule
from cronlock.settings import Settings


def add_schedules_commands(sub: Any) -> None:
    group = sub.add_parser("schedules", help="dynamic schedules: one per key of a dynamic job")
    group_sub = group.add_subparsers(metavar="command")

    put = group_sub.add_parser("set", help="create or replace a key's schedule")
    put.add_argument("job", type=job_name)
    put.add_argument("key", type=KEY)
    when = put.add_mutually_exclusive_group(required=True)
    when.add_argument("--schedule", type=inputs.line(200), help="a five-field cron expression")
    when.add_argument("--every", type=inputs.int_range(1, 366 * 86400), help="seconds")
    put.add_argument("--tz", type=inputs.line(100), default="UTC", help="IANA zone (UTC)")
    put.add_argument("--params", type=inputs.text(1_000_000), help="the job's params, JSON")
    put.add_argument("--paused", action="store_true", help="set it paused")
    put.add_argument("--json", action="store_true", help="print JSON (as the HTTP route)")
    put.set_defaults(handler=cmd_set)

    for name, handler, words in (
        ("rm", cmd_rm, "remove a key's schedule"),
        ("show", cmd_show, "one key's schedule"),
        ("pause", cmd_pause, "pause a key's schedule"),
        ("resume", cmd_resume, "resume a key's schedule from its next tick"),
    ):
        one = group_sub.add_parser(name, help=words)
        one.add_argument("job", type=job_name)
        one.add_argument("key", type=KEY)
        one.add_argument("--json", action="store_true", help="print JSON (as the HTTP route)")
        one.set_defaults(handler=handler)

    ls = group_sub.add_parser("ls", help="a job's schedules by key")
    ls.add_argument("job", type=job_name)
    ls.add_argument("--prefix", type=KEY, default="", help="keys starting with this")
    ls.add_argument("--due-before", type=inputs.timestamp, help="due (not paused) before")
    ls.add_argument("--after", type=KEY, default="", help="keys after this one (the cursor)")
    ls.add_argument(
        "--limit", type=inputs.int_range(1, schedules.MAX_PAGE), default=100, help="(100)"
    )
    ls.add_argument("--json", action="store_true", help="print JSON (as the HTTP route)")
    ls.set_defaults(handler=cmd_ls)
    group.set_defaults(handler=lambda args, settings: usage(group))


def _refused(exc: InvalidSchedule) -> int:
    return fail(f"invalid {'.'.join(exc.loc) or 'value'}: {exc.reason}", EXIT_USAGE)


def _api(settings: Settings, job: str) -> schedules.Schedules:
    """The schedules of `job`'s deployment, once `job` is known to it (a job that is not
    dynamic is refused by the API, naming why)."""
    registry = load_registry(settings)
    known_job(registry, job)
    return schedules.Schedules(lambda: registry, settings)


def _key(api: schedules.Schedules, job: str, key: str) -> str | int:
    return schedules.key_from_text(api.job_of(job), key)


def _show(row: schedules.Row, as_json: bool) -> None:
    if as_json:
        print_json(row.to_json())
        return
    state = (
        "paused" if row.paused else f"next {when(row.next_at)} ({row.to_json()['next_at_local']})"
    )
    print(f"{row.job} {row.key}: {row.expr} in {row.tz}, {state}")


async def cmd_set(args: argparse.Namespace, settings: Settings) -> int:
    api = _api(settings, args.job)
    try:
        params = json.loads(args.params) if args.params is not None else None
    except ValueError as exc:
        return fail(f"invalid params: not JSON: {exc}", EXIT_USAGE)
    try:
        entry = api.check(
            args.job,
            _key(api, args.job, args.key),
            schedule=args.schedule,
            every=args.every,
            tz=args.tz,
            params=params,
            paused=args.paused,
        )
        async with connection(settings) as conn, conn.transaction():
            row = await api.write(conn, entry)
    except InvalidSchedule as exc:
        return _refused(exc)
    _show(row, args.json)
    return EXIT_OK


async def cmd_rm(args: argparse.Namespace, settings: Settings) -> int:
    api = _api(settings, args.job)
    try:
        key = _key(api, args.job, args.key)
        async with connection(settings) as conn:
            removed = await api.remove(conn, args.job, key)
    except InvalidSchedule as exc:
        return _refused(exc)
    if args.json:
        print_json({"job": args.job, "key": args.key, "removed": removed})
    elif removed:
        print(f"{args.job} {args.key}: removed")
    return EXIT_OK if removed else fail(f"{args.job} {args.key}: no schedule", EXIT_FAILED)


async def _one(args: argparse.Namespace, settings: Settings, what: str) -> int:
    api = _api(settings, args.job)
    try:
        key = _key(api, args.job, args.key)
        async with connection(settings) as conn:
            if what == "show":
                row = await api.get(conn, args.job, key)
            elif what == "pause":
                row = await api.pause(conn, args.job, key)
            else:
                row = await api.resume(conn, args.job, key)
    except InvalidSchedule as exc:
        return _refused(exc)
    if row is None:
        return fail(f"{args.job} {args.key}: no schedule", EXIT_FAILED)
    _show(row, args.json)
    return EXIT_OK


async def cmd_show(args: argparse.Namespace, settings: Settings) -> int:
    return await _one(args, settings, "show")


async def cmd_pause(args: argparse.Namespace, settings: Settings) -> int:
    return await _one(args, settings, "pause")


async def cmd_resume(args: argparse.Namespace, settings: Settings) -> int:
    return await _one(args, settings, "resume")


async def cmd_ls(args: argparse.Namespace, settings: Settings) -> int:
    api = _api(settings, args.job)
    try:
        async with connection(settings) as conn:
            found = await api.list(
                conn,
                args.job,
                prefix=args.prefix,
                due_before=args.due_before,
                after=args.after,
                limit=args.limit,
            )
    except InvalidSchedule as exc:
        return _refused(exc)
    cursor = found[-1].key if len(found) == args.limit else None
    if args.json:
        print_json({"schedules": [r.to_json() for r in found], "next": cursor})
        return EXIT_OK
    print(
        table(
            ("KEY", "SCHEDULE", "TZ", "NEXT (UTC)", "NEXT (ITS ZONE)", "PAUSED", "LAST RUN"),
            [
                (
                    r.key,
                    r.expr,
                    r.tz,
                    when(r.next_at),
                    r.to_json()["next_at_local"],
                    "yes" if r.paused else "",
                    None if r.last_run_id is None else f"{r.last_run_id} {r.last_run_status}",
                )
                for r in found
            ],
        )
    )
    if cursor is not None:
        print(f"(more: --after {cursor})")
    return EXIT_OK
