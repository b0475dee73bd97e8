"""The dashboard's pages and forms: routes only, over the views of cronlock/ops/views.py and the
outbox's operations (cronlock/delivery/outbox.py); what a page shows is computed there or in
cronlock/web/ui/timeline.py, and rendered by the Jinja2 templates beside this module (autoescaped).

Every form that changes something carries the session's CSRF token and needs a session made
with the cron secret; each action is recorded in `ui_actions` and logged with the kind of
token (cronlock/web/ui/session.py). The session itself is checked before routing, and every
link, form and redirect is made from the request's `root_path`, the path the dashboard is
mounted at (cronlock/web/ui/dashboard.py).
"""

from __future__ import annotations

import json
import logging
import secrets
from typing import Any, Literal
from urllib.parse import parse_qs, urlencode

import jinja2
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from cronlock.core import fanout, ledger
from cronlock.core import schedules as dynamic
from cronlock.core.jobs import MAX_KEY_LENGTH, Registry
from cronlock.db.pool import Database
from cronlock.delivery import outbox
from cronlock.errors import DatabaseUnavailable, RetryRefused
from cronlock.inputs import BIGINT_MAX, text_problem
from cronlock.ops import views as ops
from cronlock.settings import Settings
from cronlock.web.auth import Tokens
from cronlock.web.deps import RETRY_AFTER_SECONDS, RequestTooLarge, read_body
from cronlock.web.ui import params as ui_params
from cronlock.web.ui import session, timeline, words
from cronlock.web.ui.session import Session

log = logging.getLogger("cronlock.ui")

