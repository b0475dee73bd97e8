"""`outbox dead`, `outbox requeue`, `outbox drain`: the email outbox, for an operator (dead
rows and their last error, putting them back) and as a dedicated sender."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from cronlock.cli.common import (
    EXIT_OK,
    EXIT_USAGE,
    ID,
    connection,
    fail,
    print_json,
    table,
    translated,
    usage,
    when,
)
from cronlock.delivery import outbox, sender
from cronlock.settings import Settings


def add_commands(sub: Any) -> None:
    group = sub.add_parser("outbox", help="the email outbox: drain, dead rows, requeue")
    actions = group.add_subparsers(metavar="action")
    dead = actions.add_parser("dead", help="dead-lettered emails with their last error")
    dead.add_argument("--limit", type=ID, default=100)
    dead.add_argument("--json", action="store_true")
    dead.set_defaults(handler=cmd_outbox_dead)
    requeue = actions.add_parser("requeue", help="put dead emails back in the queue")
    requeue.add_argument("ids", nargs="*", type=ID, help="outbox row ids")
    requeue.add_argument("--all", action="store_true", help="every dead row")
    requeue.add_argument("--json", action="store_true")
    requeue.set_defaults(handler=cmd_outbox_requeue)
    drain = actions.add_parser(
        "drain", help="run a dedicated sender until SIGTERM (or, with --once, until empty)"
    )
    drain.add_argument("--once", action="store_true", help="exit when nothing is due")
    drain.set_defaults(handler=cmd_outbox_drain)
    group.set_defaults(handler=lambda args, settings: usage(group))


async def cmd_outbox_dead(args: argparse.Namespace, settings: Settings) -> int:
    async with connection(settings) as conn:
        rows = await outbox.dead_rows(conn, schema=settings.db_schema, limit=args.limit)
    if args.json:
        print_json({"dead": [r.as_json() for r in rows]})
        return EXIT_OK
    if not rows:
        print("no dead emails")
        return EXIT_OK
    # BATCH: the batch the email was last sent in (EMAIL_BATCH_SIZE > 1), "-" if none.
    lines = [
        [
            r.id,
            r.job,
            when(r.slot),
            r.recipient,
            r.attempts,
            "-" if r.batch_id is None else r.batch_id,
            (r.last_error or "")[:60],
        ]
        for r in rows
    ]
    headers = ["ID", "JOB", "SLOT", "RECIPIENT", "ATTEMPTS", "BATCH", "LAST ERROR"]
    print(table(headers, lines))
    return EXIT_OK


async def cmd_outbox_drain(args: argparse.Namespace, settings: Settings) -> int:
    settings.check_email()
    with translated():
        await sender.run_sender(settings, once=args.once)
    return EXIT_OK


async def cmd_outbox_requeue(args: argparse.Namespace, settings: Settings) -> int:
    if bool(args.ids) == bool(args.all):
        return fail("give outbox ids, or --all", EXIT_USAGE)
    async with connection(settings) as conn:
        done = await outbox.requeue(
            conn,
            "all" if args.all else args.ids,
            schema=settings.db_schema,
            retry_window=settings.outbox_retry_window,
        )
    if args.json:
        print_json({"requeued": [r.as_json() for r in done]})
    else:
        for r in done:
            if r.batch_id is not None:
                print(f"requeued {r.id} in its batch {r.batch_id} (the batch's key, unchanged)")
                continue
            key = "a new idempotency key" if r.new_key else "its idempotency key"
            print(f"requeued {r.id} with {key} {r.idempotency_key}")
        missing = sorted(set(args.ids) - {r.id for r in done})
        if missing:
            print(f"not dead (left alone): {', '.join(map(str, missing))}", file=sys.stderr)
    return EXIT_OK
