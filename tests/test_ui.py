"""The dashboard in-process (httpx against the ASGI app): sessions and their safety, the
pages, the actions. The browser's view of it is tests/test_ui_browser.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import httpx
import pytest

from cronlock import Cronlock
from cronlock.core.jobs import Job
from cronlock.core.schedule import Schedule
from cronlock.ops.views import RunView
from cronlock.settings import Settings
from cronlock.web.ui import timeline, words
from cronlock.web.ui.session import CSP
from tests.support import TEST_SECRET, auth_headers
from tests.support.asgi import InProcess, StartApp
from tests.support.ui import READ_TOKEN, User, csrf_of
from tests.ui_jobs import HOSTILE
from tests.util import seen_since

JOBS = "tests.jobs,tests.ui_jobs"
PAGES = ["/ui/", "/ui/jobs/fast", "/ui/jobs/hourly", "/ui/locks", "/ui/outbox"]
# Markup that must only ever appear escaped.
RAW = "<script>alert("


async def ui_app(start_app: StartApp, name: str = "app", **settings: Any) -> InProcess:
    settings.setdefault("cron_read_token", READ_TOKEN)
    settings.setdefault("ui_cookie_secure", False)  # httpx sends no Secure cookie over http
    return await start_app(name, cron_jobs=JOBS, **settings)


async def dead_email(db: asyncpg.Connection, recipient: str, error: str) -> int:
    """A dead-lettered email, as the sender leaves one after its last attempt."""
    email_id: int = await db.fetchval(
        "INSERT INTO cronlock.email_outbox (job, sender, recipient, subject, body, status,"
        " attempts, last_error) VALUES ('daily-digest', 'a@example.com', $1, 'Hi', 'body',"
        " 'dead', 12, $2) RETURNING id",
        recipient,
        error,
    )
    return email_id


# --- what is open, and the session check before routing ------------------------------------


async def test_only_login_and_static_are_open(start_app: StartApp) -> None:
    app = await ui_app(start_app)
    async with User(app) as anonymous:
        http = anonymous.http
        assert (await http.get("/ui/login")).status_code == 200
        static = await http.get("/ui/static/ui.css")
        assert static.status_code == 200
        assert static.headers["content-security-policy"] == CSP
        # Only files: a path that climbs out of the static folder is no page.
        assert (await http.get("/ui/static/%2e%2e/jobs/fast")).status_code == 404
        # Every other path, known or not, asks for a session first (404s reveal nothing).
        for path in [*PAGES, "/ui/runs/1", "/ui/outbox/1", "/ui/no-such-page", "/ui"]:
            r = await http.get(path)
            assert (r.status_code, r.headers.get("location")) == (303, "/ui/login"), path
        for path in ["/ui/jobs/fast/run", "/ui/outbox/requeue", "/ui/logout", "/ui/nope"]:
            assert (await http.post(path)).status_code == 401, path


async def test_pages_carry_the_security_headers(start_app: StartApp) -> None:
    app = await ui_app(start_app)
    async with User(app) as user:
        await user.login(TEST_SECRET)
        for path in [*PAGES, "/ui/login"]:
            r = await user.http.get(path)
            assert r.status_code == 200, path
            assert r.headers["content-security-policy"] == CSP
            assert "unsafe-inline" not in CSP
            assert "frame-ancestors 'none'" in CSP
            assert r.headers["cache-control"] == "no-store"
            assert r.headers["x-content-type-options"] == "nosniff"
            # No inline script or style for the CSP to refuse.
            assert "<script>" not in r.text
            assert "style=" not in r.text
            assert "<style" not in r.text


async def test_the_bearer_api_is_unchanged_and_ignores_the_cookie(start_app: StartApp) -> None:
    app = await ui_app(start_app)
    async with User(app) as user:
        await user.login(TEST_SECRET)
        cookie = user.http.cookies["cronlock_session"]
        # The browser never sends it there (Path=/ui), and a forged one is worth nothing.
        forged = {"Cookie": f"cronlock_session={cookie}"}
        for method, path in [("POST", "/cron/fast"), ("GET", "/cron/jobs"), ("GET", "/metrics")]:
            r = await user.http.request(method, path, headers=forged)
            assert r.status_code == 401, path
        r = await user.http.post("/cron/fast", headers=auth_headers())
        assert r.status_code == 200


async def test_without_the_dashboard_ui_paths_need_the_secret(start_app: StartApp) -> None:
    app = await ui_app(start_app, ui_enabled=False)
    async with User(app) as anonymous:
        assert (await anonymous.http.get("/ui/login")).status_code == 401
        assert (await anonymous.http.get("/ui/", headers=auth_headers())).status_code == 404


# --- login, logout, rotation ---------------------------------------------------------------


async def test_login_cookie_attributes(start_app: StartApp) -> None:
    app = await ui_app(start_app, ui_cookie_secure=True)
    async with User(app) as user:
        # httpx keeps Secure cookies for https: the login form's cookie is sent by hand.
        form = await user.http.get("/ui/login")
        login_cookie = form.headers["set-cookie"].split(";")[0]
        assert "Secure" in form.headers["set-cookie"]
        r = await user.http.post(
            "/ui/login",
            data={"csrf": csrf_of(form.text), "token": TEST_SECRET},
            headers={"Cookie": login_cookie},
        )
        assert r.status_code == 303
        assert r.headers["location"] == "/ui/"
        cookie = next(
            v for v in r.headers.get_list("set-cookie") if v.startswith("cronlock_session=")
        )
        attributes = {a.strip() for a in cookie.split(";")[1:]}
        assert {"Path=/ui", "HttpOnly", "SameSite=Strict", "Secure"} <= attributes


@pytest.mark.parametrize(
    ("token", "who"),
    [(TEST_SECRET, "secret: can act"), (READ_TOKEN, "read token: view only")],
)
async def test_login_with_each_token(start_app: StartApp, token: str, who: str) -> None:
    app = await ui_app(start_app)
    async with User(app) as user:
        assert (await user.login(token)).status_code == 303
        page = await user.http.get("/ui/")
        assert page.status_code == 200
        assert who in page.text
    # No secret in a page or in the log.
    assert token not in page.text
    assert token not in app.log()
    assert f'"token": "{"secret" if token == TEST_SECRET else "read"}"' in app.log()


async def test_a_wrong_token_or_no_login_csrf_is_refused(
    start_app: StartApp, db: asyncpg.Connection
) -> None:
    app = await ui_app(start_app)
    async with User(app) as user:
        r = await user.login("not-the-secret-" + "x" * 30)
        assert r.status_code == 401
        assert "not one this service accepts" in r.text
        assert "cronlock_session" not in r.headers.get("set-cookie", "")
        # The login form's own CSRF token (double submit): a cross-site login is refused.
        r = await user.http.post("/ui/login", data={"token": TEST_SECRET})
        assert r.status_code == 403
    assert await db.fetchval("SELECT count(*) FROM cronlock.ui_sessions") == 0


async def test_logout_ends_the_session_on_every_instance(start_app: StartApp) -> None:
    one = await ui_app(start_app, "one")
    two = await ui_app(start_app, "two")
    async with User(one) as user:
        await user.login(TEST_SECRET)
        cookie = {"Cookie": f"cronlock_session={user.http.cookies['cronlock_session']}"}
        async with httpx.AsyncClient(transport=two.transport, base_url=two.url) as other:
            assert (await other.get("/ui/", headers=cookie)).status_code == 200
            r = await user.act("/ui/logout")
            assert r.status_code == 303
            assert r.headers["location"] == "/ui/login"
            assert (await other.get("/ui/", headers=cookie)).status_code == 303
        assert (await user.http.get("/ui/", headers=cookie)).status_code == 303


async def test_rotating_a_token_ends_its_sessions(
    start_app: StartApp, db: asyncpg.Connection
) -> None:
    old = await ui_app(start_app, "old")
    async with User(old) as user:
        await user.login(TEST_SECRET)
        cookie = {"Cookie": f"cronlock_session={user.http.cookies['cronlock_session']}"}
    new_secret = "a-rotated-cron-secret-0123456789-abcdefghijklmn"
    # During the rotation the previous secret is still accepted: its sessions live on.
    during = await ui_app(
        start_app, "during", cron_secret=new_secret, cron_secret_previous=TEST_SECRET
    )
    async with httpx.AsyncClient(transport=during.transport, base_url=during.url) as http:
        assert (await http.get("/ui/", headers=cookie)).status_code == 200
    after = await ui_app(start_app, "after", cron_secret=new_secret)
    async with httpx.AsyncClient(transport=after.transport, base_url=after.url) as http:
        assert (await http.get("/ui/", headers=cookie)).status_code == 303
    assert await db.fetchval("SELECT count(*) FROM cronlock.ui_sessions") == 0


# --- acting: CSRF, the read token, what is recorded ----------------------------------------


async def test_a_form_without_its_csrf_token_is_refused(
    start_app: StartApp, db: asyncpg.Connection
) -> None:
    app = await ui_app(start_app)
    async with User(app) as user:
        await user.login(TEST_SECRET)
        for data in [{}, {"csrf": "forged"}]:
            r = await user.http.post("/ui/jobs/fast/run", data=data)
            assert r.status_code == 403
            assert "CSRF" in r.text
            r = await user.http.post("/ui/logout", data=data)
            assert r.status_code == 403
    assert await db.fetchval("SELECT count(*) FROM cronlock.runs") == 0


async def test_the_read_token_sees_but_cannot_act(
    start_app: StartApp, db: asyncpg.Connection
) -> None:
    app = await ui_app(start_app)
    email_id = await dead_email(db, "alice@example.com", "550 no mailbox alice@example.com")
    async with User(app) as reader:
        await reader.login(READ_TOKEN)
        jobs = await reader.http.get("/ui/")
        assert "Run now" not in jobs.text
        assert '/run"' not in jobs.text
        outbox = await reader.http.get("/ui/outbox")
        assert "Requeue" not in outbox.text
        # Masked: personal data, in the recipient column and inside the provider's error.
        assert "alice@example.com" not in outbox.text
        assert "a•••@example.com" in outbox.text
        email = await reader.http.get(f"/ui/outbox/{email_id}")
        assert "alice@example.com" not in email.text
        assert "a•••@example.com" in email.text
        for path, fields in [("/ui/jobs/fast/run", {}), ("/ui/outbox/requeue", {"id": "all"})]:
            r = await reader.act(path, **fields)
            assert r.status_code == 403
            assert "read token" in r.text
    assert await db.fetchval("SELECT count(*) FROM cronlock.runs") == 0
    assert await db.fetchval("SELECT status FROM cronlock.email_outbox") == "dead"
    # An address in a run's params, result or error is masked as well.
    async with User(app) as admin:
        await admin.login(TEST_SECRET)
        r = await admin.act("/ui/jobs/note/run", params='{"text": "to bob@example.org"}')
        run_page = r.headers["location"]
        assert "bob@example.org" in (await admin.http.get(run_page)).text
    async with User(app) as reader:
        await reader.login(READ_TOKEN)
        page = (await reader.http.get(run_page)).text
        assert "bob@example.org" not in page
        assert "b•••@example.org" in page
    async with User(app) as admin:
        await admin.login(TEST_SECRET)
        assert "alice@example.com" in (await admin.http.get("/ui/outbox")).text


async def test_run_now_is_recorded_with_source_ui(
    start_app: StartApp, db: asyncpg.Connection
) -> None:
    app = await ui_app(start_app)
    async with User(app) as user:
        await user.login(TEST_SECRET)
        r = await user.act("/ui/jobs/note/run", params='{"text": "hello"}')
        assert r.status_code == 303
        assert r.headers["location"].startswith("/ui/runs/")
        run = await db.fetchrow("SELECT * FROM cronlock.runs")
        assert run is not None
        assert (run["source"], run["trigger"]) == ("ui", "manual")
        page = await user.http.get(r.headers["location"])
        assert "<dd>ui</dd>" in page.text
        bad = await user.act("/ui/jobs/note/run", params="{not json")
        assert bad.status_code == 422
        assert "Invalid params" in bad.text
        typo = await user.act("/ui/jobs/note/run", params='{"txt": "hello"}')
        assert typo.status_code == 422
        assert "txt: Extra inputs are not permitted" in typo.text
    action = await db.fetchrow("SELECT kind, action, target, detail FROM cronlock.ui_actions")
    assert action is not None
    assert (action["kind"], action["action"], action["target"]) == ("secret", "run", "note")
    assert json.loads(action["detail"])["run_id"] == run["id"]
    assert '"action": "run"' in app.log()
    assert '"token": "secret"' in app.log()


async def test_requeue_one_and_all(start_app: StartApp, db: asyncpg.Connection) -> None:
    app = await ui_app(start_app)
    first = await dead_email(db, "a@example.com", "422 refused")
    await dead_email(db, "b@example.com", "422 refused")
    await dead_email(db, "c@example.com", "422 refused")
    async with User(app) as user:
        await user.login(TEST_SECRET)
        r = await user.act("/ui/outbox/requeue", id=str(first))
        assert r.headers["location"] == "/ui/outbox?notice=requeued"
        status = "SELECT status FROM cronlock.email_outbox WHERE id = $1"
        assert await db.fetchval(status, first) == "pending"
        assert (
            await db.fetchval("SELECT count(*) FROM cronlock.email_outbox WHERE status = 'dead'")
            == 2
        )
        await user.act("/ui/outbox/requeue", id="all")
        assert (
            await db.fetchval("SELECT count(*) FROM cronlock.email_outbox WHERE status = 'dead'")
            == 0
        )
        r = await user.act("/ui/outbox/requeue", id="all")
        assert r.headers["location"] == "/ui/outbox?notice=nothing-dead"
        assert (await user.act("/ui/outbox/requeue", id="x")).status_code == 422
    actions = await db.fetch("SELECT target, detail FROM cronlock.ui_actions ORDER BY id")
    assert [a["target"] for a in actions] == [str(first), "all", "all"]
    assert len(json.loads(actions[1]["detail"])["ids"]) == 2


async def test_outbox_counts_sent_rows_and_the_send_rate(
    start_app: StartApp, db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sent 30 s, 10 min and 2 h ago (by the database's clock), one pending, one dead; the
    rows kept are counted up to a bound (5 here, 100,000 by default), then "more than"."""
    app = await ui_app(start_app)
    await db.execute(
        "INSERT INTO cronlock.email_outbox (job, user_id, sender, recipient, subject, body,"
        " status, sent_at) SELECT 'daily-digest', g, 'a@example.com', 'u@example.com', 'Hi',"
        " 'body', 'sent', now() - make_interval(secs => s) FROM unnest($1::int[], $2::float8[])"
        " AS t(g, s)",
        [1, 2, 3, 4],
        [30, 600, 7200, 7300],
    )
    await db.execute(
        "INSERT INTO cronlock.email_outbox (job, user_id, sender, recipient, subject, body)"
        " VALUES ('daily-digest', 9, 'a@example.com', 'u@example.com', 'Hi', 'body')"
    )
    await dead_email(db, "d@example.com", "422 refused")
    monkeypatch.setattr("cronlock.delivery.outbox.KEPT_COUNT_LIMIT", 5)
    async with User(app) as user:
        await user.login(READ_TOKEN)
        text = (await user.http.get("/ui/outbox")).text
        assert '<dd data-count="sent">4 kept</dd>' in text
        assert "1 in the last minute, 2 in the last hour" in text
        assert '<dd data-count="dead">1</dd>' in text
        older = (
            "INSERT INTO cronlock.email_outbox (job, user_id, sender, recipient, subject, body,"
            " status, sent_at) VALUES ('daily-digest', $1, 'a@example.com', 'u@example.com',"
            " 'Hi', 'body', 'sent', now() - interval '3 hours')"
        )
        await db.execute(older, 10)
        text = (await user.http.get("/ui/outbox")).text
        assert '<dd data-count="sent">5 kept</dd>' in text  # the bound itself, counted
        await db.execute(older, 11)
        text = (await user.http.get("/ui/outbox")).text
        assert '<dd data-count="sent">more than 5 kept</dd>' in text
        assert "1 in the last minute, 2 in the last hour" in text


