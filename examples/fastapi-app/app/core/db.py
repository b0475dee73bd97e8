"""The app's async engine and its table creation."""

from uuid import uuid4

from sqlalchemy.ext.asyncio import create_async_engine
from sqlmodel import SQLModel

from app import models  # noqa: F401 (every table registered before create_all)
from app.core.config import settings

# Safe behind PgBouncer in transaction mode: no statement cache in asyncpg nor in SQLAlchemy,
# and the statements SQLAlchemy must prepare get names no other client uses.
engine = create_async_engine(
    settings.SQLALCHEMY_DATABASE_URI,
    pool_size=5,
    connect_args={
        "statement_cache_size": 0,
        "prepared_statement_cache_size": 0,
        "prepared_statement_name_func": lambda: f"__asyncpg_{uuid4()}__",
    },
)


async def init_db() -> None:
    """Create the app's tables (a real app would run its Alembic migrations here)."""
    async with engine.begin() as conn:
        await conn.run_sync(SQLModel.metadata.create_all)
