"""`schedule export`: the external scheduler's configuration (crontab, Kubernetes CronJobs,
vercel.json, a compose service, Google Cloud Scheduler, Upstash QStash, AWS EventBridge) for
the jobs with a schedule."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from cronlock.cli.common import (
    EXIT_OK,
    EXIT_USAGE,
    OPTION,
    fail,
    job_name,
    load_registry,
    service_url,
    usage,
)
from cronlock.ops.export import FORMATS, ExportError, export
from cronlock.settings import Settings

EPILOG = """formats:
  crontab          Debian's cron (UTC) + curl, the secret in a header file (--header-file)
  kubernetes       CronJobs with timeZone, the secret from a Secret (--secret-name)
  vercel           vercel.json's crons (UTC, GET with CRON_SECRET)
  compose          a scheduler service for docker-compose.yml
  cloud-scheduler  gcloud commands: OIDC tokens of --service-account, the job's time zone
  qstash           QStash create-schedule requests (curl; QSTASH_TOKEN from the environment)
  eventbridge      a CloudFormation template: Scheduler -> bus -> rule -> API destination,
                   the Bearer header from the Secrets Manager secret --secret-name

A job a format cannot express is refused (exit 2) with its name and why; --skip NAME leaves
it out. See docs/scheduler-config.md.
"""


def add_commands(sub: Any) -> None:
    group = sub.add_parser("schedule", help="the external scheduler's configuration")
    actions = group.add_subparsers(metavar="action")
    command = actions.add_parser(
        "export",
        help="write the scheduler's config: crontab, Kubernetes, vercel.json, compose, "
        "Cloud Scheduler, QStash or EventBridge",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    command.add_argument("--format", required=True, choices=FORMATS)
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
        "--secret-name",
        type=OPTION,
        default="cronlock",
        help="kubernetes: the Secret; eventbridge: the Secrets Manager secret",
    )
    command.add_argument(
        "--image",
        type=OPTION,
        default="curlimages/curl:8.10.1",
        help="kubernetes/compose: a curl image",
    )
    command.add_argument(
        "--location",
        type=OPTION,
        default="us-central1",
        help="cloud-scheduler: the region of the jobs",
    )
    command.add_argument(
        "--service-account",
        type=OPTION,
        metavar="EMAIL",
        help="cloud-scheduler: whose OIDC tokens the jobs send (default: OIDC_ALLOWED_EMAILS "
        "when it lists one)",
    )
    command.add_argument(
        "--skip",
        type=job_name,
        action="append",
        default=[],
        metavar="NAME",
        help="leave this job out (repeatable)",
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
            location=args.location,
            service_account=args.service_account,
            skip=args.skip,
            trigger_auth=settings.trigger_schemes,
            oidc_emails=settings.oidc_emails,
            oidc_audience=settings.oidc_audience,
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