async def test_cancel_when_not_running(start_app: StartApp) -> None:
    app = await ui_app(start_app)
    async with User(app) as user:
        await user.login(TEST_SECRET)
        r = await user.act("/ui/jobs/fast/cancel")
        assert r.headers["location"] == "/ui/jobs/fast?notice=not-running"


async def test_pause_and_resume_are_recorded(
    start_app: StartApp, db: asyncpg.Connection, client: httpx.AsyncClient
) -> None:
    app = await ui_app(start_app)
    async with User(app) as user:
        await user.login(TEST_SECRET)
        r = await user.act("/ui/jobs/fast/pause", note=f"deploy {HOSTILE}", until="")
        assert r.headers["location"] == "/ui/jobs/fast?notice=paused"
        page = (await user.http.get("/ui/")).text
        assert "paused by ui (secret)" in page
        assert RAW not in page
        skipped = await client.post(f"{app.url}/cron/fast", headers=auth_headers())
        assert skipped.json()["reason"] == "paused"
        past = await user.act("/ui/jobs/fast/pause", until="2001-01-01T00:00:00+00:00")
        assert past.status_code == 422
        r = await user.act("/ui/jobs/fast/resume")
        assert r.headers["location"] == "/ui/jobs/fast?notice=resumed"
        ran = await client.post(f"{app.url}/cron/fast", headers=auth_headers())
        assert "run_id" in ran.json()
    actions = await db.fetch("SELECT action, detail FROM cronlock.ui_actions ORDER BY id")
    assert [a["action"] for a in actions] == ["pause", "resume"]
    assert HOSTILE in json.loads(actions[0]["detail"])["note"]


