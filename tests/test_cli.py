"""The operator's command line against a real database and real instances: the same views as
the HTTP API (`--json`), tables for people, exit codes, trigger, cancel, outbox, catch-up.

Most commands run in-process (`cronlock.cli.main` in a worker thread, as `python -m cronlock`
calls it), against an instance in-process too where the CLI reaches it through the database
only; the ones whose process boundary matters (exit status, the secret's way in, `trigger`
over HTTP, `serve`) run as processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import asyncpg
import httpx
import pytest
from pydantic import BaseModel

from cronlock.cli import common, serve
from cronlock.cli import main as cli
from cronlock.core.jobs import Registry, load
from tests.support import TEST_SECRET
from tests.support.asgi import StartApp
from tests.support.cluster import Instance
from tests.support.ui import csrf_of
from tests.util import AUTH, effects, lock_held, post, runs, seen_since, wait_for

Starter = Callable[..., Any]
REPO = Path(__file__).resolve().parent.parent
DOWN_URL = "postgresql://nobody@127.0.0.1:9/none"


@pytest.fixture
def cli_env(database_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    """The CLI's environment: this test's database, the test jobs, no .env file."""
    monkeypatch.chdir(tmp_path)
    for name in list(os.environ):
        if name.startswith(("CRON_", "DATABASE_", "CRONLOCK_")):
            monkeypatch.delenv(name)
    env = {
        "DATABASE_URL": database_url,
        "CRON_JOBS": "tests.jobs",
        "INSTANCE_NAME": "cli",
        "OUTBOX_ENABLED": "false",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


class Result:
    def __init__(self, code: int, out: str, err: str) -> None:
        self.code, self.out, self.err = code, out, err

    def json(self) -> Any:
        return json.loads(self.out)


async def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> Result:
    capsys.readouterr()
    code = await asyncio.to_thread(cli.main, list(args))
    captured = capsys.readouterr()
    return Result(code, captured.out, captured.err)


def run_process(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("CRON_", "DATABASE_"))}
    full.update(env)
    full["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "cronlock", *args],
        env=full,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


async def sleeping_in_sql(db: asyncpg.Connection) -> bool:
    return bool(
        await db.fetchval(
            """SELECT EXISTS (SELECT 1 FROM pg_stat_activity
               WHERE state = 'active' AND query LIKE 'SELECT pg_sleep%')"""
        )
    )


async def cancel_sleep(db: asyncpg.Connection) -> None:
    """Cancel the statement slow-sql sleeps in: it fails at once, its lock released."""
    await db.execute(
        "SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep%'"
    )


def without(value: Any, *keys: str) -> Any:
    """`value` with volatile keys (times measured at the moment of asking) dropped."""
    if isinstance(value, dict):
        return {k: without(v, *keys) for k, v in value.items() if k not in keys}
    if isinstance(value, list):
        return [without(v, *keys) for v in value]
    return value


# --- jobs, runs, locks --------------------------------------------------------------------------


async def test_json_output_is_what_the_http_api_answers(
    start_app: StartApp,
    client: httpx.AsyncClient,
    db: asyncpg.Connection,
    cli_env: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    i = await start_app("svc")
    await post(client, i.url + "/cron/fast")
    await post(client, i.url + "/cron/fails")
    pending = asyncio.create_task(post(client, i.url + "/cron/slow-sql", json={"seconds": 30}))
    await wait_for(lambda: lock_held(db, "slow-sql"), 10, "slow-sql to take its lock")
    for command, path in (("jobs", "/cron/jobs"), ("runs", "/cron/runs?limit=20")):
        result = await run_cli(capsys, command, "--json")
        assert result.code == 0, result.err
        api = (await client.get(i.url + path, headers=AUTH)).json()
        assert without(result.json(), "now", "held_for") == without(api, "now", "held_for")
    result = await run_cli(capsys, "locks", "--json")
    api = (await client.get(i.url + "/cron/locks", headers=AUTH)).json()
    assert without(result.json(), "held_for") == without(api, "held_for")
    assert {lk["job"] for lk in result.json()["locks"]} == {"slow-sql", None}
    await cancel_sleep(db)  # held as long as needed, then let go
    assert (await pending).status_code == 500


async def test_tables_for_people(
    start_app: StartApp,
    client: httpx.AsyncClient,
    db: asyncpg.Connection,
    cli_env: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    i = await start_app("svc")
    for _ in range(3):
        await post(client, i.url + "/cron/fast")
    pending = asyncio.create_task(post(client, i.url + "/cron/slow-sql", json={"seconds": 30}))
    await wait_for(lambda: lock_held(db, "slow-sql"), 10, "slow-sql to take its lock")
    await seen_since(db, "yearly")  # deployed over a year ago: January's slot was its to miss

    jobs = await run_cli(capsys, "jobs")
    assert jobs.code == 0
    header, *rows = jobs.out.splitlines()
    assert header.split()[:3] == ["JOB", "SCHEDULE", "LAST"]
    fast = next(r for r in rows if r.startswith("fast "))
    assert "succeeded" in fast
    assert " svc " in fast
    slow = next(r for r in rows if r.startswith("slow-sql "))
    assert "svc pid" in slow  # running, and where
    yearly = next(r for r in rows if r.startswith("yearly "))
    assert "0 0 1 1 * UTC" in yearly
    assert yearly.rstrip().endswith("OVERDUE")

    page = await run_cli(capsys, "runs", "--limit", "2")
    lines = page.out.splitlines()
    assert lines[0].split()[:4] == ["ID", "JOB", "SLOT", "STATUS"]
    assert "slow-sql" in lines[1]
    assert "running" in lines[1]
    assert lines[-1].startswith("(more: --before ")
    before = lines[-1].split()[-1].rstrip(")")
    older = await run_cli(capsys, "runs", "--limit", "2", "--before", before)
    assert all(" fast " in line for line in older.out.splitlines()[1:3])

    locks = await run_cli(capsys, "locks")
    assert locks.out.splitlines()[0].split()[:4] == ["JOB", "KEY", "PID", "HOLDER"]
    assert any(line.startswith("slow-sql ") and " svc " in line for line in locks.out.splitlines())
    await cancel_sleep(db)
    assert (await pending).status_code == 500
    assert (await run_cli(capsys, "locks")).out.strip() == "no advisory locks held"


async def test_run_exit_codes_and_source(
    db: asyncpg.Connection, cli_env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    ok = await run_cli(capsys, "run", "fast", "--json")
    assert ok.code == 0
    assert ok.json()["processed"] == 1
    assert (await run_cli(capsys, "run", "fails")).code == 1
    first = await run_cli(capsys, "run", "yearly")
    again = await run_cli(capsys, "run", "yearly")
    assert (first.code, again.code) == (0, 0)
    assert "reason=already done" in again.out
    assert (await run_cli(capsys, "run", "no-such-job")).code == 2
    assert (await run_cli(capsys, "run", "yearly", "--slot", "2026-01-01T00:00:30+00:00")).code == 2
    assert {r["source"] for r in await runs(db, "fast")} == {"cli"}
    assert [r["instance"] for r in await runs(db, "fails")] == ["cli"]


async def test_commands_exit_3_when_the_database_is_down(
    cli_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DATABASE_URL", DOWN_URL)
    monkeypatch.setenv("DB_CONNECT_TIMEOUT", "1")
    for args in (["jobs"], ["runs"], ["locks"], ["cancel", "slow"], ["run", "fast"]):
        result = await run_cli(capsys, *args)
        assert result.code == 3, (args, result.err)
        assert "database unavailable" in result.err


@pytest.mark.slow  # seconds of timers or loops by design: not in --fast
async def test_commands_give_up_on_a_statement_that_never_answers(
    cli_env: dict[str, str],
    db: asyncpg.Connection,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A statement that does not come back (here it queues behind a lock, as behind a long
    migration; in production as often a frozen pooler) ends the command with exit 3 after
    DB_QUERY_TIMEOUT instead of hanging the operator's terminal or script."""
    monkeypatch.setenv("DB_QUERY_TIMEOUT", "0.5")
    commands = (["jobs"], ["runs"], ["outbox", "dead"], ["outbox", "requeue", "--all"])
    async with db.transaction():
        await db.execute("LOCK TABLE cronlock.runs, cronlock.email_outbox IN ACCESS EXCLUSIVE MODE")
        for args in commands:
            started = time.monotonic()
            result = await run_cli(capsys, *args)
            took = time.monotonic() - started
            assert result.code == 3, (args, result.err)
            assert "no answer from the database within 0.5 s" in result.err, result.err
            assert took < 0.5 + 3, f"{args}: gave up after {took:.1f}s"
    for args in commands:  # the same commands, unblocked: nothing was left behind
        result = await run_cli(capsys, *args)
        assert result.code == 0, (args, result.err)


