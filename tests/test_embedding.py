"""cronlock inside a host FastAPI app (cronlock/instance.py, cronlock/web/router.py): the two
lines, per-route auth, cronlock's answers whatever the host registered, the host's answers
whatever cronlock registered, a prefix of one's own, two Cronlocks side by side, and the
mistakes refused at start-up. In-process: no process boundary is under test here (the
example app's tests run real processes: tests/test_example_app.py)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.middleware.gzip import GZipMiddleware
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, generate_latest
from sqlalchemy import select
from sqlmodel import Field, SQLModel
from sqlmodel.ext.asyncio.session import AsyncSession as SQLModelSession
from starlette.exceptions import HTTPException as StarletteHTTPException

from cronlock import Cronlock, JobContext, JobDefinitionError, Settings, SettingsError
from cronlock.db import schema
from tests.support import TEST_SECRET
from tests.support.asgi import Dispatch, InProcess, LifespanError, serve
from tests.util import AUTH

READ_TOKEN = "r" * 40


class Note(SQLModel, table=True):
    """A row a job writes through its ORM session."""

    __tablename__ = "embedding_notes"
    id: int | None = Field(default=None, primary_key=True)
    run: int


NOTES = SQLModel.metadata.tables["embedding_notes"]


SHAPE_OF_THE_HOST = {"host": "my own error shape"}


def host_app(cron: Cronlock, *, lifespan: Any = None, prefix: str | None = None) -> FastAPI:
    """A host app as users write them: its own middleware, exception handlers and routes."""
    app = FastAPI(lifespan=lifespan or cron.lifespan)
    app.add_middleware(GZipMiddleware, minimum_size=10)
    app.add_middleware(CORSMiddleware, allow_origins=["https://example.com"])

    # Starlette's HTTPException, as FastAPI's docs advise: routing's own 404 and 405 too.
    @app.exception_handler(StarletteHTTPException)
    async def own_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(SHAPE_OF_THE_HOST, status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def own_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(SHAPE_OF_THE_HOST, status_code=400)

    @app.exception_handler(Exception)
    async def own_unexpected(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(SHAPE_OF_THE_HOST, status_code=599)

    @app.get("/items/{item_id}")
    async def item(item_id: int) -> dict[str, int]:
        if item_id == 0:
            raise HTTPException(404)
        return {"item": item_id}

    if prefix is None:
        app.include_router(cron.router)
    else:
        app.include_router(cron.router, prefix=prefix)
    return app


def declare(cron: Cronlock) -> None:
    @cron.job("hello", every=3600)
    async def hello(ctx: JobContext) -> dict[str, Any]:
        await ctx.conn.execute("SELECT 1")
        return {"said": "hello", "schema": ctx.schema}

    @cron.job("boom")
    async def boom(ctx: JobContext) -> None:
        raise RuntimeError("the job's own mistake")


@pytest.fixture
def library_settings(database_url: str) -> Callable[..., Settings]:
    def make(**overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "database_url": database_url,
            "cron_secret": TEST_SECRET,
            "cron_read_token": READ_TOKEN,
            "outbox_enabled": False,
            "migrate_retry_interval": 0.2,
            "instance_name": "host",
        }
        values.update(overrides)
        return Settings(_env_file=None, **values)

    return make


@contextlib.asynccontextmanager
async def hosted(dispatch: Dispatch, app: FastAPI, *crons: Cronlock) -> AsyncIterator[InProcess]:
    """The app served in this process; once each of `crons` is ready (its schema migrated:
    an instance migrates in the background after it starts)."""
    async with serve(app, "host") as served:
        dispatch.add(served)
        for cron in crons:
            await until_ready(cron)
        yield served


async def until_ready(cron: Cronlock, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while not await cron.ready():
        assert time.monotonic() < deadline, (await cron.ready()).reason
        await asyncio.sleep(0.02)


async def test_the_two_lines_run_a_job_and_leave_the_host_alone(
    library_settings: Callable[..., Settings], dispatch: Dispatch, client: httpx.AsyncClient
) -> None:
    cron = Cronlock(library_settings())
    declare(cron)
    assert sorted(cron.jobs) == ["boom", "hello", "ledger-prune"]  # no demo jobs
    async with hosted(dispatch, host_app(cron), cron) as host:
        ran = await client.post(f"{host.url}/cron/hello", headers=AUTH)
        assert ran.status_code == 200, ran.text
        assert ran.json()["processed"] == {"said": "hello", "schema": "cronlock"}
        again = await client.post(f"{host.url}/cron/hello", headers=AUTH)
        assert again.json() == {
            "job": "hello",
            "skipped": True,
            "reason": "already done",
            "slot": again.json()["slot"],
        }
        # The host's routes, its errors and its middleware are its own.
        assert (await client.get(f"{host.url}/items/7")).json() == {"item": 7}
        assert (await client.get(f"{host.url}/items/7", headers=AUTH)).json() == {"item": 7}
        missing = await client.get(f"{host.url}/items/0")
        assert (missing.status_code, missing.json()) == (404, SHAPE_OF_THE_HOST)
        invalid = await client.get(f"{host.url}/items/x")
        assert (invalid.status_code, invalid.json()) == (400, SHAPE_OF_THE_HOST)
        unknown = await client.get(f"{host.url}/nowhere")
        assert (unknown.status_code, unknown.json()) == (404, SHAPE_OF_THE_HOST)
        cors = await client.get(
            f"{host.url}/cron/jobs",
            headers={**AUTH, "Origin": "https://example.com", "Accept-Encoding": "gzip"},
        )
        assert cors.headers["access-control-allow-origin"] == "https://example.com"
        assert cors.headers["content-encoding"] == "gzip"
        assert {j["name"] for j in cors.json()["jobs"]} == {"boom", "hello", "ledger-prune"}


async def test_cronlocks_answers_are_its_own_whatever_the_host_registered(
    library_settings: Callable[..., Settings], dispatch: Dispatch, client: httpx.AsyncClient
) -> None:
    cron = Cronlock(library_settings())
    declare(cron)
    async with hosted(dispatch, host_app(cron), cron) as host:
        url = host.url
        for method, path in (("POST", "/cron/hello"), ("GET", "/cron/jobs"), ("GET", "/cron/x")):
            refused = await client.request(method, url + path)
            assert refused.status_code == 401, (method, path)
            assert refused.json() == {"error": "Unauthorized"}
            assert refused.headers["www-authenticate"] == "Bearer"
        wrong = await client.post(f"{url}/cron/hello", headers={"Authorization": "Bearer no"})
        assert wrong.status_code == 401
        # The read token reads and never runs.
        read = {"Authorization": f"Bearer {READ_TOKEN}"}
        assert (await client.get(f"{url}/cron/runs", headers=read)).status_code == 200
        assert (await client.post(f"{url}/cron/hello", headers=read)).status_code == 401
        pause = await client.post(f"{url}/cron/jobs/hello/pause", headers=read)
        assert pause.status_code == 401
        unknown = await client.post(f"{url}/cron/nope", headers=AUTH)
        assert (unknown.status_code, unknown.json()) == (
            404,
            {"error": "unknown job", "job": "nope"},
        )
        other_method = await client.delete(f"{url}/cron/hello", headers=AUTH)
        assert other_method.status_code == 405
        assert other_method.json()["error"] == "method not allowed"
        bad_query = await client.get(f"{url}/cron/runs?limit=0", headers=AUTH)
        assert bad_query.status_code == 422
        assert bad_query.json()["error"] == "invalid request"
        assert bad_query.json()["detail"][0]["loc"] == ["query", "limit"]
        bad_params = await client.post(f"{url}/cron/hello?slot=yesterday", headers=AUTH)
        assert bad_params.status_code == 422
        assert bad_params.json()["error"] == "invalid query parameters"
        failed = await client.post(f"{url}/cron/boom", headers=AUTH)
        assert failed.status_code == 500
        assert failed.json()["error"] == "job failed"
        assert failed.json()["run_id"] >= 1
        no_run = await client.get(f"{url}/cron/runs/999999", headers=AUTH)
        assert (no_run.status_code, no_run.json()["error"]) == (404, "unknown run")


async def test_a_database_that_is_down_is_cronlocks_503(
    library_settings: Callable[..., Settings], dispatch: Dispatch, client: httpx.AsyncClient
) -> None:
    # A port nothing listens on: the pool connects lazily, so the app starts.
    cron = Cronlock(library_settings(database_url="postgresql://x@127.0.0.1:9/x"))
    declare(cron)
    async with hosted(dispatch, host_app(cron)) as host:
        down = await client.post(f"{host.url}/cron/hello", headers=AUTH)
        assert down.status_code == 503
        assert down.json()["error"] == "database unavailable"
        assert down.headers["retry-after"]
        reads = await client.get(f"{host.url}/cron/jobs", headers=AUTH)
        assert (reads.status_code, reads.json()["error"]) == (503, "database unavailable")
        ready = await cron.ready()
        assert not ready
        assert ready.reason


async def test_a_prefix_of_ones_own_and_a_lifespan_of_ones_own(
    library_settings: Callable[..., Settings], dispatch: Dispatch, client: httpx.AsyncClient
) -> None:
    cron = Cronlock(library_settings(), prefix="/internal/jobs", housekeeping=False)
    declare(cron)
    started: list[bool] = []

    @contextlib.asynccontextmanager
    async def own_lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with cron.running():
            started.append(cron.runner is not None)
            yield

    app = host_app(cron, lifespan=own_lifespan, prefix="/api")
    async with hosted(dispatch, app, cron) as host:
        assert started == [True]
        ran = await client.post(f"{host.url}/api/internal/jobs/hello", headers=AUTH)
        assert ran.status_code == 200, ran.text
        runs = await client.get(f"{host.url}/api/internal/jobs/runs", headers=AUTH)
        assert [r["job"] for r in runs.json()["runs"]] == ["hello"]
        # Nothing answers at /cron: that path is the host's (its own 404).
        elsewhere = await client.post(f"{host.url}/cron/hello", headers=AUTH)
        assert (elsewhere.status_code, elsewhere.json()) == (404, SHAPE_OF_THE_HOST)
        paths = (await client.get(f"{host.url}/openapi.json")).json()["paths"]
        assert "/api/internal/jobs/hello" in paths
        # The triggers' group in the document (tests/support/fuzz.py picks them by it).
        assert "jobs" in paths["/api/internal/jobs/hello"]["post"]["tags"]
        assert "/api/internal/jobs/runs" in paths
        # One operation per job; the one route that serves them all is not in the document.
        assert "/api/internal/jobs/{name}" not in paths
        assert app.url_path_for("trigger:boom") == "/api/internal/jobs/boom"
        failed = await client.post(f"{host.url}/api/internal/jobs/boom", headers=AUTH)
        assert failed.status_code == 500
        assert failed.json()["job"] == "boom"
    assert not await cron.ready()


async def test_two_cronlocks_with_their_own_schemas_side_by_side(
    library_settings: Callable[..., Settings],
    dispatch: Dispatch,
    client: httpx.AsyncClient,
    database_url: str,
) -> None:
    # Without ledger-prune, whose catch-up could run at any moment of the test.
    first = Cronlock(library_settings(), prefix="/first", housekeeping=False)
    second = Cronlock(
        library_settings(db_schema="cronlock_two"), prefix="/second", housekeeping=False
    )
    declare(first)
    declare(second)

    @contextlib.asynccontextmanager
    async def both(app: FastAPI) -> AsyncIterator[None]:
        async with first.running(), second.running():
            yield

    app = FastAPI(lifespan=both)
    app.include_router(first.router)
    app.include_router(second.router)
    async with hosted(dispatch, app, first, second) as host:
        for prefix in ("/first", "/second"):
            answer = await client.post(f"{host.url}{prefix}/hello", headers=AUTH)
            assert answer.status_code == 200, answer.text
        assert (await client.post(f"{host.url}/second/hello", headers=AUTH)).json()["skipped"]
        results = {
            prefix: [
                r["status"]
                for r in (await client.get(f"{host.url}{prefix}/runs", headers=AUTH)).json()["runs"]
            ]
            for prefix in ("/first", "/second")
        }
        assert results == {"/first": ["succeeded"], "/second": ["succeeded"]}
    conn = await asyncpg.connect(database_url)
    try:
        for name in ("cronlock", "cronlock_two"):
            rows = await conn.fetch(f'SELECT job, result FROM "{name}".runs')
            assert [r["job"] for r in rows] == ["hello"]
            assert f'"schema": "{name}"' in rows[0]["result"]
    finally:
        await conn.close()


async def test_metrics_mounted_or_in_the_hosts_own_registry(
    library_settings: Callable[..., Settings], dispatch: Dispatch, client: httpx.AsyncClient
) -> None:
    cron = Cronlock(library_settings(metrics_token="m" * 40, metrics_refresh_interval=0.05))
    declare(cron)
    app = host_app(cron)
    app.mount("/ops/metrics", cron.metrics)
    registry = CollectorRegistry()
    registry.register(cron.metrics)
    async with hosted(dispatch, app, cron) as host:
        assert (await client.post(f"{host.url}/cron/hello", headers=AUTH)).status_code == 200
        assert (await client.get(f"{host.url}/ops/metrics/")).status_code == 401
        scraped = await client.get(
            f"{host.url}/ops/metrics/", headers={"Authorization": "Bearer " + "m" * 40}
        )
        assert scraped.status_code == 200
        assert 'cronlock_runs_total{job="hello",outcome="succeeded"} 1.0' in scraped.text
        assert "cronlock_database_up 1.0" in scraped.text
        assert "_created" not in scraped.text
    text = generate_latest(registry).decode()
    assert 'cronlock_runs_total{job="hello",outcome="succeeded"} 1.0' in text
    assert "_created" not in text
    # cronlock's series only: the process-wide default registry of the host is untouched.
    from prometheus_client import REGISTRY

    assert REGISTRY.get_sample_value("cronlock_runs_total", {"job": "hello"}) is None


async def test_routes_answer_503_until_cron_runs(
    library_settings: Callable[..., Settings], dispatch: Dispatch, client: httpx.AsyncClient
) -> None:
    cron = Cronlock(library_settings())
    declare(cron)

    @contextlib.asynccontextmanager
    async def forgot(app: FastAPI) -> AsyncIterator[None]:
        yield

    async with hosted(dispatch, host_app(cron, lifespan=forgot)) as host:
        answer = await client.post(f"{host.url}/cron/hello", headers=AUTH)
        assert answer.status_code == 503
        assert answer.json()["error"] == "cronlock is not running"
        assert "cron.lifespan" in answer.json()["reason"]
        assert (await client.get(f"{host.url}/cron/jobs", headers=AUTH)).status_code == 503
        # The secret is still checked first: nothing is said to a caller without it.
        assert (await client.post(f"{host.url}/cron/hello")).status_code == 401


async def test_mistakes_are_refused_at_start_up_in_one_line(
    library_settings: Callable[..., Settings], dispatch: Dispatch
) -> None:
    cron = Cronlock(library_settings())
    declare(cron)
    with pytest.raises(JobDefinitionError, match="'hello' is declared twice"):

        @cron.job("hello")
        async def again(ctx: JobContext) -> None: ...

    app = host_app(cron)
    with pytest.raises(JobDefinitionError, match="after cron's jobs were collected"):

        @cron.job("late")
        async def late(ctx: JobContext) -> None: ...

    app.include_router(cron.router, prefix="/again")
    with pytest.raises(LifespanError, match="included twice"):
        async with serve(app, "twice"):
            pass

    one, other = Cronlock(library_settings()), Cronlock(library_settings())
    with pytest.raises(SettingsError, match="two Cronlocks on schema 'cronlock'"):
        async with one.running(), other.running():
            pass
    with pytest.raises(SettingsError, match="CRON_SECRET is not set"):
        Cronlock(library_settings(cron_secret=None))
    with pytest.raises(SettingsError, match="prefix="):
        Cronlock(library_settings(), prefix="cron/")
    with pytest.raises(
        JobDefinitionError, match=r"'app\.demo\.digest' moved: name 'cronlock\.demo"
    ):
        _ = Cronlock(library_settings(), jobs=["app.demo.digest"]).jobs
    with pytest.raises(JobDefinitionError) as old:
        _ = Cronlock(library_settings(), jobs=["tests.old_jobs"]).jobs
    assert str(old.value) == (
        "CRON_JOBS: 'tests.old_jobs' imports 'app.jobs', which moved to 'cronlock': change the "
        "import (`from cronlock import job, JobContext`)"
    )


def test_settings_from_the_environment_serve_no_demo_jobs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)  # no .env here
    monkeypatch.setenv("CRON_SECRET", TEST_SECRET)
    monkeypatch.delenv("CRON_JOBS", raising=False)
    assert sorted(Cronlock().jobs) == ["ledger-prune"]
    assert sorted(Cronlock(housekeeping=False).jobs) == []
    monkeypatch.setenv("CRON_JOBS", "tests.jobs")
    assert "fast" in Cronlock(housekeeping=False).jobs
    # Migrations: cronlock's own, then those of the modules served (the demo's only if asked).
    modules = [s.module for s in schema.migration_sets(Cronlock().settings.job_modules)]
    assert modules == [schema.CRONLOCK]


@pytest.mark.slow  # a Python process per case
def test_a_process_that_dies_of_a_mistake_prints_one_line(tmp_path: Path) -> None:
    """At import time (where uvicorn would print a traceback) the mistake is one line."""
    repo = Path(__file__).resolve().parent.parent
    cases = {
        "no secret": (
            "from cronlock import Cronlock, Settings\n"
            "Cronlock(Settings(_env_file=None, cron_secret=None))\n",
            "cronlock: cannot start: CRON_SECRET is not set",
        ),
        "old module": (
            "from cronlock import Cronlock, Settings\n"
            f"cron = Cronlock(Settings(_env_file=None, cron_secret={TEST_SECRET!r}),"
            " jobs=['app.housekeeping'])\n"
            "cron.router\n",
            "cronlock: cannot start: CRON_JOBS: 'app.housekeeping' moved: name "
            "'cronlock.housekeeping' instead",
        ),
        "bad schedule": (
            "from cronlock import Cronlock, Settings\n"
            f"cron = Cronlock(Settings(_env_file=None, cron_secret={TEST_SECRET!r}))\n"
            "@cron.job('x', schedule='61 * * * *')\n"
            "async def x(ctx): ...\n",
            "cronlock: cannot start: job 'x': ",
        ),
    }
    for name, (source, line) in cases.items():
        script = tmp_path / "main.py"
        script.write_text(textwrap.dedent(source))
        result = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 1, name
        assert result.stderr.startswith(line), (name, result.stderr)
        assert len(result.stderr.splitlines()) == 1, (name, result.stderr)
        assert "Traceback" not in result.stderr, name


@pytest.mark.slow  # a uvicorn process per case
def test_a_mistake_found_when_the_lifespan_starts_is_one_line_under_uvicorn(
    tmp_path: Path,
) -> None:
    """The router included twice and two Cronlocks on one schema are found when the app's
    lifespan starts, where uvicorn logs the traceback Starlette formats: one line instead."""
    repo = Path(__file__).resolve().parent.parent
    head = (
        "import contextlib\n"
        "from fastapi import FastAPI\n"
        "from cronlock import Cronlock, Settings\n"
        f"settings = Settings(_env_file=None, cron_secret={TEST_SECRET!r},"
        " database_url='postgresql://nobody@127.0.0.1:9/none')\n"
    )
    cases = {
        "included twice": (
            "cron = Cronlock(settings)\n"
            "app = FastAPI(lifespan=cron.lifespan)\n"
            "app.include_router(cron.router)\n"
            "app.include_router(cron.router, prefix='/again')\n",
            "cronlock: cannot start: cron.router is included twice in this app: include it once "
            "(one prefix per Cronlock)",
        ),
        "two on one schema": (
            "one, other = Cronlock(settings), Cronlock(settings, prefix='/other')\n"
            "@contextlib.asynccontextmanager\n"
            "async def both(app):\n"
            "    async with one.running(), other.running():\n"
            "        yield\n"
            "app = FastAPI(lifespan=both)\n",
            "cronlock: cannot start: two Cronlocks on schema 'cronlock' of one database in this "
            "process: give each its own DB_SCHEMA (Settings(db_schema=...))",
        ),
    }
    for name, (source, line) in cases.items():
        (tmp_path / "main.py").write_text(head + source)
        result = subprocess.run(
            [sys.executable, "-m", "uvicorn", "main:app", "--port", "0"],
            cwd=tmp_path,
            env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 3, (name, result.stderr)  # uvicorn's "startup failed"
        # uvicorn's own format: its level, then the line.
        assert result.stderr.splitlines().count(f"ERROR:    {line}") == 1, (name, result.stderr)
        assert "Traceback" not in result.stderr, (name, result.stderr)


async def test_cronlock_on_the_apps_engine_with_its_orm_session(
    library_settings: Callable[..., Settings],
    dispatch: Dispatch,
    client: httpx.AsyncClient,
    database_url: str,
) -> None:
    """`Cronlock(engine=..., session_class=...)`: one pool for the app and its jobs, the job's
    SQLModel session on the lock's transaction, `cron.job_lock` the very lock a run takes."""
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(
        database_url.replace("postgresql://", "postgresql+asyncpg://", 1),
        connect_args={"statement_cache_size": 0, "prepared_statement_cache_size": 0},
        pool_size=4,
    )
    cron = Cronlock(
        library_settings(database_url=None),
        engine=engine,
        session_class=SQLModelSession,
        housekeeping=False,
    )
    assert cron.settings.database_url == database_url  # for LISTEN and the CLI

    @cron.job("orm")
    async def orm(ctx: JobContext) -> str:
        session = ctx.session
        assert isinstance(session, SQLModelSession)
        connection = await session.connection()
        await connection.run_sync(Note.metadata.create_all, tables=[NOTES])
        session.add(Note(run=ctx.run_id))
        return type(session).__module__

    try:
        async with hosted(dispatch, host_app(cron), cron) as host:
            async with engine.begin() as conn, cron.job_lock(conn, "orm") as lock:
                assert lock.acquired
                held = await client.post(f"{host.url}/cron/orm", headers=AUTH)
                assert held.json()["reason"] == "already running"
            ran = await client.post(f"{host.url}/cron/orm", headers=AUTH)
            assert ran.status_code == 200, ran.text
            assert ran.json()["processed"] == "sqlmodel.ext.asyncio.session"
            async with engine.connect() as conn:
                notes = (await conn.execute(select(NOTES.c.run))).scalars().all()
            assert notes == [ran.json()["run_id"]]
    finally:
        await engine.dispose()