async def test_bad_form_values_are_a_422_page_not_a_500_or_a_503(start_app: StartApp) -> None:
    """What the API refuses with a 422 the forms refuse too (cronlock/inputs.py's rules): an end
    time whose instant PostgreSQL cannot store, a NUL in a note, a NUL or overlong key."""
    app = await ui_app(start_app)
    async with User(app) as user:
        await user.login(TEST_SECRET)
        for path, fields in (
            ("/ui/jobs/fast/pause", {"until": "9999-12-31T23:00:00-05:00"}),
            ("/ui/jobs/fast/pause", {"note": "a\x00b"}),
            ("/ui/jobs/keyed/cancel", {"key": "a\x00b"}),
            ("/ui/jobs/keyed/cancel", {"key": "k" * 10_000}),
        ):
            r = await user.act(path, **fields)
            assert r.status_code == 422, (path, fields, r.status_code, r.text[:300])
            assert "Traceback" not in r.text
        filtered = await user.http.get("/ui/jobs/keyed", params={"key": "a\x00b"})
        assert filtered.status_code == 422


# --- escaping ------------------------------------------------------------------------------


async def test_everything_rendered_is_escaped(
    start_app: StartApp, db: asyncpg.Connection, client: httpx.AsyncClient
) -> None:
    app = await ui_app(start_app)
    email_id = await dead_email(db, f"{HOSTILE}@example.com", f"provider said {HOSTILE}")
    # A job's error, and params, with markup: triggered over the API as a scheduler would.
    r = await client.post(
        f"{app.url}/cron/hostile-error", headers=auth_headers(), json={"text": HOSTILE}
    )
    assert r.status_code == 500
    run_id = r.json()["run_id"]
    async with User(app) as user:
        await user.login(TEST_SECRET)
        for path in [
            *PAGES,
            "/ui/jobs/hostile-error",
            f"/ui/runs/{run_id}",
            f"/ui/outbox/{email_id}",
        ]:
            page = await user.http.get(path)
            assert page.status_code == 200, path
            assert RAW not in page.text, path
        run = (await user.http.get(f"/ui/runs/{run_id}")).text
        assert "&lt;script&gt;alert(" in run  # the error and the params, shown escaped
        outbox = (await user.http.get("/ui/outbox")).text
        assert outbox.count("&lt;script&gt;alert(") >= 2  # recipient and provider error


