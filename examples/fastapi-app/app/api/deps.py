from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends
from sqlmodel.ext.asyncio.session import AsyncSession

from app.core.db import engine


async def get_db() -> AsyncIterator[AsyncSession]:
    # The handler commits; nothing is committed after the response is sent.
    async with AsyncSession(engine, expire_on_commit=False) as session:
        yield session


SessionDep = Annotated[AsyncSession, Depends(get_db)]
