"""`schedule export`: every format is parsed back, and the UTC entries written for time-zoned
jobs are checked against the job's own ticks over a whole year."""

from __future__ import annotations

import json
import os
import random
import re
import stat
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from cronlock.core.jobs import Job, JobContext, Registry
from cronlock.core.schedule import Schedule
from cronlock.ops.export import (
    FORMATS,
    ExportError,
    export,
    job_lines,
    k8s_name,
    to_yaml,
    utc_lines,
)
from tests.support import TEST_SECRET

START = datetime(2026, 1, 1, tzinfo=UTC)
SERVICE_ACCOUNT = "cron@my-project.iam.gserviceaccount.com"
REPO = Path(__file__).resolve().parent.parent


async def _noop(ctx: JobContext) -> None:
    return None


def make_job(name: str, expr: str | None, tz: str = "UTC", **kw: Any) -> Job:
    return Job(name, _noop, schedule=Schedule(expr, tz) if expr else None, **kw)


ZONED = {
    "digest-berlin": ("0 7 * * *", "Europe/Berlin"),
    "gap-berlin": ("30 2 * * *", "Europe/Berlin"),  # skipped hour in spring
    "monthly-berlin": ("0 0 1 * *", "Europe/Berlin"),  # local midnight: the UTC day before
    "friday13-lord-howe": ("0 0 13 * fri", "Australia/Lord_Howe"),  # half-hour DST, OR rule
    "weekdays-new-york": ("15 9 * * mon-fri", "America/New_York"),
    "march-evenings-new-york": ("0 22 * 3 *", "America/New_York"),  # next UTC day, month edge
    "odd-fridays-santiago": ("0 0 */2 * fri", "America/Santiago"),  # AND rule, DST at midnight
    "mondays-berlin": ("*/20 * * * 1", "Europe/Berlin"),  # wildcard hour follows the clock
    "kolkata": ("45 5 * * *", "Asia/Kolkata"),  # one offset, half an hour
}


@pytest.fixture
def registry() -> Registry:
    jobs = [make_job(name, expr, tz) for name, (expr, tz) in ZONED.items()]
    jobs.append(make_job("utc-nightly", "0 3 * * *", timeout=120))
    jobs.append(make_job("on-demand", None))
    jobs.append(make_job("Odd_Name.v2", "@hourly", max_lateness=30))
    return Registry({j.name: j for j in jobs})


def first_fire_at_or_after(lines: list[str], at: datetime) -> datetime:
    return min(Schedule(line, "UTC").next_tick(at - timedelta(microseconds=1)) for line in lines)


def assert_every_tick_is_triggered(job: Job, lines: list[str]) -> int:
    """Each tick of the coming year gets a trigger inside its own slot (at or after the tick,
    before the next one), so the slot check runs it; returns how many ticks were checked."""
    assert job.schedule is not None
    tick = job.schedule.next_tick(START)
    end = START + timedelta(days=365)
    checked = 0
    while tick < end:
        upcoming = job.schedule.next_tick(tick)
        fire = first_fire_at_or_after(lines, tick)
        assert tick <= fire < upcoming, (job.name, tick, fire, lines)
        tick = upcoming
        checked += 1
    return checked


# --- UTC entries ------------------------------------------------------------------------------


# Every minute of a year through the schedule: what it covers, the other tests here cover
# too, and measuring it would double its time.
@pytest.mark.slow  # seconds of timers or loops by design: not in --fast
@pytest.mark.no_cover
@pytest.mark.parametrize("name", sorted(ZONED))
def test_utc_entries_trigger_every_tick_of_a_year(registry: Registry, name: str) -> None:
    job = registry[name]
    lines = job_lines(job, START)
    assert assert_every_tick_is_triggered(job, lines) > 0
    split = job_lines(job, START, split_days=True)
    assert_every_tick_is_triggered(job, split)
    for line in split:
        fields = line.split()
        assert fields[2] == "*" or fields[4] == "*", line


