"""`ctx.session` on the lock's transaction, `Database(engine=...)` and `job_lock` (issue 23,
parts 3 and 4; issue 30's "one job must not break the next"), against the real PostgreSQL,
with runners in this process (tests/orm_jobs.py holds the jobs and their models)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg
import pytest
from sqlalchemy import create_engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlmodel.ext.asyncio.session import AsyncSession as SQLModelSession

from cronlock.core.jobs import load
from cronlock.core.outcome import Outcome
from cronlock.core.runner import Runner
from cronlock.db.engine import statement_caches
from cronlock.db.helper import job_lock
from cronlock.db.orm import Sessions
from cronlock.db.pool import Database
from cronlock.errors import ConfigurationError, TransactionRequired
from cronlock.settings import Settings
from tests import orm_jobs
from tests.lease_jobs import LEASE_SETTINGS
from tests.orm_jobs import Note, create_tables
from tests.util import wait_for

SAFE = {"statement_cache_size": 0, "prepared_statement_cache_size": 0}


@pytest.fixture(autouse=True)
async def _tables(db: asyncpg.Connection) -> None:
    await create_tables(db)


@pytest.fixture
def settings(make_settings: Callable[..., Settings]) -> Settings:
    # Two connections: a run holds one and borrows the other for a moment (its ledger row),
    # so consecutive runs meet the same pooled connections.
    return make_settings(cron_jobs="tests.orm_jobs", db_pool_max_size=2)


def asyncpg_url(database_url: str) -> str:
    return database_url.replace("postgresql://", "postgresql+asyncpg://", 1)


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    """The app's engine, PgBouncer-safe, with room for two connections only."""
    made = create_async_engine(
        asyncpg_url(database_url), connect_args=SAFE, pool_size=2, max_overflow=0
    )
    try:
        yield made
    finally:
        await made.dispose()


@contextlib.asynccontextmanager
async def orm_runner(
    settings: Settings, *, engine: AsyncEngine | None = None, session_class: Any = None
) -> AsyncIterator[Runner]:
    database = Database(settings, engine=engine)
    await database.open()
    runner: Runner | None = None
    try:
        await database.check(apply_migrations=False)
        runner = Runner(settings, load(["tests.orm_jobs"]), database, session_class=session_class)
        yield runner
    finally:
        if runner is not None:
            await runner.shutdown(1.0)
        await database.close()


async def run(runner: Runner, name: str, **params: Any) -> Outcome:
    job = runner.registry[name]
    parsed = job.params.model_validate(params) if job.params is not None else None
    return await runner.trigger(job, force=True, params=parsed)


async def notes(db: asyncpg.Connection, job: str) -> list[dict[str, Any]]:
    """The job's notes, their body parsed (the test's own connection has no jsonb codec)."""
    rows = await db.fetch(
        "SELECT body, jsonb_typeof(body) AS kind, json_typeof(extra) AS extra_kind"
        " FROM orm_test.notes WHERE job = $1 ORDER BY id",
        job,
    )
    return [dict(r) | {"body": json.loads(r["body"]) if r["body"] else None} for r in rows]


async def test_orm_writes_commit_once_with_the_run(
    settings: Settings, db: asyncpg.Connection
) -> None:
    """The job's session writes (json and jsonb as values, not strings) commit with its
    succeeded ledger row, once per run; an add() left pending is flushed by cronlock."""
    async with orm_runner(settings) as runner:
        first = await run(runner, "orm-write")
        second = await run(runner, "orm-write")
    assert (first.kind, second.kind) == ("succeeded", "succeeded"), (first, second)
    rows = await notes(db, "orm-write")
    assert len(rows) == 6
    assert {(r["kind"], r["extra_kind"]) for r in rows} == {("object", "array")}
    runs = await db.fetch(
        "SELECT id, status FROM cronlock.runs WHERE job = 'orm-write' ORDER BY id"
    )
    assert [r["status"] for r in runs] == ["succeeded", "succeeded"]
    assert [r["body"]["run"] for r in rows] == [runs[0]["id"]] * 3 + [runs[1]["id"]] * 3


