"""`schedule export`: the external scheduler's configuration (crontab, Kubernetes CronJobs,
vercel.json, a compose service) for the jobs with a schedule."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from cronlock.cli.common import EXIT_OK, EXIT_USAGE, OPTION, fail, load_registry, service_url, usage
from cronlock.ops.export import ExportError, export
from cronlock.settings import Settings


def add_commands(sub: Any) -> None:
    group = sub.add_parser("schedule", help="the external scheduler's configuration")
    actions = group.add_subparsers(metavar="action")
    command = actions.add_parser(
        "export", help="write crontab, Kubernetes, vercel.json or compose scheduler config"
    )
    command.add_argument(
        "--format", required=True, choices=["crontab", "kubernetes", "vercel", "compose"]
    )
    command.add_argument(
        "--url", type=service_url, help="the service's base URL as the scheduler reaches it"
    )
    command.add_argument(
        "--header-file",
        type=OPTION,
        default="/etc/cronlock/auth_header",
        help="crontab: the curl header file holding the secret",
    )
    command.add_argument(
        "--secret-name", type=OPTION, default="cronlock", help="kubernetes: the Secret"
    )
    command.add_argument(
        "--image",
        type=OPTION,
        default="curlimages/curl:8.10.1",
        help="kubernetes/compose: a curl image",
    )
    command.add_argument("--output", "-o", type=Path, help="write here instead of stdout")
    command.set_defaults(handler=cmd_schedule_export)
    group.set_defaults(handler=lambda args, settings: usage(group))


def cmd_schedule_export(args: argparse.Namespace, settings: Settings) -> int:
    registry = load_registry(settings)
    try:
        text, notes = export(
            registry,
            args.format,
            url=args.url,
            header_file=args.header_file,
            secret_name=args.secret_name,
            image=args.image,
        )
    except ExportError as exc:
        return fail(str(exc), EXIT_USAGE)
    if args.output is not None:
        try:
            args.output.write_text(text)
        except OSError as exc:
            return fail(f"cannot write {args.output}: {exc.strerror or exc}", EXIT_USAGE)
    else:
        sys.stdout.write(text)
    for note in notes:
        print(f"cronlock: {note}", file=sys.stderr)
    return EXIT_OK