def test_entries_for_both_offsets() -> None:
    assert [str(x) for x in utc_lines(Schedule("0 7 * * *", "Europe/Berlin"), START)] == [
        "0 5,6 * * *"
    ]
    assert [str(x) for x in utc_lines(Schedule("45 5 * * *", "Asia/Kolkata"), START)] == [
        "15 0 * * *"
    ]
    # Local midnight on the 1st is the last evening of the month before, in UTC.
    assert [str(x) for x in utc_lines(Schedule("0 0 1 * *", "Europe/Berlin"), START)] == [
        "0 22,23 28-31 * *"
    ]
    utc_job = make_job("u", "0 3 * jan sun")
    assert job_lines(utc_job, START) == ["0 3 * 1 0"]


# --- crontab ----------------------------------------------------------------------------------


def crontab_entries(text: str) -> list[tuple[str, str]]:
    entries = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("#") or re.match(r"^[A-Z_]+=", line):
            continue
        parts = line.split(None, 5)
        assert len(parts) == 6, line  # five fields and a command
        entries.append((" ".join(parts[:5]), parts[5]))
    return entries


@pytest.mark.slow  # seconds of timers or loops by design: not in --fast
def test_crontab_parses_back_and_triggers_every_tick(registry: Registry) -> None:
    text, notes = export(registry, "crontab", start=START, url="http://app:8000")
    assert notes == ["on-demand: no schedule, not exported"]
    assert "Debian's cron has no per-entry time zone" in text
    assert TEST_SECRET not in text
    by_job: dict[str, list[str]] = {}
    for fields, command in crontab_entries(text):
        Schedule(fields, "UTC")  # five valid cron fields
        m = re.fullmatch(
            r"curl -fsS -X POST -H @/etc/cronlock/auth_header --max-time (\d+) "
            r"http://app:8000/cron/([\w.-]+) >/dev/null",
            command,
        )
        assert m, command
        assert "%" not in command  # cron turns % into a newline
        job = registry[m.group(2)]
        assert int(m.group(1)) == int(job.timeout) + 30
        by_job.setdefault(job.name, []).append(fields)
    assert set(by_job) == {n for n, j in registry.items() if j.schedule is not None}
    assert by_job["utc-nightly"] == ["0 3 * * *"]
    assert by_job["Odd_Name.v2"] == ["0 * * * *"]
    for name in ZONED:
        assert_every_tick_is_triggered(registry[name], by_job[name])
    # Jobs whose extra entry could run a missed slot late are flagged.
    assert "note: digest-berlin has no max_lateness below 3600 s" in text


# --- kubernetes -------------------------------------------------------------------------------


def test_kubernetes_cronjobs_parse_back(registry: Registry) -> None:
    text, _ = export(registry, "kubernetes", start=START, secret_name="cron-secret-x")
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    scheduled = {n: j for n, j in registry.items() if j.schedule is not None}
    assert len(docs) == len(scheduled)
    names = set()
    for doc in docs:
        assert doc["apiVersion"] == "batch/v1"
        assert doc["kind"] == "CronJob"
        name = doc["metadata"]["name"]
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), name
        assert len(name) <= 52
        names.add(name)
        job = scheduled[doc["metadata"]["labels"]["cronlock/job"]]
        assert job.schedule is not None
        spec = doc["spec"]
        assert spec["schedule"] == job.schedule.expr
        assert spec["timeZone"] == job.schedule.tz
        assert spec["concurrencyPolicy"] == "Forbid"
        pod = spec["jobTemplate"]["spec"]["template"]["spec"]
        assert pod["restartPolicy"] == "Never"
        [container] = pod["containers"]
        shell, flag, script = container["command"]
        assert (shell, flag) == ("/bin/sh", "-c")
        [mount] = container["volumeMounts"]
        [volume] = pod["volumes"]
        assert mount["name"] == volume["name"]
        assert mount["readOnly"] is True
        assert volume["secret"]["secretName"] == "cron-secret-x"
        assert volume["secret"]["items"] == [{"key": "cron_secret", "path": "cron_secret"}]
        assert volume["secret"]["defaultMode"] == 0o440
        assert f"$(cat {mount['mountPath']}/cron_secret)" in script
        assert "-H @/tmp/auth" in script
        assert script.endswith(f"http://cronlock/cron/{job.name}")
        assert pod["securityContext"]["runAsNonRoot"] is True
    assert len(names) == len(docs)
    assert k8s_name("Odd_Name.v2") == "cronlock-odd-name-v2"
    assert len(k8s_name("x" * 100)) <= 52


# --- vercel -----------------------------------------------------------------------------------