async def test_a_job_that_raises_after_orm_writes_leaves_nothing(
    settings: Settings, db: asyncpg.Connection
) -> None:
    async with orm_runner(settings) as runner:
        raised = await run(runner, "orm-raise")
        committed_then_raised = await run(runner, "orm-commit-then-raise")
    assert raised.kind == committed_then_raised.kind == "failed"
    assert raised.reason == "failing after ORM writes"
    assert await notes(db, "orm-raise") == []
    assert await notes(db, "orm-commit-then-raise") == []


async def test_session_commit_releases_a_savepoint_and_rollback_returns_to_it(
    settings: Settings, db: asyncpg.Connection
) -> None:
    """After session.commit() the lock's transaction is still open and the lock held;
    rollback() undoes only what came after it, an SQL error in the session included."""
    async with orm_runner(settings) as runner:
        outcome = await run(runner, "orm-commit")
    assert outcome.kind == "succeeded", outcome
    assert outcome.processed["in_tx"] is True
    assert outcome.processed["held"] >= 1
    assert [r["body"]["n"] for r in await notes(db, "orm-commit")] == [1, 3]


async def test_sqlmodel_session_class(settings: Settings, db: asyncpg.Connection) -> None:
    async with orm_runner(settings, session_class=SQLModelSession) as runner:
        outcome = await run(runner, "orm-sqlmodel")
    assert outcome.kind == "succeeded", outcome
    assert outcome.processed == ["first", "second"]
    assert await db.fetchval("SELECT count(*) FROM orm_test.items") == 2


async def test_a_lease_step_has_its_own_session(
    make_settings: Callable[..., Settings], db: asyncpg.Connection
) -> None:
    """Each step's session writes in that step's transaction: two steps commit, the third
    (which fails after a flush) leaves nothing; outside a step there is no ctx.session."""
    settings = make_settings(cron_jobs="tests.orm_jobs", db_pool_max_size=2, **LEASE_SETTINGS)
    async with orm_runner(settings) as runner:
        accepted = await run(runner, "orm-lease")
        outside = await run(runner, "orm-lease-outside")
        assert accepted.kind == outside.kind == "accepted"

        async def settled() -> bool:
            found = await db.fetchval(
                "SELECT count(*) FROM cronlock.runs WHERE job LIKE 'orm-lease%'"
                " AND status <> 'running'"
            )
            return bool(found == 2)

        await wait_for(settled, 10, "the lease runs to end")
    assert [r["body"]["n"] for r in await notes(db, "orm-lease")] == [0, 1]
    assert await notes(db, "orm-lease-outside") == []
    error = await db.fetchval("SELECT error FROM cronlock.runs WHERE job = 'orm-lease-outside'")
    assert "inside a step" in error


async def test_an_orm_job_leaves_nothing_to_the_next_raw_sql_job(
    settings: Settings, db: asyncpg.Connection
) -> None:
    """Issue 30: ORM and raw-SQL runs taking turns on a pool of two: the raw job's
    `select $1::jsonb` still takes and gives Python values, and no prepared statement is
    left on the server connection (DB_STATEMENT_CACHE_SIZE=0)."""
    orm_pids: set[int] = set()
    raw_pids: set[int] = set()
    async with orm_runner(settings) as runner:
        for _ in range(4):
            orm = await run(runner, "orm-pid")
            assert orm.kind == "succeeded", orm
            orm_pids.add(orm.processed)
            write = await run(runner, "orm-write")
            assert write.kind == "succeeded", write
            raw = await run(runner, "raw-jsonb")
            assert raw.kind == "succeeded", raw
            assert raw.processed["value"] == {"a": [1, 2]}
            assert raw.processed["prepared"] == 0
            raw_pids.add(raw.processed["pid"])
    assert orm_pids & raw_pids, "the runs never met on one connection"
    assert await db.fetchval("SELECT body FROM orm_test.notes WHERE job = 'raw-jsonb' LIMIT 1") == (
        '{"k": 1}'  # this test's connection has no codec: jsonb as text, an object
    )


