"""The dashboard's actions on a job: run now (asking first where a forced run is not the
slot's idempotent one), cancel, pause and resume; each through the operation the API and the
CLI use, with the CSRF check, right to act and record of the dashboard's other forms
(cronlock/web/ui/pages.py)."""

from __future__ import annotations

from datetime import datetime

from fastapi import APIRouter, Request
from fastapi.responses import Response

from cronlock.core import pause as pause_state
from cronlock.core.outcome import answer
from cronlock.core.params import parse_params
from cronlock.core.runner import Runner
from cronlock.errors import InvalidInput, InvalidTrigger
from cronlock.inputs import text_problem, timestamp_problem
from cronlock.ops import views as ops
from cronlock.web.ui import session
from cronlock.web.ui.pages import Refused, acting, back, form_key, guarded, page, state_of

router = APIRouter(include_in_schema=False)


@router.post("/jobs/{name}/run")
async def run_now(request: Request, name: str) -> Response:
    async def render() -> Response:
        db, registry, settings = state_of(request)
        current, fields = await acting(request)
        job = registry.get(name)
        if job is None:
            raise Refused(404, "No such job.")
        runner: Runner = request.state.runner
        text = fields.get("params", "").strip()
        try:
            params = parse_params(job, text.encode())
        except InvalidTrigger as exc:
            raise Refused(422, f"Invalid params: {exc}") from None
        except InvalidInput as exc:
            raise Refused(422, f"Invalid params: {exc.reason}") from None
        if fields.get("confirm") != "yes":
            # A forced run of a scheduled or paused job is not the slot's idempotent run: it
            # runs even if the slot succeeded, or the job is paused. A page asks first (a
            # form, so it works without JavaScript); an on-demand job's run needs no asking.
            async with db.connection() as conn, ops.reading(conn):
                [row] = (await ops.jobs(conn, registry, only=name)).jobs
            if job.schedule is not None or row.paused is not None:
                return page(request, "confirm.html", row=row, params_text=text)
        try:
            outcome = await runner.trigger(job, force=True, params=params, wait=False, source="ui")
        except InvalidTrigger as exc:
            raise Refused(422, f"Invalid params: {exc}") from None
        status, _ = answer(outcome)
        async with db.connection() as conn, ops.reading(conn):
            await session.record(
                conn, settings, current, "run", name, status=status, run_id=outcome.run_id
            )
        if outcome.run_id is not None:
            return back(request, f"/runs/{outcome.run_id}")
        return back(request, f"/jobs/{name}", "skipped-running")

    return await guarded(request, render)


@router.post("/jobs/{name}/cancel")
async def cancel(request: Request, name: str) -> Response:
    async def render() -> Response:
        db, registry, settings = state_of(request)
        current, fields = await acting(request)
        if name not in registry:
            raise Refused(404, "No such job.")
        key = form_key(fields.get("key"), "key")
        async with db.connection(bounded=False) as conn:
            done = await ops.cancel(
                conn, registry, settings, name, terminate=False, wait=3.0, key=key, by="ui"
            )
            async with ops.reading(conn):
                await session.record(
                    conn,
                    settings,
                    current,
                    "cancel",
                    name,
                    key=key,
                    run_id=done.holder.run_id if done else None,
                    released=done.released if done else None,
                )
        if done is None:
            return back(request, f"/jobs/{name}", "not-running")
        notice = "cancel-sent" if done.released else "cancel-unreached"
        if done.holder.run_id is not None:
            return back(request, f"/runs/{done.holder.run_id}", notice)
        return back(request, f"/jobs/{name}", notice)

    return await guarded(request, render)


def _until(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        found = datetime.fromisoformat(text)
    except ValueError:
        raise Refused(422, "Invalid end time: use an ISO time with its offset.") from None
    # The API's rule (cronlock/inputs.py): an offset, and an instant PostgreSQL can store.
    problem = timestamp_problem(found)
    if problem is not None:
        raise Refused(422, f"Invalid end time: it {problem}.")
    return found


def _note(text: str | None) -> str | None:
    note = (text or "").strip()[: pause_state.MAX_NOTE] or None
    problem = text_problem(note) if note is not None else None
    if problem is not None:
        raise Refused(422, f"Invalid note: it {problem}.")
    return note


@router.post("/jobs/{name}/pause")
async def pause(request: Request, name: str) -> Response:
    async def render() -> Response:
        db, registry, settings = state_of(request)
        current, fields = await acting(request)
        job = registry.get(name)
        if job is None:
            raise Refused(404, "No such job.")
        note = _note(fields.get("note"))
        until = _until(fields.get("until"))
        async with db.connection() as conn, ops.reading(conn):
            try:
                await pause_state.pause(
                    conn,
                    settings.db_schema,
                    name,
                    by=f"ui ({current.kind})",
                    note=note,
                    until=until,
                )
            except InvalidTrigger as exc:
                raise Refused(422, f"Not paused: {exc}") from None
            await session.record(conn, settings, current, "pause", name, note=note, until=until)
        return back(request, f"/jobs/{name}", "paused")

    return await guarded(request, render)


@router.post("/jobs/{name}/resume")
async def resume(request: Request, name: str) -> Response:
    async def render() -> Response:
        db, registry, settings = state_of(request)
        current, _ = await acting(request)
        job = registry.get(name)
        if job is None:
            raise Refused(404, "No such job.")
        async with db.connection() as conn, ops.reading(conn):
            await pause_state.resume(conn, settings.db_schema, name)
            await session.record(conn, settings, current, "resume", name)
        return back(request, f"/jobs/{name}", "resumed")

    return await guarded(request, render)
