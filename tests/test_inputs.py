"""Bad input is a 422 naming the parameter, never a 5xx: values PostgreSQL cannot take are
refused before a statement sees them (cronlock/inputs.py), and a refusal that still happens on a
statement carrying the request's values is the client's 422, not a 503 (`db.translate`).
In-process (the app behind httpx's ASGI transport), on a real database."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from cronlock import inputs
from cronlock.core import ledger
from cronlock.db.pool import Database
from cronlock.errors import DatabaseUnavailable, InvalidInput, translate
from cronlock.ops import views as ops
from cronlock.service import create_app
from cronlock.settings import Settings
from tests.support.asgi import serve
from tests.util import AUTH, runs

BIGINT_MAX = 2**63 - 1


@contextlib.asynccontextmanager
async def in_process(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """A client of `app`, served in this process (tests/support/asgi.py), with the secret."""
    async with (
        serve(app, "inputs") as served,
        httpx.AsyncClient(
            transport=served.transport, base_url=served.url, headers=AUTH, timeout=30
        ) as c,
    ):
        yield c


@pytest.fixture
async def api(make_settings: Callable[..., Settings]) -> AsyncIterator[httpx.AsyncClient]:
    """The app of this module's tests, in this process, every request with the secret (the
    shared `client` sends none of its own)."""
    async with in_process(create_app(make_settings())) as c:
        yield c


def assert_invalid(r: httpx.Response, loc: list[Any]) -> None:
    """The app's 422: which parameter, why; no Retry-After (nothing to retry)."""
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["error"] in ("invalid request", "invalid query parameters", "invalid trigger")
    assert [d["loc"] for d in body["detail"]] == [loc], body
    assert all(d["msg"] for d in body["detail"]), body
    assert "retry-after" not in r.headers
    assert "asyncpg" not in r.text


# --- the two requests ---------------------------------------------------------------


async def test_a_run_id_beyond_bigint_is_422_not_database_unavailable(
    api: httpx.AsyncClient,
) -> None:
    r = await api.get("/cron/runs", params={"before": str(2**63 + 1)})
    assert_invalid(r, ["query", "before"])
    assert "9223372036854775807" in r.json()["detail"][0]["msg"]
    # The largest bigint is a cursor like any other.
    r = await api.get("/cron/runs", params={"before": str(BIGINT_MAX)})
    assert r.status_code == 200, r.text
    for run_id in (2**63, 10**30, 0, -1):
        assert_invalid(await api.get(f"/cron/runs/{run_id}"), ["path", "run_id"])
    assert (await api.get(f"/cron/runs/{BIGINT_MAX}")).status_code == 404


async def test_a_nul_in_a_job_filter_is_422(api: httpx.AsyncClient) -> None:
    r = await api.get("/cron/runs?job=%00")
    assert_invalid(r, ["query", "job"])
    for bad in ("fast%00", "%ED%A0%80", "a" * 101, "fast;drop", "%00" * 5000):
        assert_invalid(await api.get(f"/cron/runs?job={bad}"), ["query", "job"])
    assert (await api.get("/cron/runs?job=fast")).json() == {"runs": [], "next": None}


# --- the other inputs of the routes ---------------------------------------------------------