async def test_a_session_used_after_its_run_raises(settings: Settings) -> None:
    orm_jobs.LEAKED.clear()
    async with orm_runner(settings) as runner:
        outcome = await run(runner, "orm-leaked")
        assert outcome.kind == "succeeded", outcome
        leaked = orm_jobs.LEAKED.pop()
        leaked.add(Note(job="late"))
        with pytest.raises(Exception, match="after its run"):
            await leaked.flush()


async def test_ctx_session_without_sqlalchemy_says_what_to_install(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with orm_runner(settings) as runner:
        monkeypatch.setitem(sys.modules, "sqlalchemy.ext.asyncio", None)
        outcome = await run(runner, "orm-pid")
        with pytest.raises(ConfigurationError, match=r"pip install 'cronlock\[sqlalchemy\]'"):
            Sessions(SQLModelSession)
    assert outcome.kind == "failed"
    assert outcome.reason == (
        "ctx.session needs SQLAlchemy 2 (asyncio): pip install 'cronlock[sqlalchemy]'"
    )


# --- Database(engine=...) ------------------------------------------------------------------


async def test_an_engine_backed_database_runs_jobs_and_gets_its_connections_back_clean(
    settings: Settings, engine: AsyncEngine, db: asyncpg.Connection
) -> None:
    """One pool for the app and its jobs: ORM and raw-SQL runs on the engine's connections,
    and the app's own ORM use of the engine afterwards still has SQLAlchemy's codecs."""
    async with orm_runner(settings, engine=engine) as runner:
        assert runner.db.max_connections == 2
        for _ in range(3):
            for name in ("orm-write", "raw-jsonb"):
                outcome = await run(runner, name)
                assert outcome.kind == "succeeded", outcome
    assert len(await notes(db, "orm-write")) == 9
    async with AsyncSession(engine) as session:
        session.add(Note(job="app", body={"from": "app"}, extra=[1]))
        await session.commit()
        assert (await session.get(Note, 1)) is not None
    assert await notes(db, "app") == [
        {"body": {"from": "app"}, "kind": "object", "extra_kind": "array"}
    ]
    assert engine.sync_engine.pool.checkedout() == 0  # type: ignore[attr-defined]


async def test_engines_cronlock_cannot_run_on_are_refused_in_one_line(
    settings: Settings, database_url: str, make_settings: Callable[..., Settings]
) -> None:
    psycopg = create_async_engine(database_url.replace("postgresql://", "postgresql+psycopg://"))
    with pytest.raises(
        ConfigurationError, match=r"uses the psycopg driver: .* postgresql\+asyncpg"
    ):
        Database(settings, engine=psycopg)
    with pytest.raises(ConfigurationError, match="takes a SQLAlchemy AsyncEngine"):
        Database(settings, engine=create_engine("sqlite://"))  # type: ignore[arg-type]
    other = create_async_engine(asyncpg_url(database_url), connect_args=SAFE)
    other.sync_engine.dialect.name = "mysql"  # what a MySQL engine says of itself
    with pytest.raises(ConfigurationError, match=r"is mysql: .*advisory locks"):
        Database(settings, engine=other)
    await psycopg.dispose()
    await other.dispose()

    # asyncpg's and SQLAlchemy's statement caches are on unless turned off: refused at open
    # while DB_STATEMENT_CACHE_SIZE is 0 (PgBouncer-safe), accepted above 0.
    cached = create_async_engine(asyncpg_url(database_url))
    try:
        database = Database(settings, engine=cached)
        with pytest.raises(ConfigurationError) as refused:
            await database.open()
        message = str(refused.value)
        assert "\n" not in message
        assert "statement_cache_size, prepared_statement_cache_size" in message
        assert "connect_args={'statement_cache_size': 0, 'prepared_statement_cache_size': 0}" in (
            message
        )
        direct = Database(make_settings(db_statement_cache_size=100), engine=cached)
        await direct.open()
        await direct.close()
    finally:
        await cached.dispose()


async def test_statement_caches_reads_what_the_engine_was_given(
    engine: AsyncEngine, database_url: str
) -> None:
    """The private attributes `statement_caches` reads, checked against both settings."""
    async with engine.connect() as conn:
        assert statement_caches((await conn.get_raw_connection()).dbapi_connection) == []
    cached = create_async_engine(asyncpg_url(database_url))
    try:
        async with cached.connect() as conn:
            found = statement_caches((await conn.get_raw_connection()).dbapi_connection)
        assert found == ["statement_cache_size", "prepared_statement_cache_size"]
    finally:
        await cached.dispose()


# --- job_lock ------------------------------------------------------------------------------


async def test_job_lock_on_asyncpg_excludes_cronlocks_run_of_the_job(
    settings: Settings, database_url: str
) -> None:
    holder = await asyncpg.connect(database_url, statement_cache_size=0)
    other = await asyncpg.connect(database_url, statement_cache_size=0)
    try:
        with pytest.raises(TransactionRequired, match="needs an open transaction"):
            async with job_lock(holder, "orm-pid"):
                pass
        async with orm_runner(settings) as runner:
            assert registry_key(runner, "orm-pid") == (await _key(holder, "orm-pid"))
            tx = holder.transaction()
            await tx.start()
            async with job_lock(holder, "orm-pid") as lock:
                assert lock.acquired
                skipped = await run(runner, "orm-pid")
                async with other.transaction(), job_lock(other, "orm-pid") as second:
                    assert not second.acquired
            assert (skipped.kind, skipped.reason) == ("skipped", "already running")
            await tx.rollback()  # the lock goes with the transaction
            assert (await run(runner, "orm-pid")).kind == "succeeded"

            # And the other way round: cronlock's run holds it, the helper does not get it.
            running = asyncio.create_task(run(runner, "orm-hold", seconds=1.0))
            await asyncio.sleep(0.3)
            async with other.transaction(), job_lock(other, "orm-hold") as lock:
                assert not lock.acquired
            assert (await running).kind == "succeeded"
    finally:
        await holder.close()
        await other.close()


def registry_key(runner: Runner, job: str) -> int:
    return runner.registry.lock(job).key


async def _key(conn: asyncpg.Connection, job: str) -> int:
    async with conn.transaction(), job_lock(conn, job) as lock:
        return lock.key.key


async def test_job_lock_on_sqlalchemy_connections_and_sessions(engine: AsyncEngine) -> None:
    async with engine.connect() as conn:
        with pytest.raises(TransactionRequired, match=r"conn\.begin\(\)"):
            async with job_lock(conn, "daily-digest"):
                pass
        async with conn.begin(), job_lock(conn, "daily-digest") as lock:
            assert lock.acquired
            assert lock.text == "cronlock:daily-digest"
            async with (
                AsyncSession(engine) as session,
                session.begin(),
                job_lock(session, "daily-digest") as second,
            ):
                assert not second.acquired
        # Committed: the lock went with the transaction.
        async with AsyncSession(engine) as session:
            with pytest.raises(TransactionRequired, match=r"session\.begin\(\)"):
                async with job_lock(session, "daily-digest"):
                    pass
            async with session.begin(), job_lock(session, "daily-digest") as third:
                assert third.acquired
    autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
    async with autocommit.connect() as conn, conn.begin():
        with pytest.raises(TransactionRequired, match="AUTOCOMMIT"):
            async with job_lock(conn, "daily-digest"):
                pass
    with pytest.raises(TypeError, match="takes an asyncpg connection"):
        async with job_lock(object(), "daily-digest"):
            pass


async def test_job_lock_keys_follow_schema_namespace_and_key(db: asyncpg.Connection) -> None:
    async with (
        db.transaction(),
        job_lock(db, "keyed", schema="other", namespace=7, key="42") as lock,
    ):
        assert lock.text == "other:keyed:42"
        server = await db.fetchval("SELECT hashtextextended('other:keyed:42', 7)")
        assert lock.key.key == server