templates = jinja2.Environment(
    loader=jinja2.PackageLoader("cronlock.web.ui", "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
templates.filters["duration"] = words.duration
templates.filters["counted"] = words.counted
templates.filters["schedule"] = words.schedule
templates.filters["mask"] = words.mask
templates.filters["pretty"] = lambda v: json.dumps(v, indent=2, sort_keys=True, default=str)
templates.filters["when"] = lambda d: d.strftime("%Y-%m-%d %H:%M:%S %Z") if d else ""
templates.filters["iso"] = lambda d: d.isoformat() if d else ""

# Redirects after an action say what happened with one of these codes, never free text.
NOTICES = {
    "requeued": "Requeued.",
    "nothing-dead": "No dead email to requeue.",
    "not-running": "That job is not running.",
    "cancel-sent": "Cancel sent; the run is stopping.",
    "cancel-unreached": "Cancel sent, but the run has not stopped yet (it may be between "
    "statements).",
    "items-retried": "Retried: this attempt works the failed items again on every instance.",
    "skipped-running": "Not started: the job is already running.",
    "paused": "Paused.",
    "resumed": "Resumed.",
    "schedule-paused": "Schedule paused.",
    "schedule-resumed": "Schedule resumed from its next tick.",
}
# A dynamic job's schedules listed on its page at once (then "More schedules").
SCHEDULES_PAGE = 50
WINDOW_DAYS = (1, 2, 7, 14)

router = APIRouter(include_in_schema=False)


class Refused(Exception):
    """An answer other than a page: the status and what to say."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def state_of(request: Request) -> tuple[Database, Registry, Settings]:
    return request.state.db, request.state.registry, request.state.settings


def root_of(request: Request) -> str:
    """Where the dashboard is mounted (`/ui` in the standalone service; with the server's own
    root path, `uvicorn --root-path`, in front): every URL it renders starts there. Kept by
    the dashboard as it is called (cronlock/web/ui/dashboard.py): its static files' mount
    sets a `root_path` of its own."""
    root: str = request.state.ui_root
    return root


def page(request: Request, name: str, status: int = 200, **context: Any) -> HTMLResponse:
    settings: Settings = request.state.settings
    found: Session | None = getattr(request.state, "ui_session", None)
    notice = NOTICES.get(request.query_params.get("notice", ""))
    context.setdefault("live", False)
    html = templates.get_template(name).render(
        session=found,
        root=root_of(request),
        refresh=settings.ui_refresh_interval,
        instance=settings.instance_name,
        notice=notice,
        mask=found is None or not found.can_act,
        **context,
    )
    return HTMLResponse(html, status_code=status)


def problem(request: Request, status: int, message: str, retry: bool = False) -> HTMLResponse:
    response = page(request, "problem.html", status=status, status_code=status, message=message)
    if retry:
        response.headers["retry-after"] = RETRY_AFTER_SECONDS
    return response


async def guarded(request: Request, render: Any) -> Response:
    """Run a page's body; our refusals and an unavailable database become pages."""
    try:
        result: Response = await render()
        return result
    except Refused as exc:
        return problem(request, exc.status, exc.message)
    except DatabaseUnavailable as exc:
        return problem(request, 503, f"Database unavailable: {exc.reason}")
    except RetryRefused as exc:
        return problem(request, 404 if exc.missing else 409, f"Not retried: {exc.reason}.")


async def form(request: Request) -> dict[str, str]:
    """A urlencoded form's fields (the last value of each), within MAX_BODY_BYTES."""
    settings: Settings = request.state.settings
    try:
        body = await read_body(request, settings.max_body_bytes)
    except RequestTooLarge:
        raise Refused(413, "The form is too large.") from None
    try:
        fields = parse_qs(body.decode(), keep_blank_values=True, strict_parsing=False)
    except (UnicodeDecodeError, ValueError):
        raise Refused(422, "The form could not be read.") from None
    return {k: v[-1] for k, v in fields.items()}


async def acting(request: Request) -> tuple[Session, dict[str, str]]:
    """The form of a state-changing request, once its CSRF token and the session's right to
    act are checked."""
    fields = await form(request)
    current: Session = request.state.ui_session
    if not session.csrf_ok(current, fields.get("csrf")):
        raise Refused(403, "Refused: the form's CSRF token is missing or wrong. Reload the page.")
    if not current.can_act:
        raise Refused(403, "Refused: the read token can see, not act. Log in with the secret.")
    return current, fields


def back(request: Request, path: str, notice: str | None = None) -> RedirectResponse:
    query = f"?{urlencode({'notice': notice})}" if notice else ""
    return RedirectResponse(f"{root_of(request)}{path}{query}", status_code=303)


def positive_int(text: str | None, what: str) -> int | None:
    if text is None or text == "":
        return None
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= BIGINT_MAX:
        raise Refused(422, f"Invalid {what}: a positive integer is expected.")
    return int(text)


# --- login ----------------------------------------------------------------------------------


@router.get("/login")
async def login_page(request: Request) -> Response:
    settings: Settings = request.state.settings
    token = session.request_cookie(request.scope, session.LOGIN_COOKIE)
    if token is None or len(token) > 100:
        token = secrets.token_urlsafe(24)
    response = page(request, "login.html", login_csrf=token, failed=False)
    response.headers["set-cookie"] = session.cookie_header(
        settings, root_of(request), session.LOGIN_COOKIE, token, 3600
    )
    return response


@router.post("/login")
async def login(request: Request) -> Response:
    async def render() -> Response:
        db, _, settings = state_of(request)
        fields = await form(request)
        expected = session.request_cookie(request.scope, session.LOGIN_COOKIE)
        presented = fields.get("csrf")
        if expected is None or not session.same(expected, presented):
            raise Refused(403, "Refused: the login form's CSRF token is missing. Reload it.")
        tokens: Tokens = request.state.tokens
        kind = session.identify(tokens, fields.get("token", ""))
        if kind is None:
            log.warning("ui login refused: wrong token", extra={"token": "unknown"})
            return page(request, "login.html", status=401, login_csrf=expected, failed=True)
        async with db.connection() as conn, ops.reading(conn):
            value, _ = await session.create(conn, settings, tokens, kind, fields["token"])
        log.info("ui login", extra={"token": kind})
        response = back(request, "/")
        response.headers.append(
            "set-cookie",
            session.cookie_header(
                settings, root_of(request), session.COOKIE, value, int(settings.ui_session_ttl)
            ),
        )
        return response

    return await guarded(request, render)


@router.post("/logout")
async def logout(request: Request) -> Response:
    async def render() -> Response:
        db, _, settings = state_of(request)
        fields = await form(request)
        current: Session = request.state.ui_session
        if not session.csrf_ok(current, fields.get("csrf")):
            raise Refused(403, "Refused: the form's CSRF token is missing or wrong.")
        async with db.connection() as conn, ops.reading(conn):
            await session.end(conn, settings, current)
        log.info("ui logout", extra={"token": current.kind})
        response = back(request, "/login")
        response.headers.append(
            "set-cookie", session.cookie_header(settings, root_of(request), session.COOKIE, "", 0)
        )
        return response

    return await guarded(request, render)


# --- jobs -----------------------------------------------------------------------------------


@router.get("/")
async def jobs_page(request: Request) -> Response:
    async def render() -> Response:
        db, registry, settings = state_of(request)
        async with db.connection() as conn:
            await ops.sweep(conn, settings)  # runs whose holder is gone are closed first
            async with ops.reading(conn):
                view = await ops.jobs(conn, registry)
        return page(request, "jobs.html", live=True, words=words, now=view.now, rows=view.jobs)

    return await guarded(request, render)


@router.get("/jobs/{name}")
async def job_page(request: Request, name: str) -> Response:
    async def render() -> Response:
        db, registry, settings = state_of(request)
        job = registry.get(name)
        if job is None:
            raise Refused(404, "No such job.")
        q = request.query_params
        status = q.get("status") or None
        if status is not None and status not in ops.RUN_STATUSES:
            raise Refused(422, "Invalid status filter.")
        key = form_key(q.get("key"), "key filter")
        before = positive_int(q.get("before"), "page cursor")
        days = positive_int(q.get("days"), "window") or 2
        if days not in WINDOW_DAYS:
            raise Refused(422, "Invalid window: 1, 2, 7 or 14 days.")
        prefix = form_key(q.get("prefix"), "key prefix") or ""
        after = form_key(q.get("after"), "schedules cursor") or ""
        async with db.connection() as conn:
            await ops.sweep(conn, settings, name)
            async with ops.reading(conn):
                # One look at the locks for the job's row and both lists of runs.
                held = await ops.locks(conn, registry)
                view = await ops.jobs(conn, registry, only=name, held=held)
                table = await ops.runs(
                    conn,
                    registry,
                    job=name,
                    status=status,
                    key=key,
                    before=before,
                    limit=50,
                    held=held,
                )
                recent = await ops.runs(conn, registry, job=name, limit=500, held=held)
                rows = None
                if job.dynamic:
                    api = dynamic.Schedules(lambda: registry, settings)
                    rows = await api.list(
                        conn, name, prefix=prefix, after=after, limit=SCHEDULES_PAGE + 1
                    )
        [row] = view.jobs
        line = timeline.build(
            job,
            recent.runs,
            view.now,
            days,
            seen=row.first_seen,
            complete=recent.next is None,
        )
        filters = {"status": status or "", "key": key or "", "days": str(days)}
        next_query = urlencode({**filters, "before": table.next}) if table.next else None
        return page(
            request,
            "job.html",
            live=True,
            words=words,
            now=view.now,
            row=row,
            runs=table.runs,
            next_query=next_query,
            filters=filters,
            statuses=ops.RUN_STATUSES,
            windows=WINDOW_DAYS,
            line=line,
            schedules=_schedules(rows, prefix),
            params_form=ui_params.form(job.params),
        )

    return await guarded(request, render)


def form_key(text: str | None, what: str) -> str | None:
    """A job key from a form or a query: what the API's key parameters accept, else a 422."""
    if not text:
        return None
    problem = "is too long" if len(text) > MAX_KEY_LENGTH else text_problem(text)
    if problem is not None:
        raise Refused(422, f"Invalid {what}: {problem}.")
    return text


def _schedules(rows: list[dynamic.Row] | None, prefix: str) -> dict[str, Any] | None:
    """A dynamic job's schedules for its page: a page of rows, the search, the next page's
    query (keyset, by key)."""
    if rows is None:
        return None
    more = len(rows) > SCHEDULES_PAGE
    rows = rows[:SCHEDULES_PAGE]
    return {
        "rows": [
            {"row": r, "local": r.to_json()["next_at_local"], "next_at": r.next_at} for r in rows
        ],
        "prefix": prefix,
        "more": urlencode({"prefix": prefix, "after": rows[-1].key}) if more else None,
    }


# --- runs and locks -------------------------------------------------------------------------


@router.get("/runs/{run_id}")
async def run_page(request: Request, run_id: str) -> Response:
    async def render() -> Response:
        db, registry, settings = state_of(request)
        found_id = positive_int(run_id, "run id")
        assert found_id is not None
        async with db.connection() as conn:
            async with ops.reading(conn):
                view = await ops.run(conn, registry, found_id)
                now = await conn.fetchval(ops.NOW_SQL)
            # Its holder is gone: close it as abandoned, then show what that wrote (read again
            # only then: the page refreshes itself every few seconds).
            if (
                view is not None
                and view.status == "running"
                and not view.running
                and await ops.sweep(conn, settings, view.job)
            ):
                async with ops.reading(conn):
                    view = await ops.run(conn, registry, found_id)
                    now = await conn.fetchval(ops.NOW_SQL)
            failed: list[Any] = []
            retried_by = None
            if view is not None and view.items is not None and view.items.failed:
                async with ops.reading(conn):
                    failed = await fanout.failed_items(conn, settings.db_schema, found_id)
            elif view is not None and view.status not in ("running", "succeeded"):
                # Where its retry went: for a fan-out run, the attempt that works its items now.
                async with ops.reading(conn):
                    retried_by = await ledger.retried_by(conn, settings.db_schema, found_id)
        if view is None:
            raise Refused(404, "No such run.")
        return page(
            request,
            "run.html",
            live=True,
            run=view,
            now=now,
            words=words,
            failed_items=failed,
            retried_by=retried_by,
        )

    return await guarded(request, render)


@router.get("/locks")
async def locks_page(request: Request) -> Response:
    async def render() -> Response:
        db, registry, _ = state_of(request)
        async with db.connection() as conn, ops.reading(conn):
            found = await ops.locks(conn, registry)
        return page(request, "locks.html", live=True, locks=found, words=words)

    return await guarded(request, render)


# --- outbox ---------------------------------------------------------------------------------


@router.get("/outbox")
async def outbox_page(request: Request) -> Response:
    async def render() -> Response:
        db, registry, _ = state_of(request)
        async with db.connection() as conn, ops.reading(conn):
            stats = await ops.outbox_stats(conn, registry.schema)
            sent = dead = None
            if stats is not None:
                sent = await outbox.sent_stats(conn, registry.schema)
                dead = await outbox.dead_rows(conn, schema=registry.schema, limit=100)
        return page(request, "outbox.html", live=True, stats=stats, sent=sent, dead=dead or [])

    return await guarded(request, render)


@router.get("/outbox/{email_id}")
async def email_page(request: Request, email_id: str) -> Response:
    async def render() -> Response:
        db, registry, _ = state_of(request)
        found_id = positive_int(email_id, "email id")
        assert found_id is not None
        async with db.connection() as conn, ops.reading(conn):
            row = await outbox.email(conn, schema=registry.schema, email_id=found_id)
        if row is None:
            raise Refused(404, "No such email.")
        return page(request, "email.html", live=True, email=row)

    return await guarded(request, render)


@router.post("/outbox/requeue")
async def requeue(request: Request) -> Response:
    async def render() -> Response:
        db, registry, settings = state_of(request)
        current, fields = await acting(request)
        which = fields.get("id", "")
        ids: list[int] | Literal["all"] = (
            "all" if which == "all" else [positive_int(which, "email id") or 0]
        )
        async with db.connection() as conn, ops.reading(conn):
            done = await outbox.requeue(
                conn, ids, schema=registry.schema, retry_window=settings.outbox_retry_window
            )
            await session.record(
                conn, settings, current, "requeue", which, ids=[r.id for r in done]
            )
        return back(request, "/outbox", "requeued" if done else "nothing-dead")

    return await guarded(request, render)