async def test_a_run_whose_holder_is_gone_is_shown_abandoned(
    start_app: StartApp, db: asyncpg.Connection
) -> None:
    """A `running` row whose lock nobody holds (its instance died): the run page closes it
    as the sweep does everywhere, and shows what that wrote."""
    app = await ui_app(start_app)
    run_id = await db.fetchval(
        "INSERT INTO cronlock.runs (job, status, trigger, source, instance, started_at)"
        " VALUES ('fast', 'running', 'manual', 'http', 'gone', now() - interval '1 minute')"
        " RETURNING id"
    )
    async with User(app) as user:
        await user.login(TEST_SECRET)
        page = (await user.http.get(f"/ui/runs/{run_id}")).text
    assert await db.fetchval("SELECT status FROM cronlock.runs WHERE id = $1", run_id) == (
        "abandoned"
    )
    assert "abandoned" in page


async def test_a_lease_run_shows_its_holder_token_attempts_and_progress(
    start_app: StartApp, db: asyncpg.Connection
) -> None:
    app = await ui_app(start_app)
    first = await db.fetchval(
        "INSERT INTO cronlock.runs (job, status, trigger, source, instance, started_at,"
        " finished_at, error) VALUES ('fast', 'abandoned', 'manual', 'http', 'i1', now(),"
        " now(), 'lease expired') RETURNING id"
    )
    run_id = await db.fetchval(
        "INSERT INTO cronlock.runs (job, status, trigger, source, instance, started_at, attempt,"
        " retry_of, lease_token, lease_seconds, lease_expires_at, deadline_at, checkpoint,"
        " progress, steps) VALUES ('fast', 'running', 'manual', 'http', 'i2', now(), 2, $1,"
        " 41, 30, now() + interval '30 seconds', now() + interval '1 hour',"
        " '{\"after_id\": 1200}', $2::jsonb, 7) RETURNING id",
        first,
        json.dumps({"done": 1200, "of": HOSTILE}),
    )
    async with User(app) as user:
        await user.login(TEST_SECRET)
        page = (await user.http.get(f"/ui/runs/{run_id}")).text
    assert "<h2>Lease</h2>" in page
    assert "<dt>Token</dt><dd>41</dd>" in page
    assert "<dt>Holder</dt><dd>i2</dd>" in page
    assert f'continues <a href="/ui/runs/{first}">run {first}</a>' in page
    assert "&#34;after_id&#34;: 1200" in page
    assert "<dt>Steps committed</dt><dd>7</dd>" in page
    assert RAW not in page


