"""`schedule export` for the managed schedulers: the gcloud lines, the QStash requests and the
EventBridge template are parsed back field by field, their schedules are checked tick for tick
against the job's own over a year, and what a provider cannot express is refused by name."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import stat
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from cronlock.core.jobs import Job, JobContext, Registry
from cronlock.core.schedule import Interval, Schedule
from cronlock.ops.export import ExportError, export
from cronlock.ops.export.managed import QSTASH_API, resource_name
from tests.support import TEST_SECRET

START = datetime(2026, 1, 1, tzinfo=UTC)
END = START + timedelta(days=365)
REPO = Path(__file__).resolve().parent.parent
URL = "https://cron.example.com/base"
ACCOUNT = "cron@my-project.iam.gserviceaccount.com"


class Digest(BaseModel):
    dry_run: bool = False


class Needs(BaseModel):
    customer: str


async def _noop(ctx: JobContext) -> None:
    return None


def make_job(name: str, expr: str | None, tz: str = "UTC", **kw: Any) -> Job:
    return Job(name, _noop, schedule=Schedule(expr, tz) if expr else None, **kw)


# Several zones: daylight saving (north and south, a half-hour one), none, half-hour offsets,
# a job with params, cron's OR rule, a long job, a name no provider takes as it is.
JOBS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "digest-berlin": ("0 7 * * 1-5", "Europe/Berlin", {"params": Digest, "timeout": 120}),
    "gap-berlin": ("30 2 * * *", "Europe/Berlin", {}),
    "weekdays-new-york": ("15 9 * * mon-fri", "America/New_York", {}),
    "friday13-lord-howe": ("0 0 13 * fri", "Australia/Lord_Howe", {}),  # OR rule
    "sundays-seven": ("0 6 * * 7", "America/Santiago", {}),  # 7 is Sunday
    "kolkata": ("45 5 1,15 * *", "Asia/Kolkata", {}),
    "quarterly": ("*/20 8-17 1 jan,apr,jul,oct *", "UTC", {}),
    "Odd_Name.v2": ("@hourly", "UTC", {"max_lateness": 30}),
    "long-report": ("0 2 * * *", "UTC", {"timeout": 7200}),
}


@pytest.fixture
def registry() -> Registry:
    jobs = [make_job(name, expr, tz, **kw) for name, (expr, tz, kw) in JOBS.items()]
    jobs.append(make_job("on-demand", None))
    jobs.append(Job("every-2h", _noop, schedule=Interval(7200)))
    jobs.append(Job("every-7m", _noop, schedule=Interval(420)))
    return Registry({j.name: j for j in jobs})


def ticks(schedule: Schedule) -> set[datetime]:
    found = set()
    tick = schedule.next_tick(START)
    while tick < END:
        found.add(tick)
        tick = schedule.next_tick(tick)
    return found


def assert_same_ticks(job: Job, expressions: list[str], tz: str) -> None:
    """The expressions, read by cron's rules in `tz`, tick exactly when the job does over a
    year: none missing, none extra. Each restricts at most one day field, so no scheduler can
    read it another way."""
    assert isinstance(job.schedule, Schedule)
    assert tz == job.schedule.tz
    for expr in expressions:
        _, _, dom, _, dow = expr.split()
        assert dom == "*" or dow == "*", expr
    union: set[datetime] = set()
    for expr in expressions:
        union |= ticks(Schedule(expr, tz))
    assert union == ticks(job.schedule), (job.name, expressions)


def export_text(registry: Registry, fmt: str, **kw: Any) -> tuple[str, list[str]]:
    kw.setdefault("service_account", ACCOUNT)
    return export(registry, fmt, url=URL, start=START, **kw)  # type: ignore[arg-type]


def stub(directory: Path, name: str, calls: Path) -> None:
    """An executable `name` that appends its arguments, NUL-separated, one call a line."""
    directory.mkdir(exist_ok=True)
    path = directory / name
    path.write_text(f"#!/bin/sh\nprintf '%s\\0' \"$@\" >> {calls}\nprintf '\\n' >> {calls}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def recorded(calls: Path) -> list[list[str]]:
    return [line.split("\0")[:-1] for line in calls.read_text().splitlines()]


# --- cloud-scheduler --------------------------------------------------------------------------


def gcloud_parser() -> argparse.ArgumentParser:
    """`gcloud scheduler jobs create http`'s flags as Google documents them; any other flag is
    an error here, as it would be there."""
    parser = argparse.ArgumentParser(prog="gcloud", exit_on_error=False, add_help=False)
    parser.add_argument("job")
    for flag in (
        "--location",
        "--schedule",
        "--time-zone",
        "--uri",
        "--http-method",
        "--oidc-service-account-email",
        "--oidc-token-audience",
        "--attempt-deadline",
        "--max-retry-attempts",
        "--description",
        "--headers",
        "--message-body",
    ):
        parser.add_argument(flag, required=flag in ("--location", "--schedule", "--uri"))
    return parser


def gcloud_jobs(argvs: list[list[str]]) -> list[argparse.Namespace]:
    found = []
    for argv in argvs:
        assert argv[:5] == ["gcloud", "scheduler", "jobs", "create", "http"], argv
        found.append(gcloud_parser().parse_args(argv[5:]))
    return found


def test_cloud_scheduler_lines_parse_back(registry: Registry, tmp_path: Path) -> None:
    text, notes = export_text(registry, "cloud-scheduler", location="europe-west3")
    assert TEST_SECRET not in text
    assert any("every-7m" in n and "no cron form" in n for n in notes)
    assert any("has no oidc" in n for n in notes)  # TRIGGER_AUTH is bearer only here
    # The script as the shell runs it, with gcloud stubbed: the argv gcloud would get.
    calls = tmp_path / "calls"
    stub(tmp_path / "bin", "gcloud", calls)
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"}
    subprocess.run(["sh", "-c", text], env=env, check=True, timeout=30)
    argvs = [["gcloud", *argv] for argv in recorded(calls)]
    # What the shell ran is what the file says, line by line (shlex reads it as sh does).
    lines = [shlex.split(line) for line in text.splitlines() if line.startswith("gcloud ")]
    assert argvs == lines
    by_job: dict[str, list[argparse.Namespace]] = {}
    for entry in gcloud_jobs(argvs):
        name = entry.uri.removeprefix(f"{URL}/cron/").removesuffix("?wait=false")
        by_job.setdefault(name, []).append(entry)
        assert entry.location == "europe-west3"
        assert re.fullmatch(r"[A-Za-z0-9_-]{1,500}", entry.job), entry.job
        assert entry.http_method == "POST"
        assert entry.oidc_service_account_email == ACCOUNT
        assert entry.oidc_token_audience == entry.uri  # what the service compares by default
        assert entry.max_retry_attempts == "0"
        deadline = int(entry.attempt_deadline.removesuffix("s"))
        assert 15 <= deadline <= 1800
    expected = {n for n in JOBS} | {"every-2h"}
    assert set(by_job) == expected
    names = [j.job for jobs in by_job.values() for j in jobs]
    assert len(set(names)) == len(names)
    for name, jobs in by_job.items():
        job = registry[name] if name != "every-2h" else make_job(name, "0 */2 * * *")
        assert job.schedule is not None
        assert {j.time_zone for j in jobs} == {job.schedule.tz}
        assert_same_ticks(job, [j.schedule for j in jobs], job.schedule.tz)
    [digest] = by_job["digest-berlin"]
    assert digest.headers == "Content-Type=application/json"
    assert json.loads(digest.message_body) == {}
    assert digest.attempt_deadline == "150s"  # the job's timeout and the margin
    assert by_job["weekdays-new-york"][0].message_body is None  # no params, no body
    assert len(by_job["friday13-lord-howe"]) == 2  # the 13th, and Fridays
    # Longer than Google's 30 minutes: answered once the run holds its lock.
    [long] = by_job["long-report"]
    assert long.uri == f"{URL}/cron/long-report?wait=false"
    assert long.attempt_deadline == "60s"


def test_cloud_scheduler_audience_and_account_from_the_settings(registry: Registry) -> None:
    """OIDC_AUDIENCE, when set, is the audience every token must carry; the one account
    OIDC_ALLOWED_EMAILS lists is the default --service-account; without either, refused."""
    one = Registry({"nightly": make_job("nightly", "0 3 * * *")})
    text, notes = export(
        one,
        "cloud-scheduler",
        url=URL,
        start=START,
        trigger_auth=["bearer", "oidc"],
        oidc_emails=[ACCOUNT.upper()],
        oidc_audience="https://aud.example.com",
    )
    assert notes == []
    [argv] = [shlex.split(line) for line in text.splitlines() if line.startswith("gcloud ")]
    [job] = gcloud_jobs([argv])
    assert job.oidc_token_audience == "https://aud.example.com"
    assert job.oidc_service_account_email == ACCOUNT  # as the service compares it
    with pytest.raises(ExportError, match="needs --service-account EMAIL"):
        export(one, "cloud-scheduler", start=START)
    _, notes = export(
        one, "cloud-scheduler", start=START, service_account="x@y.z", oidc_emails=[ACCOUNT]
    )
    assert any("x@y.z is not in OIDC_ALLOWED_EMAILS" in n for n in notes)


# --- qstash -----------------------------------------------------------------------------------


def curl_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="curl", exit_on_error=False, add_help=False)
    for flag in ("-f", "-s", "-S"):
        parser.add_argument(flag, action="store_true")
    parser.add_argument("-X", dest="method")
    parser.add_argument("-H", dest="headers", action="append", default=[])
    parser.add_argument("--data-raw", dest="body")
    parser.add_argument("url")
    return parser


def qstash_requests(argvs: list[list[str]]) -> list[dict[str, Any]]:
    """Each curl call as the request QStash receives: method, URL, headers, body."""
    found = []
    for argv in argvs:
        args = curl_parser().parse_args(argv)
        assert (args.f, args.s, args.S) == (True, True, True)  # fail on an HTTP error, quietly
        headers: dict[str, str] = {}
        files = [h for h in args.headers if h.startswith("@")]
        for header in [h for h in args.headers if not h.startswith("@")]:
            name, _, value = header.partition(": ")
            assert name not in headers, header
            headers[name] = value
        found.append(
            {"method": args.method, "url": args.url, "headers": headers, "body": args.body}
        )
        assert len(files) == 1  # the token's header file
    return found


def test_qstash_requests_parse_back(registry: Registry, tmp_path: Path) -> None:
    text, notes = export_text(registry, "qstash")
    assert any("has no qstash" in n for n in notes)
    assert any(n.startswith("long-report: may run 7200 s; if your QStash plan") for n in notes)
    assert not any(n.startswith("digest-berlin:") for n in notes)
    # Run the script with curl stubbed: the token reaches a header file, never an argv.
    calls = tmp_path / "calls"
    stub(tmp_path / "bin", "curl", calls)
    bin_curl = tmp_path / "bin" / "curl"
    bin_curl.write_text(
        bin_curl.read_text().replace("#!/bin/sh\n", f'#!/bin/sh\ncat "${{5#@}}" >> {tmp_path}/h\n')
    )
    token = "qstash-token-never-in-argv"
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "QSTASH_TOKEN": token}
    env["TMPDIR"] = str(tmp_path)
    subprocess.run(["sh", "-c", text], env=env, check=True, timeout=30)
    argvs = recorded(calls)
    assert all(token not in arg for argv in argvs for arg in argv)
    auth_lines = (tmp_path / "h").read_text().splitlines()
    assert auth_lines == [f"Authorization: Bearer {token}"] * len(argvs)
    assert not (tmp_path / "cronlock-qstash-auth").exists()  # removed on exit
    assert [a[4] for a in argvs] == [f"@{tmp_path}/cronlock-qstash-auth"] * len(argvs)

    by_job: dict[str, list[dict[str, Any]]] = {}
    ids = []
    for request in qstash_requests(argvs):
        assert request["method"] == "POST"
        assert request["url"].startswith(QSTASH_API + URL + "/cron/")
        name = request["url"].removeprefix(QSTASH_API + URL + "/cron/")
        by_job.setdefault(name, []).append(request)
        headers = request["headers"]
        assert headers["Upstash-Method"] == "POST"
        assert headers["Upstash-Retries"] == "0"
        ids.append(headers["Upstash-Schedule-Id"])
        job = registry[name] if name != "every-2h" else make_job(name, "0 */2 * * *")
        # It can only shorten the plan's own limit, and a trigger waits for the whole run.
        assert "Upstash-Timeout" not in headers
        if job.params is None:
            assert request["body"] is None
            assert "Content-Type" not in headers
        else:
            assert headers["Content-Type"] == "application/json"
            assert json.loads(request["body"]) == {}
    assert set(by_job) == {n for n in JOBS} | {"every-2h"}
    assert len(set(ids)) == len(ids)  # re-running replaces, never merges two jobs
    assert all(re.fullmatch(r"[A-Za-z0-9_-]+", i) for i in ids)
    for name, requests in by_job.items():
        job = registry[name] if name != "every-2h" else make_job(name, "0 */2 * * *")
        assert job.schedule is not None
        crons = []
        for request in requests:
            m = re.fullmatch(r"CRON_TZ=(\S+) (.+)", request["headers"]["Upstash-Cron"])
            assert m, request
            assert m.group(1) == job.schedule.tz
            crons.append(m.group(2))
        assert_same_ticks(job, crons, job.schedule.tz)
    # Sunday written 7 is 0 for QStash, as in every cron's 0-6.
    [sundays] = by_job["sundays-seven"]
    assert sundays["headers"]["Upstash-Cron"] == "CRON_TZ=America/Santiago 0 6 * * 0"


def test_qstash_script_needs_the_token(registry: Registry, tmp_path: Path) -> None:
    text, _ = export_text(registry, "qstash")
    calls = tmp_path / "calls"
    stub(tmp_path / "bin", "curl", calls)
    done = subprocess.run(
        ["sh", "-c", text],
        env={"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    assert done.returncode != 0
    assert "QSTASH_TOKEN" in done.stderr
    assert not calls.exists()


# --- eventbridge ------------------------------------------------------------------------------

AWS_NAME = re.compile(r"[0-9a-zA-Z_.-]{1,64}")


def aws_to_unix(expression: str) -> str:
    """An EventBridge `cron(...)` as the five cron fields cronlock reads, after checking AWS's
    own rules: six fields, exactly one day field `?`, weekdays 1-7 (Sunday 1), any year."""
    m = re.fullmatch(r"cron\((.*)\)", expression)
    assert m, expression
    fields = m.group(1).split(" ")
    assert len(fields) == 6, expression
    minute, hour, dom, month, dow, year = fields
    assert year == "*"
    assert (dom == "?") != (dow == "?"), expression  # AWS: one of them, never both
    assert all(re.fullmatch(r"[0-9,*?-]+", f) for f in fields), expression
    if dow == "?":
        return f"{minute} {hour} {dom} {month} *"

    def shift(token: str) -> str:
        numbers = token.split("-")
        assert all(1 <= int(n) <= 7 for n in numbers), expression
        return "-".join(str(int(n) - 1) for n in numbers)

    days = "*" if dow == "*" else ",".join(shift(t) for t in dow.split(","))
    return f"{minute} {hour} * {month} {days}"


def refs(value: Any) -> set[str]:
    """The logical ids a template value points at (Ref, Fn::GetAtt)."""
    if isinstance(value, dict):
        found = {value["Ref"]} if "Ref" in value else set()
        if "Fn::GetAtt" in value:
            found.add(value["Fn::GetAtt"][0])
        return found.union(*(refs(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(refs(v) for v in value))
    return set()


def test_eventbridge_template_parses_back(registry: Registry) -> None:
    text, notes = export_text(registry, "eventbridge", secret_name="prod/cronlock")
    assert TEST_SECRET not in text
    assert not any("has no bearer" in n for n in notes)  # bearer is on by default
    template = json.loads(text)
    resources: dict[str, Any] = template["Resources"]
    assert refs(resources) <= set(resources)  # every reference resolves in the template
    assert all(re.fullmatch(r"[A-Za-z0-9]{1,255}", lid) for lid in resources)
    by_type: dict[str, list[dict[str, Any]]] = {}
    for resource in resources.values():
        by_type.setdefault(resource["Type"], []).append(resource["Properties"])

    [connection] = by_type["AWS::Events::Connection"]
    assert connection["AuthorizationType"] == "API_KEY"
    api_key = connection["AuthParameters"]["ApiKeyAuthParameters"]
    assert api_key == {
        "ApiKeyName": "Authorization",
        "ApiKeyValue": "{{resolve:secretsmanager:prod/cronlock:SecretString:authorization}}",
    }
    [destination] = by_type["AWS::Events::ApiDestination"]
    assert destination["InvocationEndpoint"] == f"{URL}/cron/*"
    assert destination["HttpMethod"] == "POST"
    assert destination["ConnectionArn"] == {"Fn::GetAtt": ["Connection", "Arn"]}
    roles = {
        r["AssumeRolePolicyDocument"]["Statement"][0]["Principal"]["Service"]: r
        for r in by_type["AWS::IAM::Role"]
    }
    actions = {
        service: role["Policies"][0]["PolicyDocument"]["Statement"][0]["Action"]
        for service, role in roles.items()
    }
    assert actions == {
        "scheduler.amazonaws.com": "events:PutEvents",
        "events.amazonaws.com": "events:InvokeApiDestination",
    }

    rules = {}
    for rule in by_type["AWS::Events::Rule"]:
        [name] = rule["EventPattern"]["detail"]["job"]
        assert rule["EventPattern"]["source"] == ["cronlock"]
        assert rule["EventPattern"]["detail-type"] == ["cronlock trigger"]
        assert rule["EventBusName"] == {"Ref": "Bus"}
        [target] = rule["Targets"]
        assert target["Arn"] == {"Fn::GetAtt": ["Destination", "Arn"]}
        assert target["HttpParameters"]["PathParameterValues"] == [name]
        # 5 s is all an API destination waits: the trigger answers once the lock is held.
        assert target["HttpParameters"]["QueryStringParameters"] == {"wait": "false"}
        assert json.loads(target["Input"]) == {}
        assert target["RetryPolicy"]["MaximumRetryAttempts"] == 0
        rules[name] = rule
    assert set(rules) == {n for n in JOBS} | {"every-2h"}

    schedules: dict[str, list[dict[str, Any]]] = {}
    for schedule in by_type["AWS::Scheduler::Schedule"]:
        assert AWS_NAME.fullmatch(schedule["Name"]), schedule["Name"]
        assert schedule["FlexibleTimeWindow"] == {"Mode": "OFF"}
        target = schedule["Target"]
        assert target["Arn"] == {"Fn::GetAtt": ["Bus", "Arn"]}
        assert target["RoleArn"] == {"Fn::GetAtt": ["SchedulerRole", "Arn"]}
        assert target["EventBridgeParameters"] == {
            "DetailType": "cronlock trigger",
            "Source": "cronlock",
        }
        assert target["RetryPolicy"]["MaximumRetryAttempts"] == 0
        name = json.loads(target["Input"])["job"]
        schedules.setdefault(name, []).append(schedule)
    names = [s["Name"] for group in schedules.values() for s in group]
    assert len(set(names)) == len(names)
    assert set(schedules) == set(rules)
    for name, group in schedules.items():
        job = registry[name] if name != "every-2h" else make_job(name, "0 */2 * * *")
        assert job.schedule is not None
        assert {s["ScheduleExpressionTimezone"] for s in group} == {job.schedule.tz}
        unix = [aws_to_unix(s["ScheduleExpression"]) for s in group]
        assert_same_ticks(job, unix, job.schedule.tz)
    [weekdays] = schedules["weekdays-new-york"]
    assert weekdays["ScheduleExpression"] == "cron(15 9 ? * 2-6 *)"  # Monday is 2 for AWS
    [sundays] = schedules["sundays-seven"]
    assert sundays["ScheduleExpression"] == "cron(0 6 ? * 1 *)"
    assert sorted(s["ScheduleExpression"] for s in schedules["friday13-lord-howe"]) == [
        "cron(0 0 13 * ? *)",
        "cron(0 0 ? * 6 *)",
    ]
    [hourly] = schedules["Odd_Name.v2"]
    assert hourly["ScheduleExpression"] == "cron(0 * * * ? *)"


# --- what cannot be exported ------------------------------------------------------------------


MANAGED = ("cloud-scheduler", "qstash", "eventbridge")


@pytest.mark.parametrize("fmt", MANAGED)
def test_what_a_provider_cannot_express_is_refused_by_name(fmt: str) -> None:
    # `*/2` starts with `*`: cron's AND rule (odd days that are Fridays), which no provider
    # documents; a day field that names every day is no restriction and exports fine.
    and_rule = Registry({"odd-fridays": make_job("odd-fridays", "0 0 */2 * fri", "Europe/Paris")})
    with pytest.raises(ExportError) as caught:
        export_text(and_rule, fmt)
    message = str(caught.value)
    assert message.startswith(f"{fmt} cannot trigger odd-fridays: `0 0 */2 * fri`")
    assert message.endswith("leave it out with --skip odd-fridays")
    assert "\n" not in message
    text, notes = export_text(and_rule, fmt, skip=["odd-fridays"])
    assert "odd-fridays" not in text
    assert "odd-fridays: left out (--skip)" in notes

    every_day = Registry({"fridays": make_job("fridays", "0 0 */1 * fri")})
    text, _ = export_text(every_day, fmt)
    assert "fridays" in text

    needs = Registry({"bill": make_job("bill", "0 6 * * *", params=Needs)})
    with pytest.raises(ExportError, match=r"cannot trigger bill: its params \(Needs\) require "):
        export_text(needs, fmt)

    with pytest.raises(ExportError, match="--skip: no job named nope"):
        export_text(and_rule, fmt, skip=["nope"])


class Customer(BaseModel):
    customer_id: int


def test_keyed_jobs_are_left_out_with_a_note() -> None:
    """Only the operator knows a keyed job's keys: no format writes an entry without one."""
    keyed = make_job("sync", "0 * * * *", params=Customer, key="customer_id")
    reg = Registry({"sync": keyed, "nightly": make_job("nightly", "0 3 * * *")})
    for fmt in ("crontab", "kubernetes", "vercel", "compose", *MANAGED):
        text, notes = export_text(reg, fmt)
        assert "/cron/sync" not in text, fmt
        assert '"sync"' not in text, fmt  # nor a JSON value (eventbridge's job, vercel's path)
        assert "nightly" in text, fmt
        assert any(n.startswith("sync: keyed by customer_id: one entry per key") for n in notes)