async def test_trigger_values_the_database_cannot_store_are_422_and_run_nothing(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    # A string the ledger stores as jsonb: NUL (which a JSON string carries as \u0000) and a
    # lone surrogate are no text PostgreSQL stores.
    for text in ("a\u0000b", "\ud800"):
        body = json.dumps({"text": text}).encode()
        r = await api.post("/cron/note", content=body)
        assert_invalid(r, ["text"])
    # `null` is no object (found by bench/fuzz.py: it was read as "no body").
    r = await api.post("/cron/note", content=b"null")
    assert_invalid(r, [])
    # Deeper than Python's JSON reader goes, and well within MAX_BODY_BYTES.
    r = await api.post("/cron/note", content=b"[" * 5000)
    assert r.status_code == 422, r.text
    assert r.json() == {
        "error": "invalid trigger",
        "detail": [{"loc": [], "msg": "Invalid JSON: nested too deeply", "type": "json_invalid"}],
    }
    # A slot whose instant in UTC is past year 9999.
    r = await api.post("/cron/yearly", params={"slot": "9999-12-31T23:59:00-01:00"})
    assert_invalid(r, ["slot"])
    assert await runs(db, "note") == []
    assert await runs(db, "yearly") == []
    r = await api.post("/cron/note", json={"text": "plain"})
    assert r.status_code == 200, r.text
    assert r.json()["processed"] == {"text": "plain"}


async def test_a_content_length_that_is_not_a_number_is_no_500(api: httpx.AsyncClient) -> None:
    # "²" is a digit to str.isdigit(), not to int(); 5000 digits are more than int() reads.
    for declared in ("\u00b2", "9" * 5000, "0" * 5000 + "1"):
        request = api.build_request("POST", "/cron/fast", content=b"")
        request.headers["content-length"] = declared.encode("latin-1").decode("latin-1")
        r = await api.send(request)
        assert r.status_code < 500, (declared[:10], r.text)
    request = api.build_request("POST", "/cron/fast", content=b"")
    request.headers["content-length"] = "9" * 5000
    assert (await api.send(request)).status_code == 413


async def test_another_method_on_an_operations_route_is_405(api: httpx.AsyncClient) -> None:
    for path in ("/cron/jobs", "/cron/runs", "/cron/locks", "/cron/runs/7"):
        r = await api.put(path)
        assert r.status_code == 405, (path, r.text)
        assert r.headers["allow"] == "GET, HEAD"
    assert (await api.put("/cron/runs/x")).status_code == 404


async def test_the_document_links_an_accepted_trigger_to_its_run(
    api: httpx.AsyncClient,
) -> None:
    doc = (await api.get("/openapi.json")).json()
    accepted = doc["paths"]["/cron/fast"]["post"]["responses"]["202"]
    assert accepted["links"]["GetRun"] == {
        "operationId": "get_run",
        "parameters": {"run_id": "$response.body#/run_id"},
        "description": "the run this answer names",
    }
    assert doc["paths"]["/cron/runs/{run_id}"]["get"]["operationId"] == "get_run"
    before = next(
        p for p in doc["paths"]["/cron/runs"]["get"]["parameters"] if p["name"] == "before"
    )
    assert before["schema"]["anyOf"][0]["maximum"] == BIGINT_MAX
    r = await api.post("/cron/fast", params={"wait": "false"})
    assert r.status_code == 202, r.text
    run = await api.get(f"/cron/runs/{r.json()['run_id']}")
    assert run.status_code == 200, run.text


# --- what the database still refuses ---------------------------------------------------------


async def test_a_refused_value_is_invalid_input_only_where_the_request_gave_it(
    db: asyncpg.Connection,
) -> None:
    """The one translation: 22xxx on statements carrying request values is InvalidInput,
    anywhere else the database's failure; other errors are unchanged by `input_from`."""
    for values in ({"before": 2**63}, {"job": "a\x00b"}):
        with pytest.raises(InvalidInput) as refused:
            async with ops.reading(db, input_from=("query",)):
                await ledger.list_runs(db, "cronlock", limit=1, **values)
        assert refused.value.loc == ("query",)
        assert "SQLSTATE 22" in refused.value.reason
        assert "asyncpg" not in refused.value.reason
        with pytest.raises(DatabaseUnavailable):
            async with ops.reading(db):
                await ledger.list_runs(db, "cronlock", limit=1, **values)
    # The message quotes the value; the reason never does.
    with pytest.raises(asyncpg.DataError) as quoting:
        await db.fetchval("SELECT $1::text", "postgresql://leak\x00")
    assert "postgresql://" not in translate(quoting.value, input_from=("query",)).args[0]
    with pytest.raises(
        DatabaseUnavailable, match='database error 42601: syntax error at or near "SELEC"'
    ):
        async with ops.reading(db, input_from=("query",)):
            await db.execute("SELEC 1")


async def test_a_route_whose_statement_is_refused_answers_422(
    make_settings: Callable[..., Settings],
) -> None:
    """A route that forgot to validate: the exception handlers still answer 422, not 503."""
    app = create_app(make_settings())

    @app.get("/unvalidated")
    async def unvalidated(request: Request, n: int) -> JSONResponse:
        database: Database = request.state.db
        async with database.connection() as conn, ops.reading(conn, input_from=("query", "n")):
            value = await conn.fetchval("SELECT $1::bigint", n)
        return JSONResponse({"n": value})

    async with in_process(app) as api:
        assert (await api.get("/unvalidated", params={"n": 5})).json() == {"n": 5}
        r = await api.get("/unvalidated", params={"n": 2**63})
    assert r.status_code == 422, r.text
    assert r.json() == {
        "error": "invalid request",
        "detail": [
            {
                "loc": ["query", "n"],
                "msg": "a value the database cannot take: out of range or of the wrong type "
                "for its parameter (SQLSTATE 22000)",
                "type": "refused_by_database",
            }
        ],
    }
    assert "retry-after" not in r.headers


async def test_a_jobs_own_data_exception_stays_a_failed_run(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """sql-fails divides by zero (SQLSTATE 22012) in its own statement: the job failed (500,
    its run id), not the client's input."""
    r = await api.post("/cron/sql-fails")
    assert r.status_code == 500, r.text
    assert r.json() == {"error": "job failed", "job": "sql-fails", "run_id": r.json()["run_id"]}
    (row,) = await runs(db, "sql-fails")
    assert (row["id"], row["status"]) == (r.json()["run_id"], "failed")
    assert "DivisionByZeroError" in row["error"]


# --- the validators themselves --------------------------------------------------------------


def test_text_json_and_timestamps_postgresql_can_take() -> None:
    assert inputs.text_problem("ordinary é 😀") is None
    assert "NUL" in (inputs.text_problem("a\x00") or "")
    assert "surrogate" in (inputs.text_problem("\udcff") or "")
    assert inputs.json_problem({"a": [1, 2.5, "x", None, {"b": True}]}) is None
    assert inputs.json_problem({"a": [1, {"b": "\x00"}]}) == (
        ["a", 1, "b"],
        inputs.text_problem("\x00"),
    )
    assert inputs.json_problem({"\x00": 1}) is not None
    assert inputs.json_problem([float("inf")]) is not None
    deep: Any = "\x00"
    for _ in range(10_000):  # iterative: no recursion limit
        deep = [deep]
    assert inputs.json_problem(deep) is not None
    assert (
        inputs.timestamp_problem(datetime(9999, 12, 31, 22, tzinfo=timezone(-timedelta(hours=1))))
        is None
    )
    assert inputs.timestamp_problem(
        datetime(9999, 12, 31, 23, 30, tzinfo=timezone(-timedelta(hours=1)))
    )
    assert inputs.timestamp_problem(datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=1))))
    assert inputs.timestamp_problem(datetime(2026, 1, 1))
    assert inputs.timestamp_problem(datetime(2026, 1, 1, tzinfo=UTC)) is None