@pytest.mark.slow  # seconds of timers or loops by design: not in --fast
def test_vercel_json_parses_back(registry: Registry) -> None:
    text, notes = export(registry, "vercel", start=START)
    body = json.loads(text)
    assert any("CRON_ALLOW_GET=true" in note for note in notes)
    by_job: dict[str, list[str]] = {}
    for cron in body["crons"]:
        assert set(cron) == {"path", "schedule"}
        fields = cron["schedule"].split()
        assert len(fields) == 5
        assert all(re.fullmatch(r"[0-9*,/-]+", f) for f in fields), cron  # numbers only
        assert fields[2] == "*" or fields[4] == "*", cron  # Vercel: one day field only
        assert cron["path"].startswith("/cron/")
        by_job.setdefault(cron["path"].removeprefix("/cron/"), []).append(cron["schedule"])
    assert by_job["utc-nightly"] == ["0 3 * * *"]
    assert by_job["weekdays-new-york"] == ["15 13,14 * * 1-5"]
    for name in ZONED:
        assert_every_tick_is_triggered(registry[name], by_job[name])


# --- compose ----------------------------------------------------------------------------------


def compose_scheduler(registry: Registry) -> dict[str, Any]:
    text, _ = export(registry, "compose", start=START)
    doc = yaml.safe_load(text)
    service: dict[str, Any] = doc["services"]["scheduler"]
    return service


def test_compose_scheduler_service_parses_back(registry: Registry) -> None:
    service = compose_scheduler(registry)
    assert service["image"].startswith("curlimages/curl")
    assert service["secrets"] == ["cron_secret"]
    assert service["entrypoint"] == ["/bin/sh", "-c"]
    assert service["depends_on"] == ["lb"]
    [script] = service["command"]
    assert "$(" not in script.replace("$$(", "")  # every `$` escaped for compose
    subprocess.run(["sh", "-n", "-c", script.replace("$$", "$")], check=True)


def run_scheduler_once(
    script: str, at: datetime, tmp_path: Path, *, background: bool = True
) -> list[list[str]]:
    """Run the scheduler loop for one minute at `at`, with `date`, `curl` and `sleep` stubbed;
    returns the curl calls it made."""
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    calls = tmp_path / "calls"
    calls.unlink(missing_ok=True)
    fields = at.strftime("%Y%m%d%H%M %M %H %d %m ") + str(at.isoweekday() % 7)
    (stubs / "date").write_text(
        f'#!/bin/sh\ncase "$*" in *%S*) echo 05 ;; *) echo "{fields}" ;; esac\n'
    )
    (stubs / "curl").write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {calls}\n')
    (stubs / "sleep").write_text("#!/bin/sh\nkill -TERM $PPID\n")
    for stub in stubs.iterdir():
        stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    secret = tmp_path / "cron_secret"
    secret.write_text(TEST_SECRET + "\n")
    body = script.replace("$$", "$").replace("/run/secrets/cron_secret", str(secret))
    if not background:
        body = body.replace(" & fi", "; fi")
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "TMPDIR": str(tmp_path)}
    # The triggers run in the background and outlive the loop's shell; each holds its stderr
    # (the script's `|| echo ... >&2`), so reading that pipe to its end waits for every one.
    subprocess.run(["sh", "-c", body], env=env, check=False, timeout=10, stderr=subprocess.PIPE)
    if not calls.exists():
        return []
    return [line.split() for line in calls.read_text().splitlines()]


