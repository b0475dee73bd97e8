"""The managed schedulers of `schedule export`: Google Cloud Scheduler, Upstash QStash and
Amazon EventBridge Scheduler, each in the job's own time zone and with its own credential.

- `cloud-scheduler`: `gcloud scheduler jobs create http` command lines with the OIDC flags
  (cronlock's `oidc` trigger scheme checks the Google-signed ID token they make);
- `qstash`: QStash's "create schedule" requests (`Upstash-Cron`, `CRON_TZ=` for the zone) as
  curl commands; deliveries are signed, which the `qstash` scheme checks;
- `eventbridge`: a CloudFormation template. EventBridge Scheduler cannot target an API
  destination (its targets are AWS API operations), so each schedule puts an event on a bus of
  cronlock's and a rule on that bus sends it to an API destination, whose connection adds the
  `Authorization: Bearer` header from a Secrets Manager secret (the `bearer` scheme).

None of them runs its own retries of a trigger: a retried POST of a failed run would run it
again, and that is the job's `retries=` or a person's call, as with the other formats.

A schedule these providers cannot be trusted to read as cronlock does is refused (ExportError,
exit 2), naming the job: a config that silently never triggers a job is worse than none.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from collections.abc import Collection, Sequence
from datetime import datetime
from typing import Any

from cronlock.core.jobs import Job, Registry
from cronlock.core.schedule import Schedule
from cronlock.ops.export.cron import (
    CURL_MARGIN,
    ExportError,
    describe,
    render,
    scheduled_jobs,
    trigger_url,
)

ALL_DOMS = frozenset(range(1, 32))
ALL_DOWS = frozenset(range(7))
ALL_HOURS = frozenset(range(24))
ALL_MINUTES = frozenset(range(60))
ALL_MONTHS = frozenset(range(1, 13))

DEFAULT_LOCATION = "us-central1"
# Cloud Scheduler's limits for an HTTP target's attempt deadline.
GCP_MIN_DEADLINE = 15
GCP_MAX_DEADLINE = 1800
QSTASH_API = "https://qstash.upstash.io/v2/schedules/"
# QStash waits for an answer as long as the plan allows (its "Max HTTP Connection Timeout",
# minutes to hours); `Upstash-Timeout` can only shorten that, so none is sent. A job that may
# run longer than this is named in a note, to be checked against the plan.
QSTASH_TIMEOUT_NOTE = 300
EVENT_SOURCE = "cronlock"
EVENT_DETAIL_TYPE = "cronlock trigger"
# What a Secrets Manager name may hold, and so what may stand in a dynamic reference.
_SECRET_NAME = re.compile(r"[A-Za-z0-9/_+=.@-]{1,512}")


def refused(fmt: str, job: Job, why: str) -> ExportError:
    return ExportError(
        f"{fmt} cannot trigger {job.name}: {why}; leave it out with --skip {job.name}"
    )


# --- the schedule in each provider's syntax ----------------------------------------------------


def unix_variants(fmt: str, job: Job) -> list[tuple[str, list[str]]]:
    """The job's five cron fields as one or two expressions that restrict at most one day
    field each, with a suffix naming each: their union is exactly the job's days.

    cron's OR rule (both day fields restricted, neither starting with `*`) becomes two
    expressions, one per day field; the AND rule (one starts with `*`, as in `*/2`) is
    Vixie cron's own reading, which no provider documents: refused.
    """
    assert isinstance(job.schedule, Schedule)  # intervals are written as cron (`as_cron`)
    fields = job.schedule.fields
    minute, hour, dom_text, month, dow_text = fields.text
    # A day field that names every day restricts nothing (`*/1`, `0-6`): written `*`, except
    # under the OR rule, where it makes every day match.
    dom = "*" if dom_text == "*" or fields.doms == ALL_DOMS else dom_text
    # The weekday from its set: 0-6 (a written 7 is Sunday to cron, not to every provider).
    dow = "*" if dow_text == "*" or fields.dows == ALL_DOWS else render(fields.dows)
    if fields.either_day:
        if dom == "*" or dow == "*":
            return [("", [minute, hour, "*", month, "*"])]
        return [("dom", [minute, hour, dom, month, "*"]), ("dow", [minute, hour, "*", month, dow])]
    if dom != "*" and dow != "*":
        raise refused(
            fmt,
            job,
            f"`{job.schedule.expr}` runs on days matching both day fields (cron's rule when one "
            "starts with `*`), which the provider may read as either one",
        )
    return [("", [minute, hour, dom, month, dow])]


def aws_variants(job: Job) -> list[tuple[str, str]]:
    """The job as EventBridge `cron(...)` expressions: six fields, the weekday 1-7 from
    Sunday, and `?` in the day field that is not restricted (AWS takes only one)."""
    assert isinstance(job.schedule, Schedule)  # intervals are written as cron (`as_cron`)
    fields = job.schedule.fields

    def field(values: frozenset[int], every: frozenset[int]) -> str:
        return "*" if values == every else render(values)

    minutes = field(fields.minutes, ALL_MINUTES)
    hours = field(fields.hours, ALL_HOURS)
    month = field(fields.months, ALL_MONTHS)
    found = []
    for suffix, unix in unix_variants("eventbridge", job):
        _, _, dom, _, dow = unix
        if dow != "*":
            days = ["?", field(frozenset(d + 1 for d in fields.dows), frozenset(range(1, 8)))]
        else:
            days = [field(fields.doms, ALL_DOMS) if dom != "*" else "*", "?"]
        expression = f"cron({' '.join([minutes, hours, days[0], month, days[1], '*'])})"
        if len(expression) > 256:  # ScheduleExpression's limit
            raise refused(
                "eventbridge", job, f"`{job.schedule.expr}` is over 256 characters in AWS syntax"
            )
        found.append((suffix, expression))
    return found


def resource_name(job: str, suffix: str, *, limit: int, allowed: str = "A-Za-z0-9_-") -> str:
    """`cronlock-<job>[-<suffix>]` in a provider's alphabet and length, with a short digest
    when it had to change or has a suffix, so that two entries never share a name (job `x`'s
    `dom` entry is not job `x-dom`'s)."""
    base = f"cronlock-{job}" + (f"-{suffix}" if suffix else "")
    name = re.sub(f"[^{allowed}]", "-", base)
    if suffix or name != base or len(name) > limit:
        digest = hashlib.sha256(base.encode()).hexdigest()[:6]
        name = f"{name[: limit - 7]}-{digest}"
    return name


def _body(fmt: str, job: Job) -> str | None:
    """The trigger's body: `{}` (the params' defaults, as the code says at each run) for a job
    with params; none for a job without. A job whose params have required fields cannot be
    triggered on a schedule: every tick would be a 422."""
    if job.params is None:
        return None
    required = [n for n, f in job.params.model_fields.items() if f.is_required()]
    if required:
        raise refused(
            fmt,
            job,
            f"its params ({job.params.__name__}) require {', '.join(required)}, which a "
            "scheduled trigger does not send",
        )
    return "{}"


def _auth_note(fmt: str, scheme: str, trigger_auth: Collection[str]) -> list[str]:
    if scheme in trigger_auth:
        return []
    return [
        f"TRIGGER_AUTH ({','.join(trigger_auth)}) has no {scheme}: the service answers these "
        f"{fmt} triggers 401 until it does (docs/triggering.md)"
    ]


# --- Google Cloud Scheduler ------------------------------------------------------------------

CLOUD_SCHEDULER_HEADER = """\
#!/bin/sh
# cronlock triggers for Google Cloud Scheduler, generated by
# `python -m cronlock schedule export --format cloud-scheduler`. Run it once with gcloud
# logged in to the project (`sh <this file>`); `create` fails on a job that exists: delete it
# first (`gcloud scheduler jobs delete NAME --location={location} --quiet`).
# Each job runs in its own time zone (--time-zone) and sends a Google-signed OIDC ID token
# for {account}; the service accepts it with TRIGGER_AUTH=...,oidc and
# OIDC_ALLOWED_EMAILS={account}; no secret is written anywhere. The account needs no role
# for a target outside Google; whoever runs this needs iam.serviceAccounts.actAs on it.
# --max-retry-attempts=0: a failed run is retried by the job's own retries=, not by a second
# POST. A job longer than Cloud Scheduler's 30-minute deadline is triggered with wait=false
# (202 once it holds its lock; the run goes on).
# Daylight saving: Cloud Scheduler runs on wall-clock time; a tick in the hour skipped in
# spring may not be triggered (give such a job missed="latest"), and one in the repeated
# hour may be triggered twice, which the slot check runs once.
set -e
"""


def cloud_scheduler(
    registry: Registry,
    *,
    url: str,
    location: str,
    service_account: str | None,
    audience: str | None,
    trigger_auth: Collection[str],
    oidc_emails: Collection[str],
    start: datetime,
) -> tuple[str, list[str]]:
    if service_account is None:
        if len(oidc_emails) != 1:
            raise ExportError(
                "cloud-scheduler needs --service-account EMAIL: the service account whose ID "
                "tokens cronlock accepts (one of OIDC_ALLOWED_EMAILS)"
            )
        [service_account] = oidc_emails
    notes = _auth_note("cloud-scheduler", "oidc", trigger_auth)
    if oidc_emails and service_account.lower() not in oidc_emails:
        notes.append(
            f"{service_account} is not in OIDC_ALLOWED_EMAILS: the service answers its tokens 401"
        )
    lines = [CLOUD_SCHEDULER_HEADER.format(location=location, account=service_account)]
    for job in scheduled_jobs(registry):
        assert isinstance(job.schedule, Schedule)  # intervals are written as cron (`as_cron`)
        body = _body("cloud-scheduler", job)
        deadline = int(job.timeout) + CURL_MARGIN
        uri = trigger_url(url, job)
        if deadline > GCP_MAX_DEADLINE:
            uri, deadline = f"{uri}?wait=false", 60
        lines.append(f"\n# {describe(job, start)}\n")
        for suffix, fields in unix_variants("cloud-scheduler", job):
            args = [
                "gcloud",
                "scheduler",
                "jobs",
                "create",
                "http",
                resource_name(job.name, suffix, limit=500),
                f"--location={location}",
                f"--schedule={' '.join(fields)}",
                f"--time-zone={job.schedule.tz}",
                f"--uri={uri}",
                "--http-method=POST",
                f"--oidc-service-account-email={service_account}",
                # The service compares the token's audience with OIDC_AUDIENCE when set, else
                # with the URL it was called at: the same URL, said explicitly.
                f"--oidc-token-audience={audience or uri}",
                f"--attempt-deadline={max(GCP_MIN_DEADLINE, deadline)}s",
                "--max-retry-attempts=0",
                f"--description=cronlock job {job.name}"[:500],
            ]
            if body is not None:
                args += ["--headers=Content-Type=application/json", f"--message-body={body}"]
            lines.append(" ".join(shlex.quote(a) for a in args) + "\n")
    return "".join(lines), notes


# --- Upstash QStash --------------------------------------------------------------------------

QSTASH_HEADER = """\
#!/bin/sh
# cronlock triggers as Upstash QStash schedules, generated by
# `python -m cronlock schedule export --format qstash`. Run it once with QSTASH_TOKEN set to
# the token from Upstash's console (`QSTASH_TOKEN=... sh <this file>`); the shell builtin
# printf writes it to a header file, so it is in no argv. Each schedule has a fixed id
# (Upstash-Schedule-Id), so running this again replaces the schedules instead of adding more.
# Each runs in its job's zone (CRON_TZ= in Upstash-Cron). QStash signs every delivery; the
# service checks the signature with TRIGGER_AUTH=...,qstash and QSTASH_CURRENT_SIGNING_KEY /
# QSTASH_NEXT_SIGNING_KEY, and records its message id, so a redelivery never runs a succeeded
# slot twice. Upstash-Retries: 0: a failed run is retried by the job's own retries=.
# For a QStash region other than the default, replace https://qstash.upstash.io below.
set -eu
umask 077
AUTH="${TMPDIR:-/tmp}/cronlock-qstash-auth"
trap 'rm -f "$AUTH"' EXIT
printf 'Authorization: Bearer %s\\n' "${QSTASH_TOKEN:?set QSTASH_TOKEN}" > "$AUTH"
"""


def qstash(
    registry: Registry, *, url: str, trigger_auth: Collection[str], start: datetime
) -> tuple[str, list[str]]:
    notes = _auth_note("qstash", "qstash", trigger_auth)
    lines = [QSTASH_HEADER]
    for job in scheduled_jobs(registry):
        assert isinstance(job.schedule, Schedule)  # intervals are written as cron (`as_cron`)
        body = _body("qstash", job)
        if job.timeout + CURL_MARGIN > QSTASH_TIMEOUT_NOTE:
            notes.append(
                f"{job.name}: may run {job.timeout:g} s; if your QStash plan waits less for an "
                "answer (its maximum HTTP timeout), QStash gives up on the delivery and, with "
                "Upstash-Retries: 0, does not send it again"
            )
        lines.append(f"\n# {describe(job, start)}\n")
        for suffix, fields in unix_variants("qstash", job):
            args = [
                "curl",
                "-fsS",
                "-X",
                "POST",
                "-H",
                '@"$AUTH"',
                "-H",
                f"Upstash-Cron: CRON_TZ={job.schedule.tz} {' '.join(fields)}",
                "-H",
                f"Upstash-Schedule-Id: {resource_name(job.name, suffix, limit=200)}",
                "-H",
                "Upstash-Method: POST",
                "-H",
                "Upstash-Retries: 0",
            ]
            if body is not None:
                args += ["-H", "Content-Type: application/json", "--data-raw", body]
            args.append(QSTASH_API + trigger_url(url, job))
            # `$AUTH` is the script's own variable: the one word left unquoted for the shell.
            words = [a if a == '@"$AUTH"' else shlex.quote(a) for a in args]
            lines.append(" ".join(words) + " >/dev/null\n")
    return "".join(lines), notes


# --- Amazon EventBridge ----------------------------------------------------------------------


def _logical_id(kind: str, job: str, suffix: str) -> str:
    """A CloudFormation logical id (letters and digits): readable, and unique by a digest."""
    digest = hashlib.sha256(f"{job}\0{suffix}".encode()).hexdigest()[:8]
    readable = re.sub("[^A-Za-z0-9]", "", job.title())[:40]
    return f"{kind}{readable}{suffix.title()}{digest}"


def _role(service: str, action: str, resource: str) -> dict[str, Any]:
    return {
        "Type": "AWS::IAM::Role",
        "Properties": {
            "AssumeRolePolicyDocument": {
                "Version": "2012-10-17",
                "Statement": [
                    {
                        "Effect": "Allow",
                        "Principal": {"Service": service},
                        "Action": "sts:AssumeRole",
                    }
                ],
            },
            "Policies": [
                {
                    "PolicyName": "cronlock-trigger",
                    "PolicyDocument": {
                        "Version": "2012-10-17",
                        "Statement": [
                            {
                                "Effect": "Allow",
                                "Action": action,
                                "Resource": {"Fn::GetAtt": [resource, "Arn"]},
                            }
                        ],
                    },
                }
            ],
        },
    }


def eventbridge(
    registry: Registry,
    *,
    url: str,
    secret_name: str,
    trigger_auth: Collection[str],
    start: datetime,
) -> tuple[str, list[str]]:
    """A CloudFormation template (JSON): the schedules, the bus, the rules, the API
    destination and its connection, and the two roles that let them call each other."""
    if not url.startswith("https://"):
        raise ExportError(
            "eventbridge: API destinations call HTTPS endpoints only; give --url https://..."
        )
    if not _SECRET_NAME.fullmatch(secret_name):
        raise ExportError(
            "eventbridge: --secret-name must be a Secrets Manager name (letters, digits, /_+=.@-)"
        )
    notes = [
        *_auth_note("eventbridge", "bearer", trigger_auth),
        f"the connection reads `Authorization: Bearer <secret>` from the Secrets Manager "
        f"secret {secret_name!r}, JSON key `authorization` (docs/scheduler-config.md shows how "
        "to create it without the secret in argv)",
        "deploy with: aws cloudformation deploy --template-file <this file> --stack-name "
        "cronlock-triggers --capabilities CAPABILITY_IAM",
    ]
    resources: dict[str, Any] = {
        "Connection": {
            "Type": "AWS::Events::Connection",
            "Properties": {
                "AuthorizationType": "API_KEY",
                "AuthParameters": {
                    "ApiKeyAuthParameters": {
                        "ApiKeyName": "Authorization",
                        "ApiKeyValue": (
                            f"{{{{resolve:secretsmanager:{secret_name}:SecretString:authorization}}}}"
                        ),
                    }
                },
            },
        },
        "Destination": {
            "Type": "AWS::Events::ApiDestination",
            "Properties": {
                "ConnectionArn": {"Fn::GetAtt": ["Connection", "Arn"]},
                # `*` is the job's name, from each rule's PathParameterValues.
                "InvocationEndpoint": f"{url.rstrip('/')}/cron/*",
                "HttpMethod": "POST",
            },
        },
        "Bus": {"Type": "AWS::Events::EventBus", "Properties": {"Name": "cronlock-triggers"}},
        "SchedulerRole": _role("scheduler.amazonaws.com", "events:PutEvents", "Bus"),
        "DestinationRole": _role(
            "events.amazonaws.com", "events:InvokeApiDestination", "Destination"
        ),
    }
    for job in scheduled_jobs(registry):
        assert isinstance(job.schedule, Schedule)  # intervals are written as cron (`as_cron`)
        body = _body("eventbridge", job)
        resources[_logical_id("Rule", job.name, "")] = {
            "Type": "AWS::Events::Rule",
            "Properties": {
                "Description": f"cronlock job {job.name}",
                "EventBusName": {"Ref": "Bus"},
                "EventPattern": {
                    "source": [EVENT_SOURCE],
                    "detail-type": [EVENT_DETAIL_TYPE],
                    "detail": {"job": [job.name]},
                },
                "State": "ENABLED",
                "Targets": [
                    {
                        "Id": "trigger",
                        "Arn": {"Fn::GetAtt": ["Destination", "Arn"]},
                        "RoleArn": {"Fn::GetAtt": ["DestinationRole", "Arn"]},
                        "HttpParameters": {
                            "PathParameterValues": [job.name],
                            # An API destination waits 5 s for an answer: the trigger answers
                            # 202 once the run holds its lock, and the run goes on.
                            "QueryStringParameters": {"wait": "false"},
                        },
                        # The body (else the whole event, which no job's params accept).
                        "Input": body or "{}",
                        "RetryPolicy": {"MaximumRetryAttempts": 0, "MaximumEventAgeInSeconds": 60},
                    }
                ],
            },
        }
        for suffix, expression in aws_variants(job):
            resources[_logical_id("Schedule", job.name, suffix)] = {
                "Type": "AWS::Scheduler::Schedule",
                "Properties": {
                    "Name": resource_name(job.name, suffix, limit=64, allowed="A-Za-z0-9_.-"),
                    "Description": describe(job, start)[:512],
                    "ScheduleExpression": expression,
                    "ScheduleExpressionTimezone": job.schedule.tz,
                    # OFF: at the tick, not somewhere in a window after it.
                    "FlexibleTimeWindow": {"Mode": "OFF"},
                    "State": "ENABLED",
                    "Target": {
                        "Arn": {"Fn::GetAtt": ["Bus", "Arn"]},
                        "RoleArn": {"Fn::GetAtt": ["SchedulerRole", "Arn"]},
                        "EventBridgeParameters": {
                            "DetailType": EVENT_DETAIL_TYPE,
                            "Source": EVENT_SOURCE,
                        },
                        "Input": json.dumps({"job": job.name}),
                        "RetryPolicy": {"MaximumRetryAttempts": 0, "MaximumEventAgeInSeconds": 60},
                    },
                },
            }
    template = {
        "AWSTemplateFormatVersion": "2010-09-09",
        "Description": (
            "cronlock triggers: EventBridge Scheduler puts an event on a bus per tick, in the "
            "job's zone; a rule sends it to an API destination (generated by `python -m "
            "cronlock schedule export --format eventbridge`)"
        ),
        "Resources": resources,
    }
    return json.dumps(template, indent=2) + "\n", notes


def export_managed(
    registry: Registry,
    fmt: str,
    *,
    url: str,
    secret_name: str,
    location: str,
    service_account: str | None,
    trigger_auth: Sequence[str],
    oidc_emails: Collection[str],
    oidc_audience: str | None,
    start: datetime,
) -> tuple[str, list[str]]:
    """One of the managed formats' text, and its notes."""
    if fmt == "cloud-scheduler":
        return cloud_scheduler(
            registry,
            url=url,
            location=location,
            service_account=service_account,
            audience=oidc_audience,
            trigger_auth=trigger_auth,
            oidc_emails=oidc_emails,
            start=start,
        )
    if fmt == "qstash":
        return qstash(registry, url=url, trigger_auth=trigger_auth, start=start)
    return eventbridge(
        registry, url=url, secret_name=secret_name, trigger_auth=trigger_auth, start=start
    )
