"""`python -m cronlock schedule export`: the external scheduler's configuration, from the registry.

cronlock runs no clock of its own: something outside POSTs `/cron/<job>` on each job's
schedule, and the slot check makes extra, early, late or repeated triggers harmless. This
module writes that something's configuration:

- `crontab`: Debian's cron (no per-entry time zone) + curl with the secret in a header file;
- `kubernetes`: `CronJob` objects with `timeZone`, `concurrencyPolicy: Forbid` and the secret
  mounted from a `Secret` as a file;
- `vercel`: the `crons` of `vercel.json` (UTC only; Vercel sends GET with the secret itself);
- `compose`: the `scheduler` service of `docker-compose.yml` (a POSIX shell loop around curl).

Interval jobs (`every=`) are exported as the cron expression with exactly their ticks when
there is one (`every=300` is `*/5 * * * *`); any other interval (every 30 s, every 7 min) has
no cron form, so it is left out with a note saying so: the built-in scheduler
(SCHEDULER_ENABLED=true) runs it. A "nearest" cron entry would run some slots and leave the
others overdue.

Schedulers without time zones get, for a job in a zone with daylight saving, entries for each
UTC offset the zone has in the coming year (`utc_lines`); the header of each file says why the
extra entries do no harm.

Long on purpose: four formats from one registry share the cron conversion, the time zone offsets
of the coming year and the notes for what has no cron form; each format alone is short.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any, Literal
from urllib.parse import urlsplit

from cronlock.core.jobs import Job, Registry
from cronlock.core.schedule import Fields, Interval, Schedule
from cronlock.inputs import has_control

Format = Literal["crontab", "kubernetes", "vercel", "compose"]
FORMATS: tuple[Format, ...] = ("crontab", "kubernetes", "vercel", "compose")

DEFAULT_URLS: dict[Format, str] = {
    "crontab": "http://127.0.0.1:8000",
    "kubernetes": "http://cronlock",
    "vercel": "https://your-app.vercel.app",
    "compose": "http://lb",
}
DEFAULT_HEADER_FILE = "/etc/cronlock/auth_header"
DEFAULT_SECRET_NAME = "cronlock"  # noqa: S105 - the Secret object's name, not a secret
DEFAULT_CURL_IMAGE = "curlimages/curl:8.10.1"
COMPOSE_SECRET_PATH = "/run/secrets/cron_secret"  # noqa: S105 - a path, not a secret
K8S_SECRET_DIR = "/var/run/secrets/cronlock"  # noqa: S105 - a path, not a secret
# A trigger waits for the job's answer; a bit longer than the job's own timeout, so the
# service's clean 504 arrives before the client gives up.
CURL_MARGIN = 30


class ExportError(ValueError):
    """The registry cannot be expressed in the chosen format."""


# --- cron lines in UTC ----------------------------------------------------------------------


def _render(values: Iterable[int]) -> str:
    """A set of numbers as cron text: runs of three or more become ranges."""
    ordered = sorted(set(values))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{ordered[i]}-{ordered[j]}")
        else:
            parts.extend(str(v) for v in ordered[i : j + 1])
        i = j + 1
    return ",".join(parts)


@dataclass(frozen=True)
class CronLine:
    """One crontab-style entry in UTC. A day field of None is `*`; text fields are kept as the
    job wrote them (numbers only), sets are rendered."""

    minutes: frozenset[int]
    hours: frozenset[int]
    dom: frozenset[int] | str | None
    month: frozenset[int] | str | None
    dow: frozenset[int] | str | None

    def fields(self) -> list[str]:
        def day(value: frozenset[int] | str | None) -> str:
            if value is None:
                return "*"
            return value if isinstance(value, str) else _render(value)

        return [
            _render(self.minutes),
            _render(self.hours),
            day(self.dom),
            day(self.month),
            day(self.dow),
        ]

    def __str__(self) -> str:
        return " ".join(self.fields())

    def split_days(self) -> list[CronLine]:
        """For schedulers that refuse both day fields restricted (Vercel): cron's rule makes
        such a line fire when EITHER matches, which is exactly these two lines."""
        if self.dom is None or self.dow is None:
            return [self]
        return [replace(self, dow=None), replace(self, dom=None)]


def zone_offsets(schedule: Schedule, start: datetime, days: int = 366) -> list[timedelta]:
    """The UTC offsets `schedule`'s zone has from `start` on, ascending (so that what is
    written does not depend on the season it is written in)."""
    seen: set[timedelta] = set()
    for hour in range(days * 24 + 1):
        offset = (start + timedelta(hours=hour)).astimezone(schedule.zone).utcoffset()
        if offset is not None:
            seen.add(offset)
    return sorted(seen)


def utc_lines(schedule: Schedule, start: datetime | None = None) -> list[CronLine]:
    """Cron lines in UTC that fire at every tick of `schedule` (in its zone) in the coming
    year, for each UTC offset the zone has then.

    A tick whose local day maps to another UTC day moves its day fields by a day. Days that
    cannot be shifted exactly in cron syntax (the 1st of a month becomes "the last day of the
    previous month") are over-approximated (28-31): the lines may fire more often than the
    schedule, never less, and the service's slot check drops the extras.
    """
    fields = schedule.fields
    start = start or datetime.now(UTC)
    lines: list[CronLine] = []
    for offset in zone_offsets(schedule, start):
        shift_minutes = int(offset.total_seconds() // 60)
        by_day: dict[int, dict[int, set[int]]] = defaultdict(lambda: defaultdict(set))
        for local in fields.times:
            utc_minute = local - shift_minutes
            day, of_day = divmod(utc_minute, 1440)
            by_day[day][of_day // 60].add(of_day % 60)
        for day, hours in sorted(by_day.items()):
            days = _shifted_days(day, fields)
            # Hours that share their minutes share a line.
            grouped: dict[frozenset[int], set[int]] = defaultdict(set)
            for hour, of_hour in hours.items():
                grouped[frozenset(of_hour)].add(hour)
            for minutes, hour_set in grouped.items():
                for dom, month, dow in days:
                    lines.append(CronLine(minutes, frozenset(hour_set), dom, month, dow))
    return _merge(lines)


DayFields = tuple[
    frozenset[int] | str | None, frozenset[int] | str | None, frozenset[int] | str | None
]


def _text_fields(fields: Fields) -> DayFields:
    """The day fields as the job wrote them (names as numbers), None for `*`."""
    dom, month, dow = (None if text == "*" else text for text in fields.text[2:])
    return dom, month, dow


def _shifted_days(shift: int, fields: Fields) -> list[DayFields]:
    """The day fields for ticks whose UTC day is `shift` days from their local day."""
    if shift == 0:
        return [_text_fields(fields)]
    if shift not in (-1, 1):
        raise ExportError("a UTC offset beyond a day cannot occur")  # Python caps offsets at 24 h
    _, _, dom_text, month_text, dow_text = fields.text
    dows = None if dow_text == "*" else frozenset((d + shift) % 7 for d in fields.dows)
    months = None if month_text == "*" else fields.months
    doms = None if dom_text == "*" else fields.doms
    if doms is None and months is None:
        return [(None, None, dows)]

    def wrap(month: int) -> int:
        return (month - 1) % 12 + 1

    all_months = frozenset(range(1, 13))
    if shift < 0:
        # Local day d is UTC day d-1; local day 1 is the last day (28-31) of the month before.
        same = None if doms is None else frozenset(d - 1 for d in doms if d > 1)
        spills = doms is None or 1 in doms
        spill: DayFields = (
            frozenset(range(28, 32)),
            frozenset(wrap(m - 1) for m in (months or all_months)) if months else None,
            dows,
        )
    else:
        # Local day d is UTC day d+1; a local last day (28-31) is the 1st of the next month.
        same = None if doms is None else frozenset(d + 1 for d in doms if d < 31)
        spills = doms is None or any(d >= 28 for d in doms)
        spill = (
            frozenset({1}),
            frozenset(wrap(m + 1) for m in (months or all_months)) if months else None,
            dows,
        )
    found: list[DayFields] = []
    if same is None or same:
        found.append((same, months, dows))
    if spills:
        found.append(spill)
    return found


def _merge(lines: list[CronLine]) -> list[CronLine]:
    """Drop duplicates, then join lines that differ only in their hours."""
    unique = list(dict.fromkeys(lines))
    joined: dict[tuple[object, ...], CronLine] = {}
    for line in unique:
        key = (line.minutes, line.dom, line.month, line.dow)
        if key in joined:
            joined[key] = replace(joined[key], hours=joined[key].hours | line.hours)
        else:
            joined[key] = line
    return list(joined.values())


def _is_utc(job: Job, start: datetime) -> bool:
    assert isinstance(job.schedule, Schedule)  # intervals are written as cron (`as_cron`)
    return zone_offsets(job.schedule, start) == [timedelta(0)]


def _offset_label(offset: timedelta) -> str:
    minutes = int(offset.total_seconds() // 60)
    sign = "+" if minutes >= 0 else "-"
    return f"UTC{sign}{abs(minutes) // 60:02}:{abs(minutes) % 60:02}"


def job_lines(job: Job, start: datetime, *, split_days: bool = False) -> list[str]:
    """The UTC cron expressions that trigger `job`."""
    assert isinstance(job.schedule, Schedule)  # intervals are written as cron (`as_cron`)
    if _is_utc(job, start):
        fields = job.schedule.fields
        line = CronLine(frozenset(), frozenset(), *_text_fields(fields))
        days = line.split_days() if split_days else [line]
        return [" ".join(fields.text[:2] + tuple(d.fields()[2:])) for d in days]
    found = utc_lines(job.schedule, start)
    if split_days:
        found = [part for line in found for part in line.split_days()]
    return [str(line) for line in dict.fromkeys(found)]


def _url(base: str, job: Job) -> str:
    return f"{base.rstrip('/')}/cron/{job.name}"


def _scheduled(registry: Registry) -> list[Job]:
    # A keyed job's trigger carries its key, which only its operator knows: an entry without
    # one would be a 422 at every tick. One entry per key is theirs to write (docs/keyed-jobs.md).
    return [j for j in registry.values() if j.schedule is not None and j.key is None]


def _describe(job: Job, start: datetime) -> str:
    assert isinstance(job.schedule, Schedule)  # intervals are written as cron (`as_cron`)
    offsets = zone_offsets(job.schedule, start)
    zone = f"{job.schedule.tz} ({' / '.join(_offset_label(o) for o in offsets)})"
    return f"{job.name}: `{job.schedule.expr}` in {zone}, timeout {job.timeout:g} s"


def _lateness_note(job: Job, start: datetime) -> str | None:
    """A warning for a zoned job whose extra entries could run a missed slot late."""
    assert isinstance(job.schedule, Schedule)  # intervals are written as cron (`as_cron`)
    offsets = zone_offsets(job.schedule, start)
    if len(offsets) < 2:
        return None
    spread = max(offsets) - min(offsets)
    if job.max_lateness is not None and job.max_lateness < spread.total_seconds():
        return None
    return (
        f"note: {job.name} has no max_lateness below {spread.total_seconds():g} s, so when its "
        "real trigger fails, the other offset's entry runs that slot once, late"
    )


# --- crontab ----------------------------------------------------------------------------------

CRONTAB_HEADER = """\
# cronlock triggers for Debian's cron, generated by
# `python -m cronlock schedule export --format crontab`. Install with `crontab <this file>`.
# Every time below is UTC: Debian's cron reads them in the host's zone, so the host must be
# on UTC (timedatectl set-timezone Etc/UTC).
#
# The secret travels in a header file, never inline or in argv. Create it once, readable by
# this crontab's user only:
#   umask 077; printf 'Authorization: Bearer %s\\n' "$(cat /path/to/cron_secret)" > {header}
#
# Time zones: Debian's cron has no per-entry time zone, so a job scheduled in a zone with
# daylight saving gets entries for every UTC offset its zone has in the coming year. At any
# time of year only one of them hits the real tick; the other fires one offset-difference
# early or late, and cronlock's slot check drops it:
#   - late (after the tick): the tick's slot is done by then, so it is skipped "already done";
#   - early (before the tick, beyond the job's small early tolerance): it belongs to the
#     previous slot, which is done too ("already done"), or past max_lateness ("too late").
# Only when the real trigger failed or never arrived does an extra entry run the slot, once and
# late; give a job a max_lateness shorter than the offset difference to forbid that. A tick in
# the hour skipped in spring runs once, after the change, as classic cron does.
#
# curl -f makes an HTTP error a non-zero exit, so cron mails it; skips answer 200.
"""


def crontab_command(command: str) -> str:
    """A shell command as a crontab line's: cron turns an unescaped `%` into a newline."""
    return command.replace("%", "\\%")


def crontab(registry: Registry, *, url: str, header_file: str, start: datetime) -> str:
    out = [CRONTAB_HEADER.format(header=shlex.quote(header_file))]
    out.append("SHELL=/bin/sh\nPATH=/usr/local/bin:/usr/bin:/bin\n")
    for job in registry.values():
        if job.dynamic:
            out.append(
                f"\n# {job.name}: dynamic schedules (one per key, in the database) are "
                "dispatched by cronlock's built-in scheduler (SCHEDULER_ENABLED=true), not "
                "by cron\n"
            )
            continue
        if job.schedule is None:
            out.append(f"\n# {job.name}: no schedule, trigger on demand only\n")
            continue
        if job.key is not None:
            out.append(
                f"\n# {job.name}: keyed by {job.key}: add one entry per key, with its body\n"
            )
            continue
        out.append(f"\n# {_describe(job, start)}\n")
        note = _lateness_note(job, start)
        if note:
            out.append(f"# {note}\n")
        command = crontab_command(
            f"curl -fsS -X POST -H {shlex.quote('@' + header_file)} "
            f"--max-time {int(job.timeout) + CURL_MARGIN} {shlex.quote(_url(url, job))} >/dev/null"
        )
        for line in job_lines(job, start):
            out.append(f"{line} {command}\n")
    return "".join(out)


# --- kubernetes -------------------------------------------------------------------------------


def k8s_name(job: str) -> str:
    """A CronJob name (DNS-1123, at most 52 characters) for a job name."""
    name = re.sub(r"[^a-z0-9-]+", "-", f"cronlock-{job}".lower()).strip("-")
    if len(name) > 52:
        digest = hashlib.sha256(job.encode()).hexdigest()[:6]
        name = f"{name[:45].rstrip('-')}-{digest}"
    return name


def kubernetes(
    registry: Registry, *, url: str, secret_name: str, image: str, start: datetime
) -> str:
    header = [
        "# cronlock triggers as Kubernetes CronJobs, generated by",
        "# `python -m cronlock schedule export --format kubernetes`.",
        "# Each CronJob POSTs its job in the job's own time zone (`timeZone`), never two at once",
        f"# (`concurrencyPolicy: Forbid`); the cron secret comes from the Secret `{secret_name}`,",
        "# key `cron_secret`, mounted as a file (the one the app reads through CRON_SECRET_FILE):",
        f"#   kubectl create secret generic {secret_name} --from-file=cron_secret=./cron_secret",
        "# The shell builtin printf writes the header file, so the secret is in no argv.",
    ]
    docs = []
    for job in _scheduled(registry):
        assert isinstance(job.schedule, Schedule)  # intervals are written as cron (`as_cron`)
        header.append(f"# {_describe(job, start)}")
        script = (
            "umask 077 && "
            f"printf 'Authorization: Bearer %s\\n' \"$(cat {K8S_SECRET_DIR}/cron_secret)\" "
            "> /tmp/auth && "
            f"exec curl -fsS -X POST -H @/tmp/auth --max-time {int(job.timeout) + CURL_MARGIN} "
            f"{shlex.quote(_url(url, job))}"
        )
        deadline = job.max_lateness if job.max_lateness is not None else job.grace
        docs.append(
            {
                "apiVersion": "batch/v1",
                "kind": "CronJob",
                "metadata": {
                    "name": k8s_name(job.name),
                    "labels": {"app.kubernetes.io/name": "cronlock", "cronlock/job": job.name},
                },
                "spec": {
                    "schedule": job.schedule.expr,
                    "timeZone": job.schedule.tz,
                    "concurrencyPolicy": "Forbid",
                    # Kubernetes checks every 10 s; a later start is skipped by the slot check
                    # anyway when the job has a max_lateness.
                    "startingDeadlineSeconds": max(10, int(deadline)),
                    "successfulJobsHistoryLimit": 3,
                    "failedJobsHistoryLimit": 3,
                    "jobTemplate": {
                        "spec": {
                            # A retried POST of a failed run would run it again: a person or
                            # the next tick decides instead.
                            "backoffLimit": 0,
                            "activeDeadlineSeconds": int(job.timeout) + 2 * CURL_MARGIN,
                            "template": {
                                "spec": {
                                    "restartPolicy": "Never",
                                    "securityContext": {
                                        "runAsNonRoot": True,
                                        "runAsUser": 65534,
                                        "runAsGroup": 65534,
                                        "fsGroup": 65534,
                                    },
                                    "containers": [
                                        {
                                            "name": "trigger",
                                            "image": image,
                                            "command": ["/bin/sh", "-c", script],
                                            "volumeMounts": [
                                                {
                                                    "name": "cron-secret",
                                                    "mountPath": K8S_SECRET_DIR,
                                                    "readOnly": True,
                                                }
                                            ],
                                            "securityContext": {
                                                "allowPrivilegeEscalation": False,
                                                "capabilities": {"drop": ["ALL"]},
                                            },
                                        }
                                    ],
                                    "volumes": [
                                        {
                                            "name": "cron-secret",
                                            "secret": {
                                                "secretName": secret_name,
                                                "items": [
                                                    {"key": "cron_secret", "path": "cron_secret"}
                                                ],
                                                # Group-readable for fsGroup, nobody else.
                                                "defaultMode": 0o440,
                                            },
                                        }
                                    ],
                                }
                            },
                        }
                    },
                },
            }
        )
    body = "\n---\n".join(to_yaml(doc) for doc in docs)
    return "\n".join(header) + "\n---\n" + body


# --- vercel -----------------------------------------------------------------------------------


def vercel(registry: Registry, *, start: datetime) -> tuple[str, list[str]]:
    """vercel.json's `crons`, and notes for the person (JSON has no comments)."""
    notes = [
        "Vercel Cron sends GET with `Authorization: Bearer $CRON_SECRET`: set CRON_SECRET in the "
        "project and enable GET triggers in cronlock with CRON_ALLOW_GET=true.",
        "Vercel runs crons in UTC only: a job in a zone with daylight saving gets an entry per "
        "UTC offset; the one that misses the tick is skipped by cronlock's slot check.",
        "Merge `crons` into your vercel.json.",
    ]
    crons = []
    for job in _scheduled(registry):
        for line in job_lines(job, start, split_days=True):
            crons.append({"path": f"/cron/{job.name}", "schedule": line})
        note = _lateness_note(job, start)
        if note:
            notes.append(note)
    body = {"$schema": "https://openapi.vercel.sh/vercel.json", "crons": crons}
    return json.dumps(body, indent=2) + "\n", notes


# --- compose ----------------------------------------------------------------------------------

COMPOSE_HEADER = """\
# The `scheduler` service of docker-compose.yml, generated by
# `python -m cronlock schedule export --format compose`; merge it into the file or pass it as a
# second file (`docker compose -f docker-compose.yml -f scheduler.yml up`).
# A POSIX shell loop around curl: once a minute it matches the UTC time against each job's
# entries (the same UTC entries as the crontab export, and for the same reasons: a zoned job
# gets one per UTC offset, and cronlock's slot check drops the one that misses the tick).
# The secret is read from the compose secret `cron_secret` into a header file by the shell
# builtin printf, so it appears in no argv. Each trigger runs in the background.
"""


def _line_condition(fields: Fields) -> str:
    """The shell test that matches a UTC cron line's fields, as cron would."""
    _, _, dom_text, month_text, dow_text = fields.text

    def has(values: frozenset[int], var: str) -> str:
        return f'has {",".join(str(v) for v in sorted(values))} "${var}"'

    tests = [has(fields.minutes, "M"), has(fields.hours, "H")]
    if month_text != "*":
        tests.append(has(fields.months, "MO"))
    dom = has(fields.doms, "D") if dom_text != "*" else None
    dow = has(fields.dows, "W") if dow_text != "*" else None
    if dom is not None and dow is not None and fields.either_day:
        tests.append(f"{{ {dom} || {dow}; }}")
    else:
        tests.extend(test for test in (dom, dow) if test is not None)
    return " && ".join(tests)


def compose_script(registry: Registry, *, url: str, secret_path: str, start: datetime) -> str:
    """The scheduler's shell script (before compose's `$` escaping)."""
    lines = [
        "umask 077",
        'AUTH="${TMPDIR:-/tmp}/cronlock-auth"',
        f'printf \'Authorization: Bearer %s\\n\' "$(cat {secret_path})" > "$AUTH"',
        'has() { case ",$1," in *",$2,"*) return 0 ;; esac; return 1; }',
        "fire() {",
        '  curl -fsS -X POST -H @"$AUTH" --max-time "$2" "$3" >/dev/null'
        ' || echo "cronlock-scheduler: $1 failed" >&2',
        "}",
        'last=""',
        "while true; do",
        "  set -- $(date -u '+%Y%m%d%H%M %M %H %d %m %w')",
        '  if [ "$1" != "$last" ]; then',
        "    last=$1; M=${2#0}; H=${3#0}; D=${4#0}; MO=${5#0}; W=$6",
    ]
    for job in _scheduled(registry):
        timeout = int(job.timeout) + CURL_MARGIN
        for text in job_lines(job, start):
            condition = _line_condition(Schedule(text, "UTC").fields)
            lines.append(f"    # {job.name}: {text}")
            lines.append(
                f"    if {condition}; then fire {job.name} {timeout} "
                f"{shlex.quote(_url(url, job))} & fi"
            )
    lines += [
        "  fi",
        "  S=$(date -u +%S)",
        # Wake one second into the next minute; `last` guards against a minute seen twice.
        "  sleep $((61 - ${S#0}))",
        "done",
    ]
    return "\n".join(lines) + "\n"


def compose(registry: Registry, *, url: str, image: str, start: datetime) -> str:
    script = compose_script(registry, url=url, secret_path=COMPOSE_SECRET_PATH, start=start)
    service: dict[str, Any] = {
        "image": image,
        "restart": "unless-stopped",
        "secrets": ["cron_secret"],
        "entrypoint": ["/bin/sh", "-c"],
        # Compose interpolates `$`: `$$` is a literal dollar for the shell.
        "command": [script.replace("$", "$$")],
    }
    host = urlsplit(url).hostname or ""
    if host and "." not in host and host != "localhost":
        service["depends_on"] = [host]
    return COMPOSE_HEADER + to_yaml({"services": {"scheduler": service}})


def as_cron(registry: Registry) -> tuple[Registry, list[str]]:
    """The registry with each interval job written as its exact cron expression, and those
    without one left out; with a note for each."""
    jobs: dict[str, Job] = {}
    notes: list[str] = []
    for name, job in registry.items():
        if isinstance(job.schedule, Interval):
            cron = job.schedule.cron
            if cron is None:
                notes.append(
                    f"{name}: every {job.schedule.every} s has no cron form (cron counts whole "
                    "minutes dividing an hour, or hours dividing a day): not exported; the "
                    "built-in scheduler runs it (SCHEDULER_ENABLED=true, docs/triggering.md)"
                )
                continue
            notes.append(
                f"{name}: every {job.schedule.every} s exported as `{cron}` (the same ticks)"
            )
            job = replace(job, schedule=Schedule(cron, "UTC"))
        jobs[name] = job
    return Registry(jobs, registry.namespace, registry.schema), notes


# --- entry point ------------------------------------------------------------------------------


def export(
    registry: Registry,
    fmt: Format,
    *,
    url: str | None = None,
    header_file: str = DEFAULT_HEADER_FILE,
    secret_name: str = DEFAULT_SECRET_NAME,
    image: str = DEFAULT_CURL_IMAGE,
    start: datetime | None = None,
) -> tuple[str, list[str]]:
    """The file's text, and notes for the person running the export (stderr)."""
    start = start or datetime.now(UTC)
    base = url or DEFAULT_URLS[fmt]
    # Each goes into a file of lines (crontab, a comment, YAML): a newline there would be a
    # line of the attacker's. The shell commands quote them too (shlex.quote).
    given = {"url": base, "header file": header_file, "secret name": secret_name, "image": image}
    for what, value in given.items():
        if has_control(value):
            raise ExportError(f"the {what} contains a control character (a newline, a tab...)")
    notes = [
        f"{j.name}: dynamic (a schedule per key, in the database): dispatched by the built-in "
        "scheduler (SCHEDULER_ENABLED=true), not by an external cron; not exported"
        if j.dynamic
        else f"{j.name}: no schedule, not exported"
        for j in registry.values()
        if not j.schedule
    ]
    registry, interval_notes = as_cron(registry)
    notes += interval_notes
    if fmt == "crontab":
        return crontab(registry, url=base, header_file=header_file, start=start), notes
    if fmt == "kubernetes":
        text = kubernetes(registry, url=base, secret_name=secret_name, image=image, start=start)
        return text, notes
    if fmt == "vercel":
        text, more = vercel(registry, start=start)
        return text, notes + more
    if fmt == "compose":
        return compose(registry, url=base, image=image, start=start), notes
    raise ExportError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")


# --- a small YAML writer ----------------------------------------------------------------------
# PyYAML is a development dependency only; the service's output is simple enough to write by
# hand: block mappings and sequences, `|` for scripts, JSON-quoted strings (JSON's string syntax
# is YAML's double-quoted style, but for the characters YAML reads as line breaks or refuses).
# tests/test_export.py checks that yaml.safe_load reads every output back equal.

_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_./-]*")
# Plain words YAML 1.1 (PyYAML) reads as booleans or null.
_YAML_WORDS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null", "~"}
_UNSAFE_IN_QUOTES = re.compile("[\x7f-\x9f\u2028\u2029\ufeff\ud800-\udfff\ufffe\uffff]")