# --- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("/ui/jobs/no-such-job", 404),
        ("/ui/runs/999999", 404),
        ("/ui/runs/abc", 422),
        ("/ui/runs/99999999999999999999999", 422),
        ("/ui/outbox/999999", 404),
        ("/ui/jobs/fast?status=bogus", 422),
        ("/ui/jobs/fast?days=3", 422),
        ("/ui/jobs/fast?before=-1", 422),
    ],
)
async def test_bad_input_is_a_page_not_a_trace(start_app: StartApp, path: str, status: int) -> None:
    app = await ui_app(start_app)
    async with User(app) as user:
        await user.login(TEST_SECRET)
        r = await user.http.get(path)
        assert r.status_code == status
        assert r.headers["content-type"].startswith("text/html")
        assert "Traceback" not in r.text


async def test_the_job_page_filters_its_runs(
    start_app: StartApp, client: httpx.AsyncClient
) -> None:
    app = await ui_app(start_app)
    for path in ["/cron/fast", "/cron/fast?force=true", "/cron/fails"]:
        await client.post(app.url + path, headers=auth_headers())
    async with User(app) as user:
        await user.login(TEST_SECRET)
        every = (await user.http.get("/ui/jobs/fast")).text
        assert every.count('data-run="') == 2
        only = (await user.http.get("/ui/jobs/fast?status=failed")).text
        assert only.count('data-run="') == 0
        assert "No runs." in only
        assert "<svg" in every
        assert 'class="mark status-succeeded"' in every


async def test_run_now_shows_the_params_schema_and_an_example(start_app: StartApp) -> None:
    """The params form starts from the model's defaults (or a shape to fill in) and shows its
    JSON schema; a job without params has no params form (a body would be refused)."""
    app = await ui_app(start_app)
    async with User(app) as user:
        await user.login(TEST_SECRET)
        note = (await user.http.get("/ui/jobs/note")).text
        assert "Run now with params" in note
        textarea = note.split('<textarea id="params"')[1].split("</textarea>")[0]
        assert json.loads(textarea.split(">", 1)[1].replace("&#34;", '"')) == {"text": ""}
        assert "The params model's defaults" in note
        assert "Params schema (JSON Schema)" in note
        assert "&#34;maxLength&#34;: 200" in note  # from Field(max_length=200)
        # A keyed job's required key with no default: its lowest valid value, open at once.
        keyed = (await user.http.get("/ui/jobs/keyed")).text
        assert '<details class="run-params" open>' in keyed
        example = keyed.split('<textarea id="params"')[1].split("</textarea>")[0]
        assert json.loads(example.split(">", 1)[1].replace("&#34;", '"')) == {
            "customer_id": 1,
            "seconds": 0.0,
        }
        fast = (await user.http.get("/ui/jobs/fast")).text
        assert "Run now with params" not in fast
        assert 'data-action="run"' in fast  # the plain button stays


def test_the_params_example_follows_the_model() -> None:
    from pydantic import BaseModel, Field

    from cronlock.web.ui.params import form

    class Inner(BaseModel):
        when: datetime
        flag: bool = True

    class Params(BaseModel):
        customer_id: int = Field(gt=0)
        name: str = Field(min_length=2)
        dry_run: bool = False
        tags: list[str] = []
        inner: Inner
        choice: int | None = None

    found = form(Params)
    assert found is not None
    assert json.loads(found.example) == {
        "customer_id": 1,
        "name": "xx",
        "dry_run": False,
        "tags": [],
        "inner": {"when": "2026-01-01T00:00:00Z", "flag": True},
        "choice": None,
    }
    assert found.valid  # every placeholder passes its constraint
    assert json.loads(found.schema) == Params.model_json_schema()
    assert form(None) is None

    class Coded(BaseModel):
        code: str = Field(pattern="^[A-Z]{3}$")

    shape = form(Coded)
    assert shape is not None
    assert json.loads(shape.example) == {"code": ""}
    assert not shape.valid  # the page then asks for real values


