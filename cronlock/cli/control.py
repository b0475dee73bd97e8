"""`cancel`, `pause`, `resume`: an operator stops a running job or holds a job back, on every
instance; who did it is recorded (--by, CRONLOCK_OPERATOR, else user@host)."""

from __future__ import annotations

import argparse
import getpass
import json
import os
import socket
import sys
from typing import Any

from cronlock import inputs
from cronlock.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    KEY,
    OPERATOR,
    connection,
    fail,
    job_name,
    known_job,
    load_registry,
    print_json,
    when,
)
from cronlock.core import pause
from cronlock.errors import InvalidTrigger
from cronlock.ops import views as ops
from cronlock.settings import Settings, SettingsError


def add_cancel(sub: Any) -> None:
    cancel = sub.add_parser(
        "cancel",
        help="stop a running job: its holder cancels it and rolls back (after CANCEL_GRACE, "
        "the database cancels or terminates the holder's backend)",
    )
    cancel.add_argument("job", type=job_name)
    cancel.add_argument("--key", type=KEY, help="a keyed job's run to cancel (its key)")
    cancel.add_argument(
        "--terminate",
        action="store_true",
        help="end the holder's session at once (pg_terminate_backend, only while it still "
        "holds the lock) instead of asking the holder",
    )
    cancel.add_argument(
        "--wait", type=inputs.seconds, default=10.0, help="seconds to wait for the lock to go"
    )
    cancel.add_argument("--json", action="store_true")
    cancel.set_defaults(handler=cmd_cancel)


def add_pause(sub: Any) -> None:
    pausing = sub.add_parser(
        "pause", help="pause a job on every instance (force=true still runs it)"
    )
    pausing.add_argument("job", type=job_name)
    pausing.add_argument(
        "--until", type=inputs.timestamp, help="resume on its own then (ISO time with offset)"
    )
    pausing.add_argument("--note", type=inputs.text(500), help="why (shown in `jobs`)")
    pausing.add_argument("--by", type=OPERATOR, help="who (default: user@host)")
    pausing.add_argument("--json", action="store_true", help="print JSON (as the HTTP route)")
    pausing.set_defaults(handler=cmd_pause)

    resume = sub.add_parser("resume", help="resume a paused job")
    resume.add_argument("job", type=job_name)
    resume.add_argument("--json", action="store_true", help="print JSON (as the HTTP route)")
    resume.set_defaults(handler=cmd_resume)


async def cmd_cancel(args: argparse.Namespace, settings: Settings) -> int:
    registry = load_registry(settings)
    known_job(registry, args.job)
    # Waits up to --wait on purpose: ops.cancel bounds each step instead of the whole command.
    async with connection(settings, bounded=False) as conn:
        done = await ops.cancel(
            conn,
            registry,
            settings,
            args.job,
            terminate=args.terminate,
            wait=args.wait,
            key=args.key,
            by=_operator(),
        )
    if done is None:
        which = args.job if args.key is None else f"{args.job} key {args.key}"
        return fail(f"{which} is not running", EXIT_FAILED)
    first, run = done.holder, done.run
    result = {
        "job": args.job,
        "pid": first.pid,
        "instance": first.instance,
        "run_id": first.run_id,
        "key": first.job_key,
        # holder: the holder cancelled its job on request; cancel / terminate: the database-side
        # fallback (or --terminate); none: nothing reached it.
        "signal": done.how,
        "released": done.released,
        "run": run.model_dump(mode="json") if run is not None else None,
    }
    if args.json:
        print(json.dumps(result))
    elif first.kind == "fanout":
        status = run.status if run is not None else "unknown"
        print(
            f"{args.job}: cancel requested from the fan-out's workers; run {first.run_id} "
            f"{'recorded as ' + status if done.released else 'still running'}",
            file=sys.stdout if done.released else sys.stderr,
        )
    elif first.kind == "lease":
        status = run.status if run is not None else "unknown"
        print(
            f"{args.job}: cancel requested from the lease holder on {first.instance}; "
            f"run {first.run_id} {'recorded as ' + status if done.released else 'still running'}",
            file=sys.stdout if done.released else sys.stderr,
        )
    elif done.released:
        status = run.status if run is not None else "unknown"
        how = {
            "holder": f"cancelled by its holder on {first.instance}",
            "cancel": f"pg_cancel_backend sent to pid {first.pid} on {first.instance}",
            "terminate": f"pg_terminate_backend sent to pid {first.pid} on {first.instance}",
        }.get(done.how, "ended")
        print(f"{args.job}: {how}; lock released; run {first.run_id} recorded as {status}")
    else:
        print(
            f"{args.job}: asked ({done.how}), but pid {first.pid} on {first.instance} still "
            f"holds the lock after {args.wait:g} s",
            file=sys.stderr,
        )
    return EXIT_OK if done.released else EXIT_FAILED


def _operator() -> str:
    """Who runs this command, for `pause` and `cancel` to record: CRONLOCK_OPERATOR (from the
    process environment), else user@host."""
    named = os.environ.get("CRONLOCK_OPERATOR", "").strip()
    if named:
        # Checked as --by is: a byte that is not UTF-8 would otherwise be the database's
        # refusal, naming nothing.
        try:
            return OPERATOR(named)
        except argparse.ArgumentTypeError as exc:
            raise SettingsError(f"CRONLOCK_OPERATOR: {exc}") from None
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container's)
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


async def cmd_pause(args: argparse.Namespace, settings: Settings) -> int:
    known_job(load_registry(settings), args.job)
    async with connection(settings) as conn:
        try:
            state = await pause.pause(
                conn,
                settings.db_schema,
                args.job,
                by=args.by or _operator(),
                note=args.note,
                until=args.until,
            )
        except InvalidTrigger as exc:
            return fail(str(exc), EXIT_USAGE)
    if args.json:
        print_json({"job": args.job, "paused": state.model_dump(mode="json")})
        return EXIT_OK
    until = f"until {when(state.until)}" if state.until else "until resumed"
    note = f" ({state.note})" if state.note else ""
    print(f"{args.job}: paused by {state.by} since {when(state.at)}, {until}{note}")
    return EXIT_OK


async def cmd_resume(args: argparse.Namespace, settings: Settings) -> int:
    known_job(load_registry(settings), args.job)
    async with connection(settings) as conn:
        was = await pause.resume(conn, settings.db_schema, args.job)
    if args.json:
        print_json({"job": args.job, "paused": None, "was_paused": was})
    else:
        print(f"{args.job}: resumed" if was else f"{args.job}: was not paused")
    return EXIT_OK