def _quoted(text: str) -> str:
    return _UNSAFE_IN_QUOTES.sub(
        lambda m: f"\\u{ord(m.group()):04x}", json.dumps(text, ensure_ascii=False)
    )


def _scalar(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return {"nan": ".nan", "inf": ".inf", "-inf": "-.inf"}[repr(value)]
        text = repr(value)  # YAML 1.1 wants a dot in a float: 1e+16 is 1.0e+16
        return text if "." in text or "e" not in text else text.replace("e", ".0e")
    if isinstance(value, dict | list) and not value:
        return "{}" if isinstance(value, dict) else "[]"
    return _quoted(str(value))


def _key(key: str) -> str:
    plain = _PLAIN_KEY.fullmatch(key) and key.lower() not in _YAML_WORDS
    return key if plain else _quoted(key)


def _literal(text: str) -> bool:
    """Whether `text` can be a `|` block: several lines, no leading space (which would set the
    block's indentation), only characters a block keeps as they are."""
    return (
        "\n" in text
        and not text[0].isspace()
        and all(ch in "\t\n" or ch.isprintable() for ch in text)
    )


def _block(text: str, indent: int) -> str:
    pad = " " * indent
    lines = text.rstrip("\n")
    ending = len(text) - len(lines)  # trailing newlines: strip, clip or keep them
    chomp = "-" if ending == 0 else "" if ending == 1 else "+"
    body = "".join(f"{pad}{line}\n" if line else "\n" for line in lines.split("\n"))
    return f"|{chomp}\n{body}" + "\n" * max(ending - 1, 0)


def to_yaml(value: Any, indent: int = 0) -> str:
    """`value` (dicts with string keys, lists, strings, numbers, booleans, None) as YAML."""
    pad = " " * indent
    if not (isinstance(value, dict | list) and value):
        return pad + _scalar(value) + "\n"
    pairs = value.items() if isinstance(value, dict) else (("-", item) for item in value)
    out = []
    for key, item in pairs:
        head = f"{pad}{_key(key)}:" if isinstance(value, dict) else f"{pad}-"
        if isinstance(item, dict) and item and isinstance(value, list):
            out.append(f"{head} {to_yaml(item, indent + 2)[indent + 2 :]}")  # - key: value
        elif isinstance(item, dict | list) and item:
            out.append(f"{head}\n{to_yaml(item, indent + 2)}")
        elif isinstance(item, str) and _literal(item):
            out.append(f"{head} {_block(item, indent + 2)}")
        else:
            out.append(f"{head} {_scalar(item)}\n")
    return "".join(out)