async def test_run_now_of_a_scheduled_or_paused_job_asks_first(
    start_app: StartApp, db: asyncpg.Connection
) -> None:
    """A forced run that repeats a slot's work (a scheduled job) or overrides a pause is a
    page with a form to confirm, which works without JavaScript; an on-demand job runs at
    once. Nothing runs, and nothing is recorded, until it is confirmed."""
    app = await ui_app(start_app)
    async with User(app) as user:
        await user.login(TEST_SECRET)
        asked = await user.act("/ui/jobs/hourly/run")
        assert asked.status_code == 200
        assert "Run hourly now?" in asked.text
        assert "does not count as the slot's run" in asked.text
        assert 'name="confirm" value="yes"' in asked.text
        assert await db.fetchval("SELECT count(*) FROM cronlock.runs") == 0
        assert await db.fetchval("SELECT count(*) FROM cronlock.ui_actions") == 0
        confirmed = await user.http.post(
            "/ui/jobs/hourly/run",
            data={"csrf": csrf_of(asked.text), "params": "", "confirm": "yes"},
        )
        assert confirmed.status_code == 303
        assert confirmed.headers["location"].startswith("/ui/runs/")
        row = await db.fetchrow("SELECT job, trigger, source FROM cronlock.runs")
        assert row is not None
        assert tuple(row) == ("hourly", "manual", "ui")
        # Asked again: the slot's state is said (a manual run does not make it succeeded).
        again = await user.act("/ui/jobs/hourly/run")
        assert "has no succeeded run yet" in again.text
        # On demand: no question. Paused: asked, and the pause is named.
        assert (await user.act("/ui/jobs/fast/run")).status_code == 303
        await user.act("/ui/jobs/fast/pause", note="maintenance")
        paused = await user.act("/ui/jobs/fast/run")
        assert paused.status_code == 200
        assert "The job is paused (by ui (secret): maintenance)" in paused.text
        # A bad params text is refused before any question.
        assert (await user.act("/ui/jobs/hourly/run", params="{nope")).status_code == 422


async def test_a_run_without_params_or_result_says_none(
    start_app: StartApp, client: httpx.AsyncClient
) -> None:
    app = await ui_app(start_app)
    ran = await client.post(app.url + "/cron/fails", headers=auth_headers())
    run_id = ran.json()["run_id"]
    async with User(app) as user:
        await user.login(TEST_SECRET)
        text = (await user.http.get(f"/ui/runs/{run_id}")).text
        assert '<p class="params muted">none</p>' in text
        assert '<p class="result muted">none</p>' in text
        assert "null" not in text


async def test_the_runs_page_lists_every_jobs_runs_and_failures(
    start_app: StartApp, client: httpx.AsyncClient
) -> None:
    app = await ui_app(start_app)
    for path in ["/cron/fast", "/cron/fails", "/cron/note", "/cron/fast"]:
        await client.post(app.url + path, headers=auth_headers())
    async with User(app) as user:
        await user.login(TEST_SECRET)
        jobs = (await user.http.get("/ui/")).text
        assert '<a href="/ui/runs">Runs</a>' in jobs  # in the navigation
        every = (await user.http.get("/ui/runs")).text
        recent, runs = every.split("<h2>Recent runs</h2>")
        assert recent.count('data-run="') == 1  # the one failure, above
        assert '<a href="/ui/jobs/fails">fails</a>' in recent
        assert runs.count('data-run="') == 4
        for job in ("fast", "fails", "note"):
            assert f'<a href="/ui/jobs/{job}">{job}</a>' in runs
        failures = (await user.http.get("/ui/runs?status=failures")).text
        assert failures.count('data-run="') == 1
        assert "Recent failures" not in failures
        one_job = (await user.http.get("/ui/runs?job=fast")).text
        assert one_job.count('data-run="') == 2  # both runs, no failure
        assert "No failures." in one_job
        paged = (await user.http.get("/ui/runs?status=succeeded&before=3")).text
        assert paged.count('data-run="') == 1
        assert (await user.http.get("/ui/runs?status=nope")).status_code == 422
        assert (await user.http.get("/ui/runs?job=nope")).status_code == 404
        assert (await user.http.get("/ui/runs?before=x")).status_code == 422


async def test_the_timeline_starts_when_the_job_was_first_seen(
    start_app: StartApp, db: asyncpg.Connection
) -> None:
    """A fresh install's hourly job missed nothing; deployed long ago, its past day's slots
    are missed (none ran), counted in words that agree with the number."""
    app = await ui_app(start_app)
    async with User(app) as user:
        await user.login(TEST_SECRET)
        fresh = (await user.http.get("/ui/jobs/hourly")).text
        assert "0 runs, 0 missed slots" in fresh
        assert 'class="slot missed"' not in fresh
        assert "Its history starts" in fresh
        await seen_since(db, "hourly")
        old = (await user.http.get("/ui/jobs/hourly?days=1")).text
        assert "Its history starts" not in old
        missed = old.count('class="slot missed"')
        assert missed >= 23
        assert f"0 runs, {missed} missed slots" in old
    assert words.counted(1, "missed slot") == "1 missed slot"
    assert words.counted(0, "run") == "0 runs"
    assert words.counted(2, "run") == "2 runs"


# --- the parts without HTTP ------------------------------------------------------------------


