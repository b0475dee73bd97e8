"""`python -m app.initial_data`: create the app's tables and its first users (the template's
prestart step; cronlock's own tables come from `cronlock migrate` or its start-up)."""

import asyncio
import logging

from sqlmodel import select
from sqlmodel.ext.asyncio.session import AsyncSession

from app.core.db import engine, init_db
from app.models import User

logging.basicConfig(level=logging.INFO)
log = logging.getLogger(__name__)

FIRST_USERS = ("admin@example.com", "ana@example.com", "bo@example.com")


async def main() -> None:
    await init_db()
    async with AsyncSession(engine) as session:
        for email in FIRST_USERS:
            if not (await session.exec(select(User).where(User.email == email))).first():
                session.add(User(email=email))
        await session.commit()
    await engine.dispose()
    log.info("tables created, first users in place")


if __name__ == "__main__":
    asyncio.run(main())
