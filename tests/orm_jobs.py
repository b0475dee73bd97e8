"""Jobs that write through `ctx.session` (tests/test_orm.py; CRON_JOBS=tests.orm_jobs).

Their tables live in the schema `orm_test`, made by `create_tables`: `notes` (a SQLAlchemy
model with a jsonb and a json column) and `items` (a SQLModel model).
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
from pydantic import BaseModel
from sqlalchemy import JSON, MetaData, String, func, insert, select, update
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlmodel import Field, SQLModel
from sqlmodel import select as sqlmodel_select
from sqlmodel.ext.asyncio.session import AsyncSession as SQLModelSession

from cronlock.core.jobs import JobContext, job

TABLES_SQL = """
CREATE SCHEMA IF NOT EXISTS orm_test;
CREATE TABLE IF NOT EXISTS orm_test.notes (
    id    serial PRIMARY KEY,
    job   text NOT NULL,
    body  jsonb,
    extra json
);
CREATE TABLE IF NOT EXISTS orm_test.items (
    id    serial PRIMARY KEY,
    name  text NOT NULL
);
"""


async def create_tables(conn: asyncpg.Connection) -> None:
    await conn.execute(TABLES_SQL)


class Base(DeclarativeBase):
    metadata = MetaData(schema="orm_test")


class Note(Base):
    __tablename__ = "notes"

    id: Mapped[int] = mapped_column(primary_key=True)
    job: Mapped[str] = mapped_column(String)
    body: Mapped[dict[str, Any] | None] = mapped_column(JSONB, nullable=True)
    extra: Mapped[Any] = mapped_column(JSON, nullable=True)


class Item(SQLModel, table=True):
    __tablename__ = "items"
    __table_args__ = {"schema": "orm_test"}

    id: int | None = Field(default=None, primary_key=True)
    name: str


class Hold(BaseModel):
    seconds: float = 0.0


def note(ctx: JobContext, n: int = 0) -> Note:
    return Note(job=ctx.job.name, body={"n": n, "run": ctx.run_id}, extra=["x", n])


@job("orm-write")
async def orm_write(ctx: JobContext) -> int:
    """Two notes through the session, no commit of its own: cronlock commits them."""
    ctx.session.add_all([note(ctx, 1), note(ctx, 2)])
    await ctx.session.flush()
    # The ORM reads its json and jsonb back as Python values...
    found = (await ctx.session.scalars(select(Note).order_by(Note.id))).all()
    assert [n.body for n in found][-2:] == [
        {"n": 1, "run": ctx.run_id},
        {"n": 2, "run": ctx.run_id},
    ]
    assert found[-1].extra == ["x", 2]
    # ...and raw SQL on the same connection still has cronlock's codecs, between ORM statements.
    assert await ctx.conn.fetchval("SELECT $1::jsonb", {"raw": True}) == {"raw": True}
    assert await ctx.conn.fetchval("SELECT $1::json", '{"t": 1}') == '{"t": 1}'
    ctx.session.add(note(ctx, 3))
    return len(found) + 1


@job("orm-raise")
async def orm_raise(ctx: JobContext) -> int:
    """Writes through the session (flushed, and one committed), then fails."""
    ctx.session.add(note(ctx, 1))
    await ctx.session.commit()
    ctx.session.add(note(ctx, 2))
    await ctx.session.flush()
    raise RuntimeError("failing after ORM writes")


@job("orm-commit")
async def orm_commit(ctx: JobContext) -> dict[str, Any]:
    """commit() keeps the lock's transaction (and the lock); rollback() undoes to the last
    commit, even an SQL error, and the run goes on."""
    ctx.session.add(note(ctx, 1))
    await ctx.session.commit()
    in_tx = ctx.conn.is_in_transaction()
    held = await ctx.conn.fetchval(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
    )
    ctx.session.add(note(ctx, 2))
    await ctx.session.flush()
    await ctx.session.rollback()
    try:
        await ctx.session.execute(select(func.sqrt(-1)))  # an SQL error inside the session
    except Exception:
        await ctx.session.rollback()
    ctx.session.add(note(ctx, 3))
    await ctx.session.commit()
    return {"in_tx": in_tx, "held": held}


@job("orm-commit-then-raise")
async def orm_commit_then_raise(ctx: JobContext) -> int:
    ctx.session.add(note(ctx, 1))
    await ctx.session.commit()
    raise RuntimeError("after a session.commit()")


@job("orm-sqlmodel")
async def orm_sqlmodel(ctx: JobContext) -> list[str]:
    """SQLModel's AsyncSession (the runner's session_class) with its `exec`."""
    session = ctx.session
    assert isinstance(session, SQLModelSession)
    session.add(Item(name="first"))
    session.add(Item(name="second"))
    await session.commit()
    names = (await session.exec(sqlmodel_select(Item.name).order_by(Item.name))).all()
    return list(names)


@job("raw-jsonb")
async def raw_jsonb(ctx: JobContext) -> Any:
    """Raw SQL only: what issue 30 saw break after an ORM job on the same pooled connection."""
    value = await ctx.conn.fetchval("SELECT $1::jsonb", {"a": [1, 2]})
    assert value == {"a": [1, 2]}, value
    await ctx.conn.execute(
        "INSERT INTO orm_test.notes (job, body) VALUES ($1, $2::jsonb)", ctx.job.name, {"k": 1}
    )
    prepared = await ctx.conn.fetchval("SELECT count(*) FROM pg_prepared_statements")
    return {
        "value": value,
        "prepared": prepared,
        "pid": await ctx.conn.fetchval("SELECT pg_backend_pid()"),
    }


@job("orm-pid")
async def orm_pid(ctx: JobContext) -> int:
    """An ORM write, and the backend it ran on."""
    ctx.session.add(note(ctx))
    await ctx.session.flush()
    pid: int = (await ctx.session.execute(select(func.pg_backend_pid()))).scalar_one()
    return pid


@job("orm-digest")
async def orm_digest(ctx: JobContext) -> int:
    """One set-based ORM statement (update ... returning inside insert ... from select)."""
    stamped = (
        update(Note).where(Note.job == "due").values(job="done").returning(Note.id, Note.body)
    ).cte("stamped")
    statement = insert(Note).from_select(
        ["job", "body"], select(func.concat("sent:", stamped.c.id), stamped.c.body)
    )
    result: Any = await ctx.session.execute(statement)
    return int(result.rowcount)


@job("orm-hold", params=Hold)
async def orm_hold(ctx: JobContext) -> int:
    ctx.session.add(note(ctx))
    await asyncio.sleep(ctx.params.seconds)
    return 1


@job("orm-leaked")
async def orm_leaked(ctx: JobContext) -> int:
    """Keeps its session for later (a bug): using it after the run must raise."""
    LEAKED.append(ctx.session)
    ctx.session.add(note(ctx))
    return 1


LEAKED: list[Any] = []


@job("orm-lease", lease=2.0, timeout=30.0)
async def orm_lease(ctx: JobContext) -> int:
    """A lease job: each step's session writes in that step's transaction."""
    for step in range(3):
        async with ctx.step():
            ctx.session.add(note(ctx, step))
            if step == 2:
                await ctx.session.flush()
                raise RuntimeError("the third step fails")
    return 3


@job("orm-lease-outside", lease=2.0, timeout=30.0)
async def orm_lease_outside(ctx: JobContext) -> int:
    ctx.session.add(note(ctx))
    return 1