def _run(
    run_id: int, started: datetime, slot: datetime | None, status: str = "succeeded"
) -> RunView:
    return RunView(
        id=run_id,
        job="hourly",
        key=None,
        slot=slot,
        status=status,
        trigger="scheduled",
        source="http",
        instance="i1",
        started_at=started,
        finished_at=started + timedelta(seconds=2),
        duration_ms=2000.0,
        params=None,
        result=1,
        error=None,
        running=False,
        attempt=1,
        retry_of=None,
        cancel_requested_at=None,
        holder=None,
        token=None,
        lease_expires_at=None,
        checkpoint=None,
        progress=None,
        steps=None,
    )


def test_timeline_marks_runs_and_missed_slots() -> None:
    job = Job(name="hourly", func=lambda ctx: None, schedule=Schedule.parse("0 * * * *"))  # type: ignore[arg-type, return-value]
    now = datetime(2026, 12, 3, 12, 30, tzinfo=UTC)
    slots = [now.replace(minute=0) - timedelta(hours=h) for h in range(24)]
    # Every hour ran but three; one of those failed (a run, not a gap).
    runs = [_run(i, s, s) for i, s in enumerate(slots) if i not in (3, 4, 5)]
    runs.append(_run(99, slots[5], slots[5], "failed"))
    long_ago = now - timedelta(days=30)  # deployed a month ago
    line = timeline.build(job, runs, now, days=1, seen=long_ago)
    assert len(line.marks) == 22
    assert sum(1 for m in line.marks if m.status == "failed") == 1
    assert line.missed == 2
    assert len(line.slots) == 24
    missed = [t for t in line.slots if t.missed]
    assert all(0 <= t.x <= timeline.WIDTH for t in line.slots)
    assert {t.title for t in missed} == {
        f"slot {slots[h].strftime('%Y-%m-%d %H:%M')}: missed" for h in (3, 4)
    }
    # Only the newest runs fetched (the page's query is capped): the slots older than the
    # oldest of them are not known to be missed.
    newest = [r for r in runs if r.started_at > slots[6]]  # back to slot 5's failed run
    partial = timeline.build(job, newest, now, days=1, seen=long_ago, complete=False)
    assert partial.missed == 2  # slots 3 and 4, after the oldest run given
    assert (
        timeline.build(job, newest, now, days=1, seen=long_ago).missed == 20
    )  # as if the rest were
    # History starts when the database first saw the job: first seen at 08:10, the 09:00 slot
    # is missed but not the 08:00 one (nor any older); never seen, nothing is missed.
    since_8 = timeline.build(job, newest, now, days=1, seen=now.replace(hour=8, minute=10))
    assert [t.title for t in since_8.slots if t.missed] == ["slot 2026-12-03 09:00: missed"]
    assert since_8.missed == 1
    assert timeline.build(job, [], now, days=1, seen=now - timedelta(minutes=1)).missed == 0
    assert timeline.build(job, [], now, days=1, seen=None).missed == 0
    assert timeline.build(job, [], now, days=1, seen=long_ago).missed == 24
    every_minute = Job(name="m", func=lambda ctx: None, schedule=Schedule.parse("* * * * *"))  # type: ignore[arg-type, return-value]
    assert not timeline.build(every_minute, [], now, days=1, seen=long_ago).slots_drawn


@pytest.mark.parametrize(
    ("expr", "said"),
    [
        ("* * * * *", "every minute"),
        ("*/5 * * * *", "every 5 minutes"),
        ("15 * * * *", "every hour at minute 15"),
        ("0 7 * * *", "every day at 07:00"),
        ("0 7 * * 1-5", "at 07:00, Monday to Friday"),
        ("30 6 1 * *", "at 06:30 on day 1 of every month"),
        ("0 0 1 1 *", "cron 0 0 1 1 *"),
        (None, "no schedule (triggered on demand)"),
    ],
)
def test_schedules_in_words(expr: str | None, said: str) -> None:
    assert words.schedule(expr) == said


def test_masking() -> None:
    assert words.mask("alice@example.com") == "a•••@example.com"
    assert words.mask("550 <bob.smith@mail.example.org> unknown") == (
        "550 <b•••@mail.example.org> unknown"
    )


def test_paused_and_failing_badges_render_from_the_views_fields() -> None:
    """A job view's `paused` and `retry` become its badges (the template alone, escaped)."""
    from types import SimpleNamespace

    from cronlock.web.ui.pages import templates

    until = datetime(2026, 12, 4, 8, 0, tzinfo=UTC)
    view = SimpleNamespace(
        overdue=False,
        running=False,
        running_keys=[],
        paused=SimpleNamespace(by="ui (secret)", at=until, note=HOSTILE, until=until),
        retry=SimpleNamespace(retry=2, of=3),
    )
    html = templates.get_template("_badges.html").render(row=view, root="")
    assert "failing, retry 2 of 3" in html
    assert "paused by ui (secret) until 2026-12-04 08:00:00 UTC: &lt;script&gt;" in html
    assert RAW not in html
    assert ">ok<" not in html
    plain = SimpleNamespace(overdue=False, running=False, running_keys=[], paused=None, retry=None)
    quiet = templates.get_template("_badges.html").render(row=plain, root="")
    assert "failing" not in quiet
    assert "paused" not in quiet
    assert ">ok<" in quiet


