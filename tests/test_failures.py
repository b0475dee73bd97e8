"""A failed run says what failed: its exception's type, message and traceback are stored with
its row, answered by GET /cron/runs/{id}, shown on its page and logged at error, bounded in
size and with the settings' secrets hidden. In-process, on a real database."""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import httpx
import pytest

from cronlock.cli import main as cli
from cronlock.core.failure import MAX_MESSAGE, MAX_TRACEBACK, failure_of
from cronlock.settings import Settings, scrub
from tests.failure_jobs import LEAK
from tests.support import TEST_SECRET
from tests.support.asgi import InProcess, StartApp
from tests.support.ui import User
from tests.util import AUTH, wait_for

API_KEY = "re_live_0123456789abcdefghij"
SMTP_PASSWORD = "smtp-pass-word-42"
DB_PASSWORD = "p@ss/w0rd"
SECRETS = (TEST_SECRET, API_KEY, SMTP_PASSWORD, DB_PASSWORD, "p%40ss%2Fw0rd")


def test_the_settings_name_their_secrets() -> None:
    settings = Settings(
        _env_file=None,
        database_url="postgresql://app:p%40ss%2Fw0rd@db.example/app",
        cron_secret=TEST_SECRET,
        email_api_key=API_KEY,
        smtp_password=SMTP_PASSWORD,
        alert_webhook_url="https://hooks.example/T0/B0/secretpart",
    )
    found = settings.secret_values()
    for secret in (*SECRETS, "https://hooks.example/T0/B0/secretpart"):
        assert secret in found
    text = f"postgresql://app:p%40ss%2Fw0rd@db.example/app {TEST_SECRET} {DB_PASSWORD}"
    assert scrub(text, found) == "postgresql://app:***@db.example/app *** ***"


def test_a_failure_is_bounded() -> None:
    try:
        raise RuntimeError("y" * 100_000)
    except RuntimeError as exc:
        failure = failure_of(exc, [])
    assert failure["type"] == "RuntimeError"
    assert len(failure["message"]) < MAX_MESSAGE + 100
    assert len(failure["traceback"]) < MAX_TRACEBACK + 100
    # The end is kept: where it failed, and the message's last characters.
    assert failure["traceback"].rstrip().endswith("y")
    assert "characters left out" in failure["traceback"]


async def test_a_failed_run_says_what_failed(
    start_app: StartApp, db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The test database's URL has no password: the URL's is checked above.
    monkeypatch.setenv(LEAK, f"{TEST_SECRET} {API_KEY} {SMTP_PASSWORD}")
    app = await start_app(
        cron_jobs="tests.failure_jobs",
        email_api_key=API_KEY,
        smtp_password=SMTP_PASSWORD,
        ui_cookie_secure=False,
    )
    async with httpx.AsyncClient(transport=app.transport, base_url=app.url, headers=AUTH) as c:
        r = await c.post("/cron/leaks-a-secret")
        assert r.status_code == 500, r.text
        run_id = r.json()["run_id"]
        assert "traceback" not in r.text  # the trigger's answer stays short
        run = (await c.get(f"/cron/runs/{run_id}")).json()
    failure: dict[str, Any] = run["failure"]
    assert failure["type"] == "ValueError"
    assert failure["message"] == "billing failed with *** *** ***"
    tb = failure["traceback"]
    assert "ConnectionError: cannot reach" in tb  # the cause, and where it was raised
    assert "_connect" in tb
    assert "The above exception was the direct cause" in tb
    row = await db.fetchrow("SELECT error, failure FROM cronlock.runs WHERE id = $1", run_id)
    assert row is not None
    assert json.loads(row["failure"]) == failure
    log = app.log()
    (line,) = [json.loads(x) for x in log.splitlines() if '"leaks-a-secret failed"' in x]
    assert line["level"] == "error"
    assert line["error_type"] == "ValueError"
    assert line["traceback"] == tb
    for secret in (TEST_SECRET, API_KEY, SMTP_PASSWORD):
        for where in (str(run), row["error"], row["failure"], log):
            assert secret not in where, (secret, where)
    # The run's page shows the traceback too.
    async with User(app) as user:
        await user.login(TEST_SECRET)
        page = await user.http.get(f"/ui/runs/{run_id}")
        assert page.status_code == 200
        assert "ConnectionError: cannot reach" in page.text
        assert "Traceback" in page.text
        for secret in (TEST_SECRET, API_KEY, SMTP_PASSWORD):
            assert secret not in page.text


async def test_a_long_failure_is_stored_bounded(
    start_app: StartApp, db: asyncpg.Connection
) -> None:
    app = await start_app(cron_jobs="tests.failure_jobs")
    async with httpx.AsyncClient(transport=app.transport, base_url=app.url, headers=AUTH) as c:
        r = await c.post("/cron/raises-long")
        assert r.status_code == 500, r.text
        run = (await c.get(f"/cron/runs/{r.json()['run_id']}")).json()
        listed = (await c.get("/cron/runs")).json()
    assert len(run["error"]) <= 2000
    assert len(run["failure"]["message"]) < MAX_MESSAGE + 100
    assert len(run["failure"]["traceback"]) < MAX_TRACEBACK + 100
    assert listed["runs"][0]["failure"] is None  # lists stay light


# --- database errors say PostgreSQL's own words -------------------------------------------


def _with(url: str, *, user: str | None = None, database: str | None = None) -> str:
    parts = urlsplit(url)
    netloc = parts.netloc
    if user is not None:
        netloc = f"{user}:not-the-password-9f8e@{netloc.rpartition('@')[2]}"
    path = f"/{database}" if database is not None else parts.path
    return urlunsplit(parts._replace(netloc=netloc, path=path))


async def _logs(app: InProcess, words: str) -> bool:
    return words in " ".join(json.loads(line)["msg"] for line in app.log().splitlines())


async def test_a_database_error_says_what_postgresql_said(
    start_app: StartApp,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    nobody = _with(database_url, user="nobody")
    missing = _with(database_url, database="no_such_db")
    for url, words in (
        (nobody, '28000: role "nobody" does not exist'),
        (missing, '3D000: database "no_such_db" does not exist'),
    ):
        # The service's answer, its log, and the CLI's line carry the code and the message.
        app = await start_app(f"app-{words[:5]}", database_url=url, migrate_on_start=False)
        async with httpx.AsyncClient(transport=app.transport, base_url=app.url, headers=AUTH) as c:
            r = await c.post("/cron/fast")
        assert r.status_code == 503, r.text
        assert words in r.json()["reason"], r.text
        # The watcher logs what the request answered; on a busy machine a moment later.
        await wait_for(functools.partial(_logs, app, words), 10, f"the log to say {words}")
        monkeypatch.setenv("DATABASE_URL", url)
        monkeypatch.setenv("CRON_JOBS", "tests.jobs")
        capsys.readouterr()
        assert await asyncio.to_thread(cli.main, ["runs"]) == 3
        err = capsys.readouterr().err
        assert words in err, err
        for shown in (r.text, app.log(), err):
            assert "not-the-password-9f8e" not in shown