# Every command that names a job, with a name this deployment does not declare.
UNKNOWN_JOB: list[list[str]] = [
    ["run", "nope"],
    ["runs", "--job", "nope"],
    ["runs", "--job", "nope", "--json"],
    ["cancel", "nope"],
    ["pause", "nope"],
    ["resume", "nope"],
    ["schedules", "set", "nope", "1", "--every", "60"],
    ["schedules", "rm", "nope", "1"],
    ["schedules", "show", "nope", "1"],
    ["schedules", "pause", "nope", "1"],
    ["schedules", "resume", "nope", "1"],
    ["schedules", "ls", "nope"],
]


@pytest.mark.parametrize("args", UNKNOWN_JOB, ids=" ".join)
async def test_an_unknown_job_is_one_line_and_exit_2_for_every_command(
    cli_env: dict[str, str], capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    """One rule: no empty table, no other wording; the line names the jobs there are."""
    result = await run_cli(capsys, *args)
    assert (result.code, result.out) == (2, "")
    [line] = result.err.splitlines()
    assert line.startswith("cronlock: unknown job 'nope'; known: "), line
    assert "fast" in line


@pytest.mark.slow
def test_exit_status_of_the_process(cli_env: dict[str, str]) -> None:
    assert run_process(cli_env, "run", "fast").returncode == 0
    failed = run_process(cli_env, "run", "fails")
    assert failed.returncode == 1
    assert "error=job failed" in failed.stdout
    assert run_process(cli_env, "run", "nope").returncode == 2
    assert run_process({**cli_env, "DATABASE_URL": DOWN_URL}, "jobs").returncode == 3


# --- bad arguments ----------------------------------------------------------------------------

# (arguments, what the message names): argparse's usage error, before anything is opened.
BAD_ARGUMENTS: list[tuple[list[str], str]] = [
    (["runs", "--before", str(2**63 + 1)], "--before: must be between 1 and 9223372036854775807"),
    (["runs", "--before", "0"], "--before"),
    (["runs", "--before", "next"], "--before: not an integer"),
    (["runs", "--limit", "501"], "--limit: must be between 1 and 500"),
    (["runs", "--job", "fast\x00"], "--job: not a job name"),
    (["runs", "--job", "\udcff"], "--job: not a job name"),  # a non-UTF-8 byte in argv
    (
        ["run", "fast", "--slot", "9999-12-31T23:59:00-01:00"],
        "--slot: '9999-12-31T23:59:00-01:00' is out of range",
    ),
    (
        ["run", "fast", "--slot", "2026-01-01T07:00:00"],
        "--slot: '2026-01-01T07:00:00' needs a time zone",
    ),
    (["run", "fast", "--slot", "yesterday"], "--slot: not an ISO 8601 time"),
    (["run", "fast", "--params", '{"text": "\udcff"}'], "--params: contains a lone surrogate"),
    (["run", "fast;drop"], "job: not a job name"),
    (["cancel", "slow", "--wait", "nan"], "--wait: must be a finite, non-negative number"),
    (["cancel", "slow", "--wait", "-1"], "--wait"),
    (["trigger", "fast", "--timeout", "0"], "--timeout: must be more than 0 seconds"),
    (["trigger", "fast", "--timeout", "1e10"], "--timeout: must be at most 1000000 seconds"),
    (["trigger", "fast", "--url", "localhost:8000"], "--url: not an http(s) URL"),
    (["trigger", "fast", "--params", "\udcff"], "--params: contains a lone surrogate"),
    (["outbox", "dead", "--limit", str(2**64)], "--limit: must be between 1 and"),
    (["outbox", "requeue", "0"], "ids: must be between 1 and"),
    (["serve", "--port", "70000"], "--port: must be between 0 and 65535"),
    (["serve", "--demo-users", "-1"], "--demo-users"),
    (["schedule", "export", "--format", "crontab", "--image", "a\x00"], "--image: contains NUL"),
    (
        ["schedule", "export", "--format", "crontab", "--header-file", "/h\n* * * * * id #"],
        "--header-file: contains a control character",
    ),
    (["schedule", "export", "--format", "crontab", "--url", "http://x/\r"], "--url: contains a"),
    (["trigger", "fast", "--slot", "2026-01-01T00:00:00Z\n"], "--slot: contains a control"),
]


def test_a_bad_argument_is_exit_2_with_a_message_never_a_traceback(
    cli_env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    for args, message in BAD_ARGUMENTS:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exited:
            cli.main(args)
        err = capsys.readouterr().err
        assert exited.value.code == 2, (args, err)
        assert message in err, (args, err)
        assert "Traceback" not in err


@pytest.mark.slow  # starts processes (the CLI): not in --fast
def test_a_bad_argument_in_the_process(cli_env: dict[str, str]) -> None:
    for args, message in (BAD_ARGUMENTS[0], BAD_ARGUMENTS[5]):
        done = run_process(cli_env, *args)
        assert done.returncode == 2, done.stderr
        assert message in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


async def test_bad_values_the_commands_see_later_are_exit_2_too(
    cli_env: dict[str, str],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # NUL in a JSON string: valid JSON, but no text the ledger's jsonb can store.
    r = await run_cli(capsys, "run", "note", "--params", '{"text": "a\\u0000"}')
    assert (r.code, r.out) == (2, ""), r.err
    assert "invalid trigger: text: Value contains NUL" in r.err  # pydantic's errors, one line
    # A typo in a field's name is refused by name, as over HTTP (tests/test_params.py).
    r = await run_cli(capsys, "run", "note", "--params", '{"txt": "a"}')
    assert (r.code, r.out) == (2, ""), r.err
    assert "invalid trigger: txt: Extra inputs are not permitted" in r.err
    # Who pauses, from the environment, is checked as --by is, and named.
    for operator, problem in (("o" * 201, "longer than 200"), ("\udcff", "contains a lone")):
        monkeypatch.setenv("CRONLOCK_OPERATOR", operator)
        r = await run_cli(capsys, "pause", "fast")
        assert (r.code, r.out) == (2, ""), r.err
        assert f"CRONLOCK_OPERATOR: {problem}" in r.err, r.err
    r = await run_cli(
        capsys, "schedule", "export", "--format", "crontab", "-o", str(tmp_path / "no" / "f")
    )
    assert r.code == 2, r.err
    assert "cannot write" in r.err
    assert "Traceback" not in r.err
    # A value the database refuses on a command's own statement: the caller's, exit 2.
    from cronlock.errors import InvalidInput
    from cronlock.settings import Settings

    async def refused() -> None:
        async with common.connection(Settings()) as conn:
            await conn.fetchval("SELECT $1::bigint", 2**63)

    with pytest.raises(InvalidInput, match="SQLSTATE 22000"):
        await refused()


# --- configuration and output errors: one line, never a traceback -------------------------------

# (DATABASE_URL, what the message says): each names DATABASE_URL and never echoes the URL.
BAD_DATABASE_URLS: list[tuple[str, str]] = [
    ("postgresql://u:hunter2@127.0.0.1:abc/x", "is not a URL"),
    ("postgres://hunter2@[bad", "is not a URL"),
    ("hunter2", "must start with postgresql://"),
    ("postgresql://u:hunter2@127.0.0.1:70000/x", "port outside 1-65535"),
    ("postgresql://u:hunter2@127.0.0.1/x\udcff", "not UTF-8"),  # a non-UTF-8 byte
    ("postgresql://u:hunter2@127.0.0.1/x\n", "control character"),
    ("postgresql://u:hunter2@127.0.0.1:9/x?sslmode=bogus", "parameter the driver refuses"),
]


@pytest.mark.slow  # starts processes (the CLI): not in --fast
def test_a_bad_database_url_is_configuration(cli_env: dict[str, str]) -> None:
    for url, message in BAD_DATABASE_URLS:
        done = run_process({**cli_env, "DATABASE_URL": url}, "jobs")
        check_bad_database_url(done, url, message)
    # Through the pool (run, catch-up), as through a single connection (jobs).
    for args in (["run", "fast"], ["catch-up"]):
        url, message = BAD_DATABASE_URLS[-1]
        check_bad_database_url(run_process({**cli_env, "DATABASE_URL": url}, *args), url, message)


def check_bad_database_url(done: subprocess.CompletedProcess[str], url: str, message: str) -> None:
    assert done.returncode == 2, (url, done.stderr)
    assert "DATABASE_URL" in done.stderr, (url, done.stderr)
    assert message in done.stderr, (url, done.stderr)
    assert "hunter2" not in done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr


@pytest.mark.slow
def test_settings_that_cannot_be_read_are_exit_2(cli_env: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / ".env").write_bytes(b"CRON_JOBS=\xff\n")
    done = run_process(cli_env, "jobs")
    assert (done.returncode, done.stderr.strip()) == (
        2,
        "cronlock: cannot read .env: not UTF-8 (byte 11)",
    )
    (tmp_path / ".env").unlink()
    secret = tmp_path / "secret"
    secret.write_bytes(b"\xff" * 40)
    empty = tmp_path / "empty"
    empty.write_text("\n")  # truncated: it would be sent as "Bearer " (refused by HTTP clients)
    for env, message in (
        ({"CRON_SECRET_FILE": str(secret)}, "is not UTF-8 text"),
        ({"CRON_SECRET": "\udcff" * 40}, "CRON_SECRET: Value error, must be printable ASCII"),
        ({"CRON_SECRET": "é" * 40}, "CRON_SECRET: Value error, must be printable ASCII"),
        ({"CRON_SECRET": "", "CRON_SECRET_FILE": str(empty)}, "is shorter than 32 characters"),
    ):
        done = run_process({**cli_env, **env}, "trigger", "fast", "--url", "http://127.0.0.1:9")
        assert done.returncode == 2, (env, done.stderr)
        assert message in done.stderr, (env, done.stderr)
        assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_output_that_cannot_be_written(cli_env: dict[str, str]) -> None:
    args = [sys.executable, "-m", "cronlock", "schedule", "export", "--format", "crontab"]
    env = {**os.environ, **cli_env, "PYTHONPATH": str(REPO)}
    # A full disk: the file's error, exit 1, not the database's (exit 3).
    with open("/dev/full", "w") as full:
        done = subprocess.run(args, env=env, stdout=full, stderr=subprocess.PIPE, text=True)
    assert done.returncode == 1, done.stderr
    assert done.stderr == "cronlock: cannot write output: No space left on device\n"
    # A reader that went away (`| head`): quiet, as any pipe producer.
    with subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as p:
        assert p.stdout is not None
        assert p.stderr is not None
        p.stdout.close()
        err = p.stderr.read()
    assert (p.returncode, err) == (1, b"")


async def test_run_and_catch_up_never_migrate(
    cli_env: dict[str, str], fresh_url: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """Like `jobs`, they refuse a database not migrated (migrations are `migrate`'s), even
    with MIGRATE_ON_START left on (the service's setting)."""
    monkeypatch.setenv("DATABASE_URL", fresh_url)
    monkeypatch.setenv("MIGRATE_ON_START", "true")
    for args in (["run", "fast"], ["catch-up"], ["jobs"], ["retry-items", "1"]):
        result = await run_cli(capsys, *args)
        assert result.code == 3, (args, result.err)
        assert "migrations not applied" in result.err, (args, result.err)
        assert "(python -m cronlock migrate)" in result.err
    conn = await asyncpg.connect(fresh_url)
    try:
        assert await conn.fetchval("SELECT to_regnamespace('cronlock')") is None
    finally:
        await conn.close()


async def test_run_loads_jobs_as_the_other_commands(
    cli_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CRON_JOBS", "no.such.module")
    for args in (["run", "fast"], ["jobs"]):
        result = await run_cli(capsys, *args)
        assert result.code == 2, (args, result.err)
        assert "cannot import 'no.such.module'" in result.err


# --- trigger ----------------------------------------------------------------------------------


async def test_trigger_reads_the_secret_from_a_file_never_argv(
    start_instance: Starter, db: asyncpg.Connection, cli_env: dict[str, str], tmp_path: Path
) -> None:
    i = start_instance("svc")
    secret = tmp_path / "cron_secret"
    secret.write_text(TEST_SECRET + "\n")
    env = {**cli_env, "CRON_SECRET_FILE": str(secret)}
    args = ["trigger", "fast", "--url", i.url, "--json"]
    assert TEST_SECRET not in " ".join(args)
    done = run_process(env, *args)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["processed"] == 1
    failed = run_process(env, "trigger", "fails", "--url", i.url)
    assert failed.returncode == 1
    assert failed.stdout.startswith("HTTP 500 error=job failed")
    assert TEST_SECRET not in done.stdout + done.stderr + failed.stdout + failed.stderr
    assert [r["source"] for r in await runs(db, "fast")] == ["http"]


async def test_trigger_exit_codes(
    start_instance: Starter,
    db: asyncpg.Connection,
    cli_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    i = start_instance("svc")
    assert (await run_cli(capsys, "trigger", "fast", "--url", i.url)).code == 2  # no secret
    monkeypatch.setenv("CRON_SECRET", TEST_SECRET)
    followed = await run_cli(
        capsys, "trigger", "slow", "--url", i.url, "--no-wait", "--follow", "--json",
        "--params", '{"seconds": 1}',
    )  # fmt: skip
    assert followed.code == 0, followed.out
    body = followed.json()
    assert body["accepted"]["run_id"] == body["run"]["id"]
    assert body["run"]["status"] == "succeeded"
    assert body["run"]["result"] == {"slept": 1.0}
    ran = await run_cli(capsys, "trigger", "yearly", "--url", i.url)
    skipped = await run_cli(capsys, "trigger", "yearly", "--url", i.url)
    assert (ran.code, skipped.code) == (0, 0)
    assert "skipped=True reason=already done" in skipped.out
    timed_out = await run_cli(capsys, "trigger", "times-out", "--url", i.url)
    assert timed_out.code == 1
    assert "HTTP 504" in timed_out.out
    unknown = await run_cli(capsys, "trigger", "no-such-job", "--url", i.url)
    assert (unknown.code, unknown.out) == (2, "")
    assert unknown.err == f"cronlock: unknown job 'no-such-job' at {i.url}\n"
    bad_slot = await run_cli(capsys, "trigger", "yearly", "--url", i.url, "--slot", "yesterday")
    assert bad_slot.code == 2
    monkeypatch.setenv("CRON_SECRET", "w" * 40)
    assert (await run_cli(capsys, "trigger", "fast", "--url", i.url)).code == 2  # 401
    unreachable = await run_cli(capsys, "trigger", "fast", "--url", "http://127.0.0.1:9")
    assert unreachable.code == 3
    assert "service unreachable" in unreachable.err


class Scripted(http.server.BaseHTTPRequestHandler):
    """A fake service (or the proxy in front of one): each request gets the next scripted
    answer, (status, content type, body); None closes the connection without one."""

    answers: ClassVar[list[tuple[int, str, str] | None]] = []

    def do_POST(self) -> None:
        self.answer()

    def do_GET(self) -> None:
        self.answer()

    def answer(self) -> None:
        scripted = self.answers.pop(0)
        if scripted is None:
            self.close_connection = True
            return
        status, kind, body = scripted
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body.encode())))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def scripted() -> Iterator[tuple[str, list[tuple[int, str, str] | None]]]:
    """A fake service's URL and its list of answers to come."""
    answers: list[tuple[int, str, str] | None] = []
    handler = type("Handler", (Scripted,), {"answers": answers})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", answers
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


JSON = "application/json"
HTML = (502, "text/html", "<html><body>Bad Gateway</body></html>")
FOLLOW = ["--no-wait", "--follow"]
RUNNING = (200, JSON, json.dumps({"id": 7, "status": "running"}))
SUCCEEDED = (200, JSON, json.dumps({"id": 7, "status": "succeeded"}))
ACCEPTED = (202, JSON, '{"run_id": 7}')


@pytest.mark.slow  # starts processes (the CLI): not in --fast
@pytest.mark.parametrize(
    ("script", "extra", "code", "message"),
    [
        # A proxy's 502 is the service unavailable (3), not a bad request (2).
        ([HTML], [], 3, "HTTP 502"),
        ([(507, JSON, "{}")], [], 3, "HTTP 507"),
        ([(418, JSON, "{}")], [], 2, "HTTP 418"),
        # A 202 of the wrong shape, a poll answered by a proxy's page: one line, exit 3.
        ([(202, JSON, "[1]")], FOLLOW, 3, "not the service's answer"),
        ([ACCEPTED, (200, "text/html", "<html>")], FOLLOW, 3, "not a JSON object"),
        # The service restarting while the run goes on: retried, the run's end is the exit.
        ([ACCEPTED, RUNNING, HTML, None, RUNNING, SUCCEEDED], FOLLOW, 0, "succeeded"),
    ],
    ids=["502", "507", "418", "202-shape", "poll-html", "poll-retried"],
)
def test_trigger_answers_that_are_not_the_services(
    cli_env: dict[str, str],
    scripted: tuple[str, list[tuple[int, str, str] | None]],
    script: list[tuple[int, str, str] | None],
    extra: list[str],
    code: int,
    message: str,
) -> None:
    url, answers = scripted
    answers[:] = script
    env = {**cli_env, "CRON_SECRET": TEST_SECRET}
    done = run_process(env, "trigger", "fast", "--url", url, *extra)
    assert done.returncode == code, (done.stdout, done.stderr)
    assert message in done.stdout + done.stderr, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    assert answers == []


# --- cancel -----------------------------------------------------------------------------------


async def test_cancel_rolls_the_run_back_and_records_it(
    start_app: StartApp,
    client: httpx.AsyncClient,
    db: asyncpg.Connection,
    cli_env: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    i = await start_app("svc")
    pending = asyncio.create_task(post(client, i.url + "/cron/slow-sql", json={"seconds": 20}))
    await wait_for(lambda: sleeping_in_sql(db), 10, "slow-sql to be in its pg_sleep")
    result = await run_cli(capsys, "cancel", "slow-sql", "--json")
    assert result.code == 0, result.err
    body = result.json()
    answer = await pending
    assert answer.status_code == 500
    assert answer.json()["run_id"] == body["run_id"]
    assert answer.json()["error"] == "job cancelled"
    assert body["released"] is True
    assert body["instance"] == "svc"
    assert body["signal"] == "holder"  # the holder saw the request on its row and stopped
    assert body["run"]["status"] == "cancelled"
    assert "cancelled at the request of " in body["run"]["error"]
    assert await effects(db, "slow-sql") == 0  # its writes rolled back
    assert [r["status"] for r in await runs(db, "slow-sql")] == ["cancelled"]
    again = await run_cli(capsys, "cancel", "slow-sql")
    assert again.code == 1
    assert "not running" in again.err
    assert (await post(client, i.url + "/cron/slow-sql", json={"seconds": 0})).status_code == 200


async def test_cancel_reaches_a_job_between_statements(
    start_app: StartApp,
    client: httpx.AsyncClient,
    db: asyncpg.Connection,
    cli_env: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`slow` sleeps in Python: its backend sits idle in transaction, where pg_cancel_backend
    is ignored. The request on its row reaches the holder, which cancels the job."""
    i = await start_app("svc", cancel_poll_interval=0.1)
    pending = asyncio.create_task(post(client, i.url + "/cron/slow", json={"seconds": 10}))
    await wait_for(lambda: lock_held(db, "slow"), 10, "slow to take its lock")
    await asyncio.sleep(0.3)
    result = await run_cli(capsys, "cancel", "slow", "--wait", "5", "--json")
    assert result.code == 0, result.err
    assert result.json()["signal"] == "holder"
    answer = await pending
    assert answer.status_code == 500
    assert answer.json()["error"] == "job cancelled"
    assert await effects(db, "slow") == 0
    [row] = await runs(db, "slow")
    assert row["status"] == "cancelled"
    assert await db.fetchval(
        "SELECT cancel_requested_by IS NOT NULL FROM cronlock.runs WHERE id = $1", row["id"]
    )


async def test_terminate_stays(
    start_app: StartApp,
    client: httpx.AsyncClient,
    db: asyncpg.Connection,
    cli_env: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    i = await start_app("svc")
    # 3 s: the job still sleeps when the CLI terminates its backend (0.3 s after the lock is
    # seen, plus the CLI's own start), with room for a loaded machine.
    pending = asyncio.create_task(post(client, i.url + "/cron/slow", json={"seconds": 3}))
    await wait_for(lambda: lock_held(db, "slow"), 10, "slow to take its lock")
    await asyncio.sleep(0.3)
    ended = await run_cli(capsys, "cancel", "slow", "--terminate", "--json")
    assert ended.code == 0, ended.err
    assert ended.json()["released"] is True
    assert ended.json()["signal"] == "terminate"
    assert not await lock_held(db, "slow")
    answer = await pending
    assert answer.status_code == 500
    assert await effects(db, "slow") == 0
    [row] = await runs(db, "slow")
    assert row["status"] == "failed"


# --- outbox -----------------------------------------------------------------------------------


async def test_outbox_dead_and_requeue(
    db: asyncpg.Connection, cli_env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    ids = [
        await db.fetchval(
            """INSERT INTO cronlock.email_outbox (job, slot, user_id, sender, recipient, subject,
                                                  body, status, attempts, last_error)
               VALUES ('daily-digest', now(), $1, 's@x', $2, 'subject', 'body', $3, 12,
                       'HTTP 422 invalid recipient') RETURNING id""",
            n,
            f"user{n}@example.com",
            status,
        )
        for n, status in ((1, "dead"), (2, "dead"), (3, "pending"))
    ]
    dead = await run_cli(capsys, "outbox", "dead", "--json")
    assert dead.code == 0
    assert [r["id"] for r in dead.json()["dead"]] == ids[:2]
    assert dead.json()["dead"][0]["last_error"] == "HTTP 422 invalid recipient"
    table = await run_cli(capsys, "outbox", "dead")
    assert table.out.splitlines()[0].split()[:3] == ["ID", "JOB", "SLOT"]
    assert "user1@example.com" in table.out
    one = await run_cli(capsys, "outbox", "requeue", str(ids[0]), str(ids[2]))
    assert one.code == 0
    assert f"requeued {ids[0]}" in one.out
    assert f"not dead (left alone): {ids[2]}" in one.err
    rest = await run_cli(capsys, "outbox", "requeue", "--all", "--json")
    assert [r["id"] for r in rest.json()["requeued"]] == [ids[1]]
    statuses = await db.fetch("SELECT status, attempts FROM cronlock.email_outbox ORDER BY id")
    assert [(r["status"], r["attempts"]) for r in statuses] == [("pending", 0)] * 2 + [
        ("pending", 12)
    ]
    assert (await run_cli(capsys, "outbox", "requeue")).code == 2
    assert (await run_cli(capsys, "outbox", "dead")).out.strip() == "no dead emails"


# --- catch-up ---------------------------------------------------------------------------------


async def test_catch_up_runs_a_missed_slot_once(
    db: asyncpg.Connection,
    cli_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("CRON_JOBS", "tests.jobs,tests.catchup_jobs")
    # A fresh database: the jobs' history starts now (catch-up records them as seen), so
    # nothing before it was missed.
    fresh = await run_cli(capsys, "catch-up")
    assert (fresh.code, fresh.out.strip()) == (0, "nothing to catch up")
    assert await db.fetchval("SELECT count(*) FROM cronlock.jobs_seen WHERE job = 'yearly'") == 1
    await seen_since(db, "catch-up-daily", "yearly")  # an old deployment's
    first = await run_cli(capsys, "catch-up", "--json")
    assert first.code == 0, first.err
    [caught] = first.json()["caught_up"]
    assert caught["job"] == "catch-up-daily"
    assert caught["processed"] == "backfill"
    again = await run_cli(capsys, "catch-up")
    assert again.out.strip() == "nothing to catch up"
    [row] = await runs(db, "catch-up-daily")
    assert (row["trigger"], row["source"], row["status"]) == ("backfill", "catch-up", "succeeded")
    # Overdue scheduled jobs that did not opt in are left alone.
    assert await runs(db, "yearly") == []


# --- serve ------------------------------------------------------------------------------------


class Served(Instance):
    """`python -m cronlock serve`, as the README's first command runs it (`python -m app serve`,
    the repository's service shell, as the Dockerfile runs it), in a folder of its own (where
    `var/` would go)."""

    module = "cronlock"

    def command(self) -> list[str]:
        host_port = ["--host", "127.0.0.1", "--port", str(self.port)]
        return [sys.executable, "-m", self.module, "serve", *host_port]

    def cwd(self) -> Path:
        return self.dir


class ServedAsTheImage(Served):
    module = "app"


@pytest.fixture
def serve_dir() -> Iterator[Path]:
    # Under /tmp, not pytest's 0700 basetemp: an embedded server runs as `postgres` as root.
    root = Path(tempfile.mkdtemp(prefix="cronlock-serve-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


async def test_serve_as_the_image_runs_it(
    database_url: str,
    db: asyncpg.Connection,
    serve_dir: Path,
    report_logs: Callable[[list[Instance]], None],
) -> None:
    """The Dockerfile's command: with DATABASE_URL and a secret given, `serve` starts no
    embedded PostgreSQL, writes nothing, and hands GRACEFUL_SHUTDOWN_TIMEOUT to uvicorn: a
    job still running at SIGTERM is cancelled after it, rolled back and recorded, instead of
    being waited for (uvicorn alone waits for ever)."""
    env = {
        "DATABASE_URL": database_url,
        "CRON_SECRET": TEST_SECRET,
        "CRON_JOBS": "tests.jobs",
        "OUTBOX_ENABLED": "false",
        "GRACEFUL_SHUTDOWN_TIMEOUT": "1.5",
    }
    served = ServedAsTheImage("image", env, dir=serve_dir, ready_path="/readyz")
    report_logs([served])
    served.start()
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            long = asyncio.create_task(
                post(client, served.url + "/cron/slow", json={"seconds": 20})
            )
            await wait_for(lambda: lock_held(db, "slow"), 10, "the job to run")
            started = time.monotonic()
            os.kill(served.pid, signal.SIGTERM)  # as an orchestrator signals PID 1
            code = await asyncio.to_thread(served.wait_exit, 15)
            took = time.monotonic() - started
            with contextlib.suppress(httpx.HTTPError):
                await long
    finally:
        served.stop(5)
    assert code == 128 + signal.SIGTERM
    assert took < 8, f"exited {took:.1f}s after SIGTERM: the 20 s job was waited for"
    assert [r["status"] for r in await runs(db, "slow")] == ["cancelled"]
    assert await effects(db, "slow") == 0
    assert not (serve_dir / "var").exists()


async def test_serve_with_nothing_configured_starts_what_it_needs(
    serve_dir: Path, report_logs: Callable[[list[Instance]], None]
) -> None:
    """The README's first command on a machine with nothing configured: an embedded
    PostgreSQL in var/pg, a generated secret (0600) with a curl header file, the demo digest
    once per slot; SIGTERM stops the embedded server too."""
    served = Served("front", {}, dir=serve_dir, ready_path="/healthz", ready_timeout=90)
    report_logs([served])
    served.start()
    try:
        async with httpx.AsyncClient(timeout=30, base_url=served.url) as client:

            async def ready() -> bool:
                return (await client.get("/readyz")).status_code == 200

            await wait_for(ready, 60, "the embedded database migrated")
            secret = serve_dir / "var" / "cron_secret"
            assert secret.stat().st_mode & 0o777 == 0o600
            header = (serve_dir / "var" / "cron_auth_header").read_text().strip()
            name, value = header.split(": ", 1)
            auth = {name: value}
            assert (await client.post("/cron/daily-digest")).status_code == 401
            first = await client.post("/cron/daily-digest", headers=auth)
            assert first.status_code == 200, first.text
            assert first.json()["processed"] == 3
            again = await client.post("/cron/daily-digest", headers=auth)
            assert again.json()["reason"] == "already done"
            # The dashboard as a newcomer opens it: the address serve printed, the secret
            # file's token, a cookie without Secure on loopback http (and serve says so).
            printed = served.output_path.read_text()
            assert f"dashboard at {served.url}/ui/" in printed
            assert "cookie without Secure" in printed
            login = await client.get("/ui/login")
            token = secret.read_text().strip()
            done = await client.post(
                "/ui/login", data={"csrf": csrf_of(login.text), "token": token}
            )
            assert done.status_code == 303
            assert "Secure" not in done.headers["set-cookie"]
            assert "daily-digest" in (await client.get("/ui/")).text
        pid_file = serve_dir / "var" / "pg" / "postmaster.pid"
        assert pid_file.exists()
        os.kill(served.pid, signal.SIGTERM)
        assert await asyncio.to_thread(served.wait_exit, 30) == 128 + signal.SIGTERM
    finally:
        served.stop(5)
    assert not pid_file.exists(), "the embedded PostgreSQL outlived serve"


def cli_in(folder: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`python -m cronlock ARGS` as a process in `folder`, with no DATABASE_URL unless given."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("CRON_", "DATABASE_"))}
    full.pop("EMBEDDED_PG_DIR", None)
    full.update(env, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "cronlock", *args],
        cwd=folder,
        env=full,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        check=False,
        timeout=90,
    )


async def test_the_cli_finds_the_embedded_server_serve_runs(
    serve_dir: Path, report_logs: Callable[[list[Instance]], None]
) -> None:
    """The quick start's next step: with no DATABASE_URL, the CLI run in serve's folder reads
    the embedded server that serve runs (its `cronlock` database: the runs serve made). What
    serve prints is true: the secret generated, then reused; a curl line for a job it serves
    (the demo's, then another when CRON_JOBS has no demo); a second serve on the same port or
    folder refuses before any hint. With serve stopped, the CLI says what to set, exit 2."""
    served = Served("front", {}, dir=serve_dir, ready_path="/readyz", ready_timeout=90)
    report_logs([served])
    served.start()
    try:
        printed = served.output_path.read_text()
        assert "no CRON_SECRET set; generated one into var/cron_secret (mode 0600)" in printed
        assert "using var/cron_secret" not in printed
        curl = f"curl -X POST -H @var/cron_auth_header {served.url}/cron/daily-digest"
        assert curl in printed
        header = (serve_dir / "var" / "cron_auth_header").read_text().strip()
        name, value = header.split(": ", 1)
        async with httpx.AsyncClient(timeout=30, base_url=served.url) as client:
            ran = await client.post("/cron/daily-digest", headers={name: value})
        assert ran.status_code == 200, ran.text
        listed = await asyncio.to_thread(
            cli_in, serve_dir, "runs", "--job", "daily-digest", "--json"
        )
        assert listed.returncode == 0, listed.stderr
        assert [r["id"] for r in json.loads(listed.stdout)["runs"]] == [ran.json()["run_id"]]
        table = await asyncio.to_thread(cli_in, serve_dir, "jobs")
        assert table.returncode == 0, table.stderr
        assert "daily-digest" in table.stdout
        # A second serve: the same port, then the same folder on another port.
        for port in (served.port, None):
            args = ["serve", "--host", "127.0.0.1", "--port", str(port or 0)]
            second = await asyncio.to_thread(cli_in, serve_dir, *args)
            said = second.stdout + second.stderr
            assert second.returncode == 3, said
            assert said.count("\n") == 1, said
            assert "curl" not in said
            expected = "cannot listen on 127.0.0.1" if port else "in use by another process"
            assert expected in said
        os.kill(served.pid, signal.SIGTERM)
        assert await asyncio.to_thread(served.wait_exit, 30) == 128 + signal.SIGTERM
    finally:
        served.stop(5)
    stopped = await asyncio.to_thread(cli_in, serve_dir, "runs")
    assert stopped.returncode == 2, stopped.stderr
    assert stopped.stderr.count("\n") == 1, stopped.stderr
    assert "the embedded PostgreSQL in var/pg is not running" in stopped.stderr
    assert "set DATABASE_URL" in stopped.stderr
    elsewhere = await asyncio.to_thread(cli_in, serve_dir / "var", "jobs")
    assert elsewhere.returncode == 2, elsewhere.stderr
    assert "there is no embedded PostgreSQL in var/pg" in elsewhere.stderr
    assert "set DATABASE_URL=postgresql://" in elsewhere.stderr
    # Started again, without the demo: the file is reused, and the curl line names a job the
    # service has.
    again = Served("again", {"CRON_JOBS": "tests.jobs"}, dir=serve_dir, ready_path="/readyz")
    report_logs([again])
    again.start()
    try:
        printed = again.output_path.read_text()
        assert "no CRON_SECRET set; using var/cron_secret" in printed
        assert "generated" not in printed
        assert "daily-digest" not in printed
        shown = serve.curl_job(load(["tests.jobs"]))
        assert shown is not None
        assert f"trigger {shown} with:" in printed
        assert f"-H @var/cron_auth_header {again.url}/cron/{shown}\n" in printed
    finally:
        again.stop(5)


def test_serve_shows_a_curl_line_only_for_a_job_a_bare_post_runs() -> None:
    """The demo's digest when served; never a housekeeping job, nor one whose params a bare
    POST lacks (a 422) or that needs a key: no line rather than a wrong one."""
    assert serve.curl_job(load(["cronlock.demo.digest", "cronlock.housekeeping"])) == "daily-digest"
    assert serve.curl_job(load(["cronlock.housekeeping"])) is None
    tests_jobs = load(["tests.jobs"])
    chosen = serve.curl_job(tests_jobs)
    assert chosen is not None
    assert tests_jobs[chosen].module == "tests.jobs"
    assert tests_jobs[chosen].key is None
    params = tests_jobs[chosen].params
    assert params is None or params.model_validate({}) is not None
    # A required field (a bare POST is a 422), a key to give: no line.
    required = dataclasses.replace(tests_jobs["slow"], params=NeedsTo)
    assert serve.curl_job(Registry(jobs={"slow": required})) is None
    assert tests_jobs["keyed"].key is not None
    assert serve.curl_job(Registry(jobs={"keyed": tests_jobs["keyed"]})) is None
    assert serve.curl_job(Registry(jobs={"slow": tests_jobs["slow"]})) == "slow"  # a default


class NeedsTo(BaseModel):
    to: str


@pytest.mark.parametrize(
    ("argv0", "shown"),
    [
        ("/venv/bin/cronlock", "cronlock"),
        ("/src/cronlock/__main__.py", "python -m cronlock"),
        ("/src/app/__main__.py", "python -m app"),
    ],
)
def test_help_names_the_program_as_typed(argv0: str, shown: str) -> None:
    assert cli.program_name(argv0) == shown


def test_help_as_a_process_names_the_program_as_typed() -> None:
    """`python -m app --help`, `python -m cronlock --help` and the `cronlock` console script."""
    script = Path(sys.executable).parent / "cronlock"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CRON_", "DATABASE_"))}
    env["PYTHONPATH"] = str(REPO)
    commands = {
        "python -m app": [sys.executable, "-m", "app"],
        "python -m cronlock": [sys.executable, "-m", "cronlock"],
        "cronlock": [str(script)],
    }
    for shown, command in commands.items():
        done = subprocess.run(
            [*command, "migrate", "--help"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"usage: {shown} migrate "), done.stdout
