"""Pause and resume (cronlock/core/pause.py, cronlock/web/control.py, the CLI's `pause` / `resume`).

In-process (`start_app`): what is under test is the state in the database and the two places
it is checked (the probe, and under the lock); the several-instances proof is in
tests/test_on_its_own.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from tests.support.asgi import StartApp
from tests.test_cli import cli_env, run_cli  # noqa: F401 - cli_env is a fixture
from tests.util import AUTH, effects, own_runner, post


async def test_pause_skips_triggers_everywhere_force_runs_resume_restores(
    start_app: StartApp, client: Any, db: asyncpg.Connection
) -> None:
    a = await start_app("a")
    b = await start_app("b")
    r = await post(client, a.url + "/cron/jobs/minutely/pause", json={"note": "migration"})
    assert r.status_code == 200, r.text
    state = r.json()["paused"]
    assert state["by"] == "api"
    assert state["note"] == "migration"
    assert state["until"] is None
    # Right after the pause, at the other instance too: one round trip, the probe's.
    for instance in (a, b):
        r = await post(client, instance.url + "/cron/minutely")
        assert r.status_code == 200
        assert r.json() == {"job": "minutely", "skipped": True, "reason": "paused"}
    # A key-less unscheduled job is paused the same way.
    await post(client, a.url + "/cron/jobs/fast/pause")
    assert (await post(client, b.url + "/cron/fast")).json()["reason"] == "paused"
    assert await effects(db) == 0
    # force=true is an operator's manual run: it runs.
    r = await post(client, b.url + "/cron/minutely?force=true")
    assert r.status_code == 200
    assert "processed" in r.json()
    jobs = {
        j["name"]: j for j in (await client.get(a.url + "/cron/jobs", headers=AUTH)).json()["jobs"]
    }
    assert jobs["minutely"]["paused"]["note"] == "migration"
    assert jobs["minutely"]["overdue"] is False
    assert jobs["yearly"]["paused"] is None
    metrics = (await client.get(a.url + "/metrics", headers=AUTH)).text
    assert 'cronlock_job_paused{job="minutely"} 1.0' in metrics
    assert 'cronlock_job_paused{job="yearly"} 0.0' in metrics
    assert 'cronlock_skips_total{job="minutely",reason="paused"} 1.0' in metrics

    r = await post(client, b.url + "/cron/jobs/minutely/resume")
    assert r.json() == {"job": "minutely", "paused": None, "was_paused": True}
    r = await post(client, a.url + "/cron/minutely")
    assert "processed" in r.json()
    again = await post(client, b.url + "/cron/jobs/minutely/resume")
    assert again.json()["was_paused"] is False


async def test_pause_is_checked_under_the_lock_too(
    start_app: StartApp, client: Any, db: asyncpg.Connection
) -> None:
    """A backfill takes no probe: only the check under the lock can stop it."""
    a = await start_app("a")
    slot = (datetime.now(UTC) - timedelta(minutes=3)).replace(second=0, microsecond=0)
    await post(client, a.url + "/cron/jobs/minutely/pause")
    r = await client.post(a.url + "/cron/minutely", params={"slot": slot.isoformat()}, headers=AUTH)
    assert r.json()["reason"] == "paused"
    assert await db.fetchval("SELECT count(*) FROM cronlock.runs") == 0
    await post(client, a.url + "/cron/jobs/minutely/resume")
    r = await client.post(a.url + "/cron/minutely", params={"slot": slot.isoformat()}, headers=AUTH)
    assert "processed" in r.json()


async def test_until_ends_the_pause_on_its_own(
    start_app: StartApp, client: Any, db: asyncpg.Connection
) -> None:
    a = await start_app("a")
    now = await db.fetchval("SELECT now()")
    until = now + timedelta(seconds=1)
    r = await post(client, a.url + "/cron/jobs/fast/pause", json={"until": until.isoformat()})
    assert r.status_code == 200
    assert (await post(client, a.url + "/cron/fast")).json()["reason"] == "paused"
    await asyncio.sleep(1.2)
    assert "processed" in (await post(client, a.url + "/cron/fast")).json()
    jobs = (await client.get(a.url + "/cron/jobs", headers=AUTH)).json()["jobs"]
    assert all(j["paused"] is None for j in jobs)


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"until": "2001-01-01T00:00:00Z"}, 422),  # in the past
        ({"until": "2030-01-01T00:00:00"}, 422),  # no offset
        ({"note": "x" * 501}, 422),
        ({"note": "nul\x00"}, 422),
        ({"whatever": 1}, 422),
        ([1], 422),
    ],
)
async def test_bad_pause_requests_are_422(
    start_app: StartApp, client: Any, body: Any, status: int
) -> None:
    a = await start_app("a")
    r = await post(client, a.url + "/cron/jobs/fast/pause", json=body)
    assert r.status_code == status, r.text
    assert "error" in r.json()


async def test_a_pause_body_past_max_body_bytes_is_413(
    start_app: StartApp, client: Any, db: asyncpg.Connection
) -> None:
    """Read with the size-limited reader, as every other body: declared or streamed."""
    a = await start_app("a", max_body_bytes=1000)
    note = {"note": "n" * 2000}
    r = await post(client, a.url + "/cron/jobs/fast/pause", json=note)
    assert (r.status_code, r.json()) == (413, {"error": "request body too large", "limit": 1000})

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(4):
            yield b" " * 512

    r = await client.post(a.url + "/cron/jobs/fast/pause", content=chunks(), headers=AUTH)
    assert r.status_code == 413, r.text
    assert await db.fetchval("SELECT count(*) FROM cronlock.pauses") == 0
    r = await post(client, a.url + "/cron/jobs/fast/pause", json={"note": "n" * 100})
    assert r.status_code == 200, r.text


async def test_pause_needs_the_secret_and_a_known_job(start_app: StartApp, client: Any) -> None:
    a = await start_app("a", cron_read_token="r" * 40)
    r = await client.post(a.url + "/cron/jobs/fast/pause")
    assert r.status_code == 401
    r = await client.post(
        a.url + "/cron/jobs/fast/pause", headers={"Authorization": "Bearer " + "r" * 40}
    )
    assert r.status_code == 401  # the read token cannot pause
    r = await post(client, a.url + "/cron/jobs/no-such-job/pause")
    assert r.status_code == 404
    assert r.json()["error"] == "unknown job"
    r = await post(client, a.url + "/cron/jobs/no-such-job/resume")
    assert r.status_code == 404


@pytest.mark.usefixtures("cli_env")
async def test_cli_pause_and_resume(
    capsys: pytest.CaptureFixture[str], db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = await run_cli(capsys, "pause", "yearly", "--note", "incident 42", "--json")
    assert result.code == 0, result.err
    assert result.json()["paused"]["note"] == "incident 42"
    assert "@" in result.json()["paused"]["by"]  # user@host
    started = datetime.fromisoformat(result.json()["paused"]["at"])
    jobs = await run_cli(capsys, "jobs")
    assert "PAUSED" in next(line for line in jobs.out.splitlines() if line.startswith("yearly"))
    past = await run_cli(capsys, "pause", "yearly", "--until", "2001-01-01T00:00:00Z")
    assert past.code == 2
    assert "future" in past.err
    assert (await run_cli(capsys, "pause", "no-such-job")).code == 2
    # Paused again while paused: who and the note are replaced, the start is kept (the
    # dashboard and paused_too_long count from it). CRONLOCK_OPERATOR names the operator.
    monkeypatch.setenv("CRONLOCK_OPERATOR", "alice (on call)")
    again = await run_cli(capsys, "pause", "yearly", "--note", "still 42", "--json")
    assert again.code == 0, again.err
    kept = again.json()["paused"]
    assert datetime.fromisoformat(kept.pop("at")) == started
    assert kept == {"by": "alice (on call)", "note": "still 42", "until": None}
    # An expired pause is not kept: pausing again starts a new one.
    await db.execute(
        "UPDATE cronlock.pauses SET until = now() - interval '1 second', "
        "paused_at = now() - interval '1 hour' WHERE job = 'yearly'"
    )
    anew = await run_cli(capsys, "pause", "yearly", "--json")
    assert anew.code == 0, anew.err
    assert datetime.fromisoformat(anew.json()["paused"]["at"]) > started
    result = await run_cli(capsys, "resume", "yearly")
    assert (result.code, result.out.strip()) == (0, "yearly: resumed")
    result = await run_cli(capsys, "resume", "yearly")
    assert result.out.strip() == "yearly: was not paused"
    assert await db.fetchval("SELECT count(*) FROM cronlock.pauses") == 0


async def test_an_on_demand_run_is_manual_and_still_paused(
    start_app: StartApp,
    client: Any,
    db: asyncpg.Connection,
    make_settings: Any,
) -> None:
    """A curl (POST /cron/<job>) of a job without a schedule is recorded `manual`, a
    scheduled job's stays `scheduled`; the label exempts nothing from a pause: only
    `force=true` runs a paused job, in the probe and under the lock alike."""
    a = await start_app("a")
    r = await post(client, a.url + "/cron/fast")
    assert r.status_code == 200, r.text
    await post(client, a.url + "/cron/yearly")
    triggers = await db.fetch("SELECT job, trigger, source FROM cronlock.runs ORDER BY id")
    assert [tuple(t) for t in triggers] == [
        ("fast", "manual", "http"),
        ("yearly", "scheduled", "http"),
    ]
    await post(client, a.url + "/cron/jobs/fast/pause")
    r = await post(client, a.url + "/cron/fast")
    assert r.json() == {"job": "fast", "skipped": True, "reason": "paused"}
    # Under the lock (no probe, as when the lock keys could not be checked): paused too.
    async with own_runner(make_settings()) as runner:
        runner.probe_keys = None
        fast = runner.registry["fast"]
        skipped = await runner.trigger(fast)
        assert (skipped.kind, skipped.reason, skipped.trigger) == ("skipped", "paused", "manual")
        assert await db.fetchval("SELECT count(*) FROM cronlock.runs WHERE job = 'fast'") == 1
        forced = await runner.trigger(fast, force=True)
        assert (forced.kind, forced.trigger) == ("succeeded", "manual")
    r = await post(client, a.url + "/cron/fast?force=true")
    assert "processed" in r.json()
    rows = await db.fetch("SELECT trigger FROM cronlock.runs WHERE job = 'fast' ORDER BY id")
    assert [row["trigger"] for row in rows] == ["manual", "manual", "manual"]