@pytest.mark.slow  # starts processes (a shell per simulated minute): not in --fast
def test_compose_scheduler_fires_jobs_at_their_utc_entries(
    registry: Registry, tmp_path: Path
) -> None:
    [script] = compose_scheduler(registry)["command"]
    # Monday 2026-03-30 05:00 UTC is 07:00 in Berlin (summer time since the 29th).
    calls = run_scheduler_once(script, datetime(2026, 3, 30, 5, 0, tzinfo=UTC), tmp_path)
    assert sorted(c[-1].removeprefix("http://lb/cron/") for c in calls) == [
        "Odd_Name.v2",  # @hourly
        "digest-berlin",
        "mondays-berlin",  # every 20 minutes on (Berlin) Mondays
    ]
    assert calls[0][:6] == ["-fsS", "-X", "POST", "-H", f"@{tmp_path}/cronlock-auth", "--max-time"]
    auth = tmp_path / "cronlock-auth"
    assert auth.read_text() == f"Authorization: Bearer {TEST_SECRET}\n"
    assert stat.S_IMODE(auth.stat().st_mode) == 0o600

    # The shell's field matching agrees with cron's, minute by minute, for every job.
    entries = {
        name: [Schedule(line, "UTC") for line in job_lines(job, START)]
        for name, job in registry.items()
        if job.schedule is not None
    }
    # Arbitrary minutes (mostly misses), plus each entry's own next fire from a few points
    # of the year (hits, and the other jobs' matching is checked there too).
    moments = {START + timedelta(minutes=4099 * n + n * n % 13) for n in range(40)}
    for lines in entries.values():
        for day in (17, 101, 230, 300):
            for line in lines:
                moments.add(line.next_tick(START + timedelta(days=day)))
    for at in sorted(moments):
        fired = {
            c[-1].rsplit("/", 1)[1]
            for c in run_scheduler_once(script, at, tmp_path, background=False)
        }
        expected = {name for name, lines in entries.items() if any(s.is_tick(at) for s in lines)}
        assert fired == expected, at


# --- the YAML writer --------------------------------------------------------------------------


def test_every_yaml_output_reads_back_as_written(registry: Registry) -> None:
    """What `kubernetes` and `compose` write is what yaml.safe_load reads back, value for value."""
    for fmt in ("kubernetes", "compose"):
        text, _ = export(registry, fmt, start=START)
        for doc in (d for d in yaml.safe_load_all(text) if d is not None):
            assert yaml.safe_load(to_yaml(doc)) == doc
    service = compose_scheduler(registry)
    assert service["command"][0].startswith("umask 077\n")  # written as a `|` block


TRICKY = [
    "",
    " ",
    "yes",
    "No",
    "on",
    "off",
    "null",
    "~",
    "true",
    "1",
    "0440",
    "1e3",
    "-",
    "- x",
    "a: b",
    "#x",
    "x #y",
    "'",
    '"',
    "\\",
    "@x",
    "`x",
    "%x",
    "!x",
    "&a",
    "*a",
    "[1]",
    "{a}",
    "a,b",
    "\t",
    "\n",
    "a\n",
    "a\n\n",
    "\na",
    " a\nb",
    "a\n b\n",
    "a \nb ",
    "x\r\ny",
    "é",
    "😀",
    "\u2028",
    "\x85",
    "\x7f",
    "\ufeff",
    "\ud800",
    "é\nß\n",
    "a\tb\n\tc",
]


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return rng.choice(TRICKY) + rng.choice(["", "z", "\n", " "])
    if kind == 1:
        return rng.choice([0, -1, 7, 2**63, 0o440])
    if kind == 2:
        return rng.choice([0.5, -2.25, 1e16, 1e-7, float("inf"), float("-inf")])
    if kind == 3:
        return rng.choice([None, True, False])
    if kind == 4:
        return rng.choice(TRICKY)
    if kind == 5:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {
        rng.choice([*TRICKY, "name", "a.b/c-d", "x_1"]): _random_value(rng, depth + 1)
        for _ in range(rng.randrange(4))
    }


def test_yaml_writer_round_trips_tricky_values() -> None:
    rng = random.Random(20261202)
    for _ in range(500):
        value = {"root": _random_value(rng)}
        text = to_yaml(value)
        assert yaml.safe_load(text) == value, text


# --- the command ------------------------------------------------------------------------------


