"""The HTTP routes of dynamic schedules (cronlock/core/schedules.py holds their rules and SQL):

- `PUT /cron/jobs/{job}/schedules/{key}` (the cron secret): body `{"schedule", "every", "tz",
  "params", "paused"}`, one of `schedule` / `every`; creates or replaces the key's schedule.
- `DELETE /cron/jobs/{job}/schedules/{key}` (the cron secret).
- `GET /cron/jobs/{job}/schedules` (the read token): keyset-paginated by key (`after`,
  `limit`), filtered by key `prefix` and `due_before`; `next` is the cursor of the next page.
- `GET /cron/jobs/{job}/schedules/{key}` (the read token).

A refused value is a 422 whose `loc` names the field (`["body", "schedule"]`, `["path", "key"]`,
`["query", "limit"]`), answered before any statement; an unknown job is a 404.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import JSONResponse, Response

from cronlock.core import schedules
from cronlock.core.jobs import NAME_PATTERN, Registry
from cronlock.errors import DRIVER_ERRORS, InvalidSchedule, translate
from cronlock.web.answers import CronRoute, invalid_input
from cronlock.web.deps import DatabaseDep, RegistryDep, SettingsDep, error

# Reads take the read token, writes the secret (cronlock/web/router.py attaches them).
reads = APIRouter(tags=["schedules"], route_class=CronRoute)
writes = APIRouter(tags=["schedules"], route_class=CronRoute)

JobName = Annotated[str, Path(pattern=NAME_PATTERN.pattern, description="a dynamic job")]
Key = Annotated[str, Path(description="the key (its canonical text: an int key in decimal)")]
BODY_FIELDS = ("schedule", "every", "tz", "params", "paused")
RESPONSES: dict[int | str, dict[str, Any]] = {
    404: {"description": "unknown job, or no schedule for this key"},
    422: {"description": "a refused value; `loc` names the field"},
    503: {"description": "database unavailable (Retry-After)"},
}


def _located(exc: InvalidSchedule, source: str) -> JSONResponse:
    """The 422 of a refusal, its field placed in the path or in `source` (body, query)."""
    where = "path" if exc.loc[:1] in (("key",), ("job",)) else source
    return invalid_input(InvalidSchedule(exc.reason, (where, *exc.loc)))


def _known(registry: Registry, job: str) -> JSONResponse | None:
    return None if job in registry else error(404, "unknown job", job=job)


async def _body(request: Request) -> dict[str, Any] | JSONResponse:
    raw = await request.body()
    try:
        data = json.loads(raw) if raw.strip() else {}
    except (ValueError, UnicodeDecodeError, RecursionError):
        return invalid_input(InvalidSchedule("body is not valid JSON", ("body",)))
    if not isinstance(data, dict):
        return invalid_input(InvalidSchedule("body is a JSON object", ("body",)))
    unknown = sorted(set(data) - set(BODY_FIELDS))
    if unknown:
        return invalid_input(
            InvalidSchedule(f"unknown field; known: {', '.join(BODY_FIELDS)}", ("body", unknown[0]))
        )
    return data


@writes.put("/jobs/{job}/schedules/{key}", responses=RESPONSES)
async def put_schedule(
    job: JobName,
    key: Key,
    request: Request,
    db: DatabaseDep,
    registry: RegistryDep,
    settings: SettingsDep,
) -> Response:
    """Create or replace the key's schedule: its next tick counts from now; a run of the old
    schedule under way finishes, none more starts."""
    unknown = _known(registry, job)
    if unknown is not None:
        return unknown
    body = await _body(request)
    if isinstance(body, JSONResponse):
        return body
    api = schedules.Schedules(lambda: registry, settings)
    try:
        entry = api.check(
            job,
            _path_key(registry, job, key),
            schedule=body.get("schedule"),
            every=body.get("every"),
            tz=body.get("tz", "UTC"),
            params=body.get("params"),
            paused=body.get("paused", False),
        )
        async with db.connection() as conn, conn.transaction():
            row = await api.write(conn, entry)
    except InvalidSchedule as exc:
        return _located(exc, "body")
    except DRIVER_ERRORS as exc:
        raise translate(exc, input_from=("body",)) from exc
    return JSONResponse(row.to_json())


@writes.delete("/jobs/{job}/schedules/{key}", responses=RESPONSES)
async def delete_schedule(
    job: JobName, key: Key, db: DatabaseDep, registry: RegistryDep, settings: SettingsDep
) -> Response:
    """Remove the key's schedule; a run under way finishes."""
    unknown = _known(registry, job)
    if unknown is not None:
        return unknown
    api = schedules.Schedules(lambda: registry, settings)
    try:
        async with db.connection() as conn:
            removed = await api.remove(conn, job, _path_key(registry, job, key))
    except InvalidSchedule as exc:
        return _located(exc, "body")
    except DRIVER_ERRORS as exc:
        raise translate(exc) from exc
    if not removed:
        return error(404, "no schedule for this key", job=job, key=key)
    return JSONResponse({"job": job, "key": key, "removed": True})


@reads.get("/jobs/{job}/schedules", responses=RESPONSES)
async def list_schedules(
    job: JobName,
    db: DatabaseDep,
    registry: RegistryDep,
    settings: SettingsDep,
    prefix: Annotated[str, Query(max_length=200, description="keys starting with")] = "",
    due_before: Annotated[datetime | None, Query(description="due (not paused) before")] = None,
    after: Annotated[str, Query(max_length=200, description="the cursor: keys after it")] = "",
    limit: Annotated[int, Query(ge=1, le=schedules.MAX_PAGE)] = 100,
) -> Response:
    """The job's schedules by key, a page at a time (`next`: the `after` of the next page)."""
    unknown = _known(registry, job)
    if unknown is not None:
        return unknown
    if due_before is not None and due_before.tzinfo is None:
        return invalid_input(InvalidSchedule("needs a time zone offset", ("query", "due_before")))
    api = schedules.Schedules(lambda: registry, settings)
    try:
        async with db.connection() as conn:
            found = await api.list(
                conn, job, prefix=prefix, due_before=due_before, after=after, limit=limit
            )
    except InvalidSchedule as exc:
        return _located(exc, "query")
    except DRIVER_ERRORS as exc:
        raise translate(exc, input_from=("query",)) from exc
    cursor = found[-1].key if len(found) == limit else None
    return JSONResponse({"schedules": [r.to_json() for r in found], "next": cursor})


@reads.get("/jobs/{job}/schedules/{key}", responses=RESPONSES)
async def get_schedule(
    job: JobName, key: Key, db: DatabaseDep, registry: RegistryDep, settings: SettingsDep
) -> Response:
    unknown = _known(registry, job)
    if unknown is not None:
        return unknown
    api = schedules.Schedules(lambda: registry, settings)
    try:
        async with db.connection() as conn:
            row = await api.get(conn, job, _path_key(registry, job, key))
    except InvalidSchedule as exc:
        return _located(exc, "query")
    except DRIVER_ERRORS as exc:
        raise translate(exc) from exc
    if row is None:
        return error(404, "no schedule for this key", job=job, key=key)
    return JSONResponse(row.to_json())


def _path_key(registry: Registry, job: str, key: str) -> str | int:
    found = registry.get(job)
    return key if found is None else schedules.key_from_text(found, key)