def test_options_are_checked() -> None:
    one = Registry({"nightly": make_job("nightly", "0 3 * * *")})
    with pytest.raises(ExportError, match="HTTPS endpoints only"):
        export(one, "eventbridge", url="http://cron.example.com", start=START)
    with pytest.raises(ExportError, match="Secrets Manager name"):
        export_text(one, "eventbridge", secret_name="x}}{{resolve:ssm:other")
    with pytest.raises(ExportError, match="contains a control character"):
        export_text(one, "cloud-scheduler", location="us\nrm -rf /")
    with pytest.raises(ExportError, match="contains a control character"):
        export_text(one, "cloud-scheduler", service_account="a@b\r")
    # Provider names: only their alphabet, within their length, never two jobs on one name.
    assert resource_name("a.b", "", limit=64) != resource_name("a-b", "", limit=64)
    assert resource_name("x", "dom", limit=64) != resource_name("x-dom", "", limit=64)
    long = resource_name("x" * 100, "dow", limit=64, allowed="A-Za-z0-9_.-")
    assert AWS_NAME.fullmatch(long)


@pytest.mark.slow  # starts processes (the CLI): not in --fast
def test_schedule_export_command_refuses_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "exportjobs.py").write_text(
        "from cronlock import job\n"
        "@job('odd-fridays', schedule='0 0 */2 * fri', tz='Europe/Paris')\n"
        "async def odd(ctx): ...\n"
        "@job('nightly', schedule='0 3 * * *', tz='Europe/Paris')\n"
        "async def nightly(ctx): ...\n"
    )
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("CRON_", "DATABASE_"))},
        "CRON_JOBS": "exportjobs",
        "PYTHONPATH": f"{REPO}:{tmp_path}",
        "TRIGGER_AUTH": "bearer",
    }
    command = [sys.executable, "-m", "cronlock", "schedule", "export", "--format", "eventbridge"]
    command += ["--url", "https://cron.example.com"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        "cronlock: eventbridge cannot trigger odd-fridays: `0 0 */2 * fri` runs on days "
        "matching both day fields (cron's rule when one starts with `*`), which the provider "
        "may read as either one; leave it out with --skip odd-fridays"
    ]
    done = subprocess.run(
        [*command, "--skip", "odd-fridays"], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    schedules = [
        r["Properties"]
        for r in json.loads(done.stdout)["Resources"].values()
        if r["Type"] == "AWS::Scheduler::Schedule"
    ]
    assert [(s["ScheduleExpression"], s["ScheduleExpressionTimezone"]) for s in schedules] == [
        ("cron(0 3 * * ? *)", "Europe/Paris")
    ]
    assert "cronlock: odd-fridays: left out (--skip)" in done.stderr
    bad = subprocess.run(
        [*command, "--skip", "no such"], env=env, capture_output=True, text=True, check=False
    )
    assert bad.returncode == 2
    assert "Traceback" not in bad.stderr