@pytest.mark.slow  # starts processes (the CLI): not in --fast
def test_schedule_export_command(tmp_path: Path) -> None:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("CRON_", "DATABASE_"))},
        "CRON_JOBS": "cronlock.demo.digest,cronlock.housekeeping",
        "PYTHONPATH": str(REPO),
    }
    out = tmp_path / "crontab"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "cronlock",
            "schedule",
            "export",
            "--format",
            "crontab",
            "-o",
            str(out),
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    jobs = sorted(
        command.split("/cron/")[1].split()[0] for _, command in crontab_entries(out.read_text())
    )
    assert jobs == ["daily-digest", "ledger-prune"]
    bad = subprocess.run(
        [sys.executable, "-m", "cronlock", "schedule", "export", "--format", "cron"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2


def test_interval_jobs_export_as_exact_cron_or_not_at_all() -> None:
    """every=300 is `*/5 * * * *`; every=30 has no cron form: left out, with a note naming the
    built-in scheduler, in every format."""
    from cronlock.core.schedule import Interval

    jobs = [
        Job("five-minutes", _noop, schedule=Interval(300)),
        Job("half-minute", _noop, schedule=Interval(30)),
    ]
    reg = Registry({j.name: j for j in jobs})
    for fmt in FORMATS:
        text, notes = export(reg, fmt, start=START, service_account=SERVICE_ACCOUNT)
        assert "five-minutes" in text, fmt
        assert "half-minute" not in text, fmt
        assert any("half-minute" in n and "SCHEDULER_ENABLED=true" in n for n in notes), fmt
        assert any("five-minutes" in n and "*/5 * * * *" in n for n in notes), fmt
    text, _ = export(reg, "crontab", start=START)
    assert "*/5 * * * * curl" in text


# --- options that reach a shell ------------------------------------------------------------


def as_cron_runs(command: str) -> str:
    """What cron hands to the shell for a crontab line's command: `\\%` is a `%`, and an
    unescaped `%` ends the command (the rest, with newlines for `%`, is its stdin)."""
    out, i = [], 0
    while i < len(command):
        if command.startswith("\\%", i):
            out.append("%")
            i += 2
        elif command[i] == "%":
            break
        else:
            out.append(command[i])
            i += 1
    return "".join(out)


def run_with_curl_stub(script: str, tmp_path: Path) -> list[str]:
    """Run `script` with `curl` stubbed; returns curl's arguments, one each."""
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    calls = tmp_path / "calls"
    calls.unlink(missing_ok=True)
    (stubs / "curl").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" >> {calls}\n')
    (stubs / "curl").chmod(0o700)
    env = {"PATH": f"{stubs}:/usr/bin:/bin"}
    subprocess.run(["sh", "-c", script], env=env, check=False, timeout=10, cwd=tmp_path)
    return calls.read_text().splitlines() if calls.exists() else []


def test_options_reach_the_shell_as_one_word_each(tmp_path: Path) -> None:
    """A URL or header file written into a shell command is one argument of curl, whatever it
    holds: never a command of its own (`;`, `${IFS}`), nor cut by cron at a `%`."""
    registry = Registry({"nightly": make_job("nightly", "0 3 * * *")})
    pwned = tmp_path / "pwned"
    url = f"http://x/;touch${{IFS}}{pwned};#%d"
    header = f"{tmp_path}/h ;touch {pwned};# %"
    text, _ = export(registry, "crontab", url=url, header_file=header, start=START)
    [(_, command)] = crontab_entries(text)
    args = run_with_curl_stub(as_cron_runs(command), tmp_path)
    assert args[-1] == f"{url}/cron/nightly"
    assert f"@{header}" in args

    text, _ = export(registry, "kubernetes", url=url, start=START)
    [doc] = [d for d in yaml.safe_load_all(text) if d is not None]
    [container] = doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    auth = "/tmp/auth"  # noqa: S108 - the container's path, replaced by the test's
    script = container["command"][2].replace(auth, str(tmp_path / "auth"))
    assert run_with_curl_stub(script, tmp_path)[-1] == f"{url}/cron/nightly"

    text, _ = export(registry, "compose", url=url, start=START)
    [script] = yaml.safe_load(text)["services"]["scheduler"]["command"]
    calls = run_scheduler_once(script, datetime(2026, 3, 30, 3, 0, tzinfo=UTC), tmp_path)
    assert [c[-1] for c in calls] == [f"{url}/cron/nightly"]
    assert not pwned.exists()


def test_options_with_a_control_character_are_refused() -> None:
    registry = Registry({"nightly": make_job("nightly", "0 3 * * *")})
    injected = "/etc/h\n* * * * * touch /tmp/pwn2 #"
    for fmt, option in (
        ("crontab", {"header_file": injected}),
        ("crontab", {"url": "http://x/\n* * * * * id"}),
        ("kubernetes", {"secret_name": "s\u0085x"}),
        ("compose", {"image": "curl\rx"}),
    ):
        with pytest.raises(ExportError, match="contains a control character"):
            export(registry, fmt, start=START, **option)  # type: ignore[arg-type]
