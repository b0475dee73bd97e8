"""The dashboard's actions on a dynamic job's schedules (cronlock/core/schedules.py): pause and
resume one key's schedule, from the list on the job's page (cronlock/web/ui/pages.py), with the
same CSRF check, right to act and record as the dashboard's other actions."""

from __future__ import annotations

from urllib.parse import urlencode

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response

from cronlock.core import schedules as dynamic
from cronlock.core.jobs import MAX_KEY_LENGTH
from cronlock.errors import InvalidSchedule
from cronlock.ops import views as ops
from cronlock.web.ui import session
from cronlock.web.ui.pages import Refused, acting, form_key, guarded, root_of, state_of

router = APIRouter(include_in_schema=False)


@router.post("/jobs/{name}/schedules/pause")
async def pause_schedule(request: Request, name: str) -> Response:
    return await _schedule_action(request, name, "pause")


@router.post("/jobs/{name}/schedules/resume")
async def resume_schedule(request: Request, name: str) -> Response:
    return await _schedule_action(request, name, "resume")


async def _schedule_action(request: Request, name: str, action: str) -> Response:
    """Pause or resume one key's schedule of a dynamic job (cronlock/core/schedules.py)."""

    async def render() -> Response:
        db, registry, settings = state_of(request)
        current, fields = await acting(request)
        job = registry.get(name)
        if job is None or not job.dynamic:
            raise Refused(404, "No such dynamic job.")
        text = form_key(fields.get("key"), "key")
        if text is None:
            raise Refused(422, "Invalid key: it is missing.")
        api = dynamic.Schedules(lambda: registry, settings)
        key = dynamic.key_from_text(job, text)
        async with db.connection() as conn, ops.reading(conn):
            try:
                if action == "pause":
                    done = await api.pause(conn, name, key)
                else:
                    done = await api.resume(conn, name, key)
            except InvalidSchedule as exc:
                raise Refused(422, f"Invalid {'.'.join(exc.loc) or 'key'}: {exc.reason}") from None
            if done is None:
                raise Refused(404, "No such schedule.")
            await session.record(conn, settings, current, f"schedule-{action}", name, key=text)
        query = {
            "prefix": fields.get("prefix", "")[:MAX_KEY_LENGTH],
            "notice": f"schedule-{action}d",
        }
        return RedirectResponse(f"{root_of(request)}/jobs/{name}?{urlencode(query)}", 303)

    return await guarded(request, render)