async def test_the_less_common_shapes_render(
    start_app: StartApp, db: asyncpg.Connection, client: httpx.AsyncClient
) -> None:
    """A keyed job (its key filter, its run with a key), a run with a cancel request, an email
    waiting in a batch: every branch of the templates renders (they refuse unknown fields)."""
    app = await ui_app(start_app)
    r = await client.post(f"{app.url}/cron/keyed", headers=auth_headers(), json={"customer_id": 7})
    run_id = r.json()["run_id"]
    await db.execute(
        "UPDATE cronlock.runs SET cancel_requested_at = now(), cancel_requested_by = 'cli'"
        " WHERE id = $1",
        run_id,
    )
    batch = await db.fetchval(
        "INSERT INTO cronlock.email_batch (idempotency_key, body, size, attempts, last_error)"
        " VALUES ('b-1', '\\x00', 2, 1, 'timeout') RETURNING id"
    )
    email_id = await db.fetchval(
        "INSERT INTO cronlock.email_outbox (job, sender, recipient, subject, body, batch_id,"
        " next_attempt_at) VALUES ('daily-digest', 'a@example.com', 'c@example.com', 'Hi',"
        " 'body', $1, 'infinity') RETURNING id",
        batch,
    )
    async with User(app) as user:
        await user.login(TEST_SECRET)
        job = (await user.http.get("/ui/jobs/keyed?key=7")).text
        assert 'id="f-key"' in job
        assert job.count('data-run="') == 1
        assert "with its key <code>customer_id</code>" in job
        run = (await user.http.get(f"/ui/runs/{run_id}")).text
        assert "<dt>Key</dt><dd>7</dd>" in run
        assert "<dt>Cancel requested</dt>" in run
        email = (await user.http.get(f"/ui/outbox/{email_id}")).text
        assert "with its batch" in email
        assert f"{batch}: pending, 1 attempts, last error: timeout" in email


async def test_a_lease_job_page_says_its_lease(start_app: StartApp) -> None:
    from tests.lease_jobs import LEASE_SETTINGS

    app = await start_app(cron_jobs="tests.lease_jobs", ui_cookie_secure=False, **LEASE_SETTINGS)
    async with User(app) as user:
        await user.login(TEST_SECRET)
        page = await user.http.get("/ui/jobs/lease-items")
        assert page.status_code == 200
        assert "<dt>Lease</dt>" in page.text
        assert (await user.http.get("/ui/")).status_code == 200


async def test_a_dynamic_jobs_page_lists_its_schedules(
    start_app: StartApp, db: asyncpg.Connection, make_settings: Callable[..., Settings]
) -> None:
    """Its schedules by key, searched by prefix, each next tick in its key's zone, its last
    run, pause and resume (for a session that may act), all escaped."""
    jobs = "tests.dynamic_jobs"
    app = await start_app("app", cron_jobs=jobs, cron_read_token=READ_TOKEN, ui_cookie_secure=False)
    cron = Cronlock(make_settings(cron_jobs=jobs), housekeeping=False)
    async with db.transaction():
        for key in (1, 12, 13, 2):
            await cron.schedules.set(
                db, "tenant-report", key, schedule="0 9 * * 1-5", tz="America/New_York"
            )
        await cron.schedules.set(db, "user-digest", HOSTILE, every=60)
    run_id = await db.fetchval(
        "INSERT INTO cronlock.runs (job, key, slot, status, trigger, instance)"
        " VALUES ('tenant-report', '2', now(), 'succeeded', 'scheduled', 'x') RETURNING id"
    )
    async with User(app) as user:
        await user.login(TEST_SECRET)
        page = (await user.http.get("/ui/jobs/tenant-report")).text
        assert page.count('data-schedule="') == 4
        assert "T09:00:00-0" in page  # 09:00 in New York, with its offset
        assert f'href="/ui/runs/{run_id}"' in page
        assert 'data-action="schedule-pause"' in page
        found = (await user.http.get("/ui/jobs/tenant-report?prefix=1")).text
        assert found.count('data-schedule="') == 3
        assert 'data-schedule="2"' not in found
        r = await user.act("/ui/jobs/tenant-report/schedules/pause", key="12", prefix="1")
        assert r.status_code == 303
        assert r.headers["location"] == "/ui/jobs/tenant-report?prefix=1&notice=schedule-paused"
        row = await cron.schedules.get(db, "tenant-report", 12)
        assert row is not None
        assert row.paused
        assert 'data-action="schedule-resume"' in (await user.http.get(r.headers["location"])).text
        r = await user.act("/ui/jobs/tenant-report/schedules/resume", key="12")
        assert r.headers["location"] == "/ui/jobs/tenant-report?prefix=&notice=schedule-resumed"
        row = await cron.schedules.get(db, "tenant-report", 12)
        assert row is not None
        assert not row.paused
        for text, status in (("99", 404), ("x", 422), ("", 422)):
            r = await user.act("/ui/jobs/tenant-report/schedules/pause", key=text)
            assert r.status_code == status, text
        r = await user.act("/ui/jobs/keyed-by-hand/schedules/pause", key="1")
        assert r.status_code == 404
        hostile = (await user.http.get("/ui/jobs/user-digest")).text
        assert RAW not in hostile
        assert hostile.count('data-schedule="') == 1
        # Not dynamic: no schedules section.
        assert "Schedules</h2>" not in (await user.http.get("/ui/jobs/keyed-by-hand")).text
    async with User(app) as reader:
        await reader.login(READ_TOKEN)
        page = (await reader.http.get("/ui/jobs/tenant-report")).text
        assert page.count('data-schedule="') == 4
        assert "schedule-pause" not in page
    actions = await db.fetch("SELECT action, detail FROM cronlock.ui_actions ORDER BY id")
    assert [a["action"] for a in actions] == ["schedule-pause", "schedule-resume"]
