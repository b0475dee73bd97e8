"""Dynamic schedules over HTTP (`/cron/jobs/{job}/schedules...`: writes with the secret, reads
with the read token too) and on the command line (`cronlock schedules ...`): 422 naming the
field / exit 2, nothing written."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from cronlock.cli import main as cli
from tests.support import TEST_SECRET, auth_headers
from tests.support.asgi import StartApp

READ = "r" * 40
JOBS = "tests.dynamic_jobs"


async def count(db: asyncpg.Connection) -> int:
    return int(await db.fetchval("SELECT count(*) FROM cronlock.schedules"))


async def test_http_routes(
    start_app: StartApp, client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """PUT, GET one, GET a page (prefix, cursor, due_before), DELETE; the read token reads but
    cannot write."""
    app = await start_app("a", cron_jobs=JOBS, cron_read_token=READ)
    base = f"{app.url}/cron/jobs/tenant-report/schedules"
    secret, reader = auth_headers(), auth_headers(READ)
    body = {"schedule": "0 9 * * 1-5", "tz": "Europe/Berlin", "params": {"name": "weekly"}}
    put = await client.put(f"{base}/42", json=body, headers=secret)
    assert put.status_code == 200, put.text
    row = put.json()
    assert row["key"] == "42"
    assert row["params"]["tenant_id"] == 42
    assert row["next_at_local"].startswith(row["next_at_local"][:11])
    assert "T09:00:00+0" in row["next_at_local"]
    assert (await client.put(f"{base}/43", json=body, headers=reader)).status_code == 401
    for key in range(100, 105):
        ok = await client.put(f"{base}/{key}", json={"every": 60}, headers=secret)
        assert ok.status_code == 200
    one = await client.get(f"{base}/42", headers=reader)
    assert one.status_code == 200, one.text
    assert one.json()["schedule"] == "0 9 * * 1-5"
    page = (await client.get(base, params={"prefix": "10", "limit": 3}, headers=reader)).json()
    assert [r["key"] for r in page["schedules"]] == ["100", "101", "102"]
    rest = await client.get(base, params={"prefix": "10", "after": page["next"]}, headers=reader)
    assert [r["key"] for r in rest.json()["schedules"]] == ["103", "104"]
    assert rest.json()["next"] is None
    soon = await client.get(base, params={"due_before": "2000-01-01T00:00:00Z"}, headers=reader)
    assert soon.json()["schedules"] == []
    paused = await client.put(f"{base}/100", json={"every": 60, "paused": True}, headers=secret)
    assert paused.json()["paused"] is True
    assert (await client.delete(f"{base}/42", headers=reader)).status_code == 401
    assert (await client.delete(f"{base}/42", headers=secret)).status_code == 200
    assert (await client.delete(f"{base}/42", headers=secret)).status_code == 404
    assert (await client.get(f"{base}/42", headers=reader)).status_code == 404
    missing = await client.get(f"{app.url}/cron/jobs/nope/schedules", headers=reader)
    assert missing.status_code == 404
    assert await count(db) == 5


@pytest.mark.parametrize(
    ("job", "key", "body", "loc"),
    [
        ("tenant-report", "1", {"schedule": "0 0 30 2 *"}, ["body", "schedule"]),
        ("tenant-report", "1", {"schedule": "0 9 * * *", "tz": "Nowhere/City"}, ["body", "tz"]),
        ("tenant-report", "1", {"schedule": 5}, ["body", "schedule"]),
        ("tenant-report", "1", {"every": 1.5}, ["body", "every"]),
        (
            "tenant-report",
            "1",
            {"every": 60, "params": {"sleep": "x"}},
            ["body", "params", "sleep"],
        ),
        ("tenant-report", "1", {"every": 60, "paused": "yes"}, ["body", "paused"]),
        ("tenant-report", "1", {"every": 60, "color": "red"}, ["body", "color"]),
        ("tenant-report", "abc", {"every": 60}, ["path", "key"]),
        ("user-digest", "x" * 201, {"every": 60}, ["path", "key"]),
        ("keyed-by-hand", "1", {"every": 60}, ["path", "job"]),
    ],
)
async def test_http_bad_input_is_422_naming_the_field(
    start_app: StartApp,
    client: httpx.AsyncClient,
    db: asyncpg.Connection,
    job: str,
    key: str,
    body: dict[str, Any],
    loc: list[str],
) -> None:
    app = await start_app("a", cron_jobs=JOBS)
    url = f"{app.url}/cron/jobs/{job}/schedules/{key}"
    answer = await client.put(url, json=body, headers=auth_headers())
    assert answer.status_code == 422, answer.text
    assert answer.json()["detail"][0]["loc"] == loc, answer.text
    assert await count(db) == 0


async def test_http_bad_body_and_query(
    start_app: StartApp, client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    app = await start_app("a", cron_jobs=JOBS)
    base = f"{app.url}/cron/jobs/tenant-report/schedules"
    for raw in (b"{", b"[1]", b"null"):
        answer = await client.put(f"{base}/1", content=raw, headers=auth_headers())
        assert answer.status_code == 422, raw
    for query in ({"limit": 0}, {"due_before": "2026-01-01T00:00:00"}, {"prefix": "a\x00"}):
        answer = await client.get(base, params=query, headers=auth_headers())
        assert answer.status_code == 422, (query, answer.text)
        assert answer.json()["detail"][0]["loc"][0] == "query"
    assert await count(db) == 0


@pytest.fixture
def cli_env(database_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    for name in list(os.environ):
        if name.startswith(("CRON_", "DATABASE_", "CRONLOCK_")):
            monkeypatch.delenv(name)
    for name, value in {
        "DATABASE_URL": database_url,
        "CRON_JOBS": JOBS,
        "CRON_SECRET": TEST_SECRET,
        "OUTBOX_ENABLED": "false",
    }.items():
        monkeypatch.setenv(name, value)


async def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = await asyncio.to_thread(cli.main, list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.usefixtures("cli_env")
async def test_cli(capsys: pytest.CaptureFixture[str], db: asyncpg.Connection) -> None:
    """set, show, ls, pause, resume, rm; bad values exit 2 naming the field, write nothing."""
    code, out, _ = await run(
        capsys,
        "schedules",
        "set",
        "tenant-report",
        "7",
        "--schedule",
        "30 8 * * *",
        "--tz",
        "Asia/Tokyo",
        "--params",
        '{"name": "daily"}',
        "--json",
    )
    assert code == 0
    assert json.loads(out)["next_at_local"].endswith("T08:30:00+09:00")
    code, out, _ = await run(capsys, "schedules", "show", "tenant-report", "7")
    assert code == 0
    assert "30 8 * * * in Asia/Tokyo" in out
    code, out, _ = await run(capsys, "schedules", "ls", "tenant-report")
    assert code == 0
    assert out.splitlines()[0].startswith("KEY")
    assert (await run(capsys, "schedules", "pause", "tenant-report", "7"))[0] == 0
    assert (await run(capsys, "schedules", "resume", "tenant-report", "7"))[0] == 0
    assert (await run(capsys, "schedules", "rm", "tenant-report", "7"))[0] == 0
    assert (await run(capsys, "schedules", "rm", "tenant-report", "7"))[0] == 1
    for args, field in (
        (("--schedule", "0 0 30 2 *"), "schedule"),
        (("--schedule", "0 9 * * *", "--tz", "Moon/Base"), "tz"),
        (("--every", "60", "--params", '{"sleep": -1}'), "params.sleep"),
        (("--every", "60", "--params", "{"), "params"),
    ):
        code, _, err = await run(capsys, "schedules", "set", "tenant-report", "1", *args)
        assert code == 2, err
        assert f"invalid {field}" in err, err
    code, _, err = await run(capsys, "schedules", "set", "tenant-report", "x", "--every", "60")
    assert (code, "invalid key" in err) == (2, True), err
    code, _, err = await run(capsys, "schedules", "set", "keyed-by-hand", "1", "--every", "60")
    assert (code, "invalid job" in err) == (2, True), err
    assert await count(db) == 0


async def test_jobs_metrics_and_export_count_dynamic_jobs(
    start_app: StartApp, client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """/cron/jobs and /metrics: schedules, paused, due, late per dynamic job; the export says who
    dispatches them and writes no entry for them."""
    from cronlock.core.jobs import load
    from cronlock.ops.export import export

    app = await start_app("a", cron_jobs=JOBS)
    base = f"{app.url}/cron/jobs/tenant-report/schedules"
    for key in range(3):
        body = {"every": 3600, "paused": key == 0}
        assert (await client.put(f"{base}/{key}", json=body, headers=auth_headers())).is_success
    # One due for an hour: late (past its grace), so the job is overdue.
    await db.execute(
        "UPDATE cronlock.schedules SET due_at = now() - interval '1 hour' WHERE key = '2'"
    )
    view = (await client.get(f"{app.url}/cron/jobs", headers=auth_headers())).json()
    report = next(j for j in view["jobs"] if j["name"] == "tenant-report")
    assert report["schedule"] == "dynamic"
    assert report["schedules"] == {"schedules": 3, "paused": 1, "due": 1, "late": 1}
    assert report["overdue"] is True
    metrics = (await client.get(f"{app.url}/metrics", headers=auth_headers())).text
    assert 'cronlock_schedules{job="tenant-report",state="all"} 3.0' in metrics
    assert 'cronlock_schedules{job="tenant-report",state="late"} 1.0' in metrics
    assert 'cronlock_job_overdue{job="tenant-report"} 1.0' in metrics
    text, notes = export(load([JOBS]), "crontab", url="http://x")
    assert "tenant-report: dynamic schedules" in text
    assert "/cron/tenant-report" not in text
    assert any("tenant-report: dynamic" in n and "built-in scheduler" in n for n in notes)
