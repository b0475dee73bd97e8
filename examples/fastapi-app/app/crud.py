"""The app's business code, on whatever session it is given: a request's, or cronlock's
`ctx.session` inside a job (then it runs in the lock's transaction; it never commits)."""

from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncSession
from sqlmodel import col, func, or_, select

from app.models import DailyReport, Digest, Item, User


async def write_daily_report(session: AsyncSession, *, day: datetime, run_id: int) -> DailyReport:
    """Count users and items into one report row for `day`."""
    users = (await session.execute(select(func.count()).select_from(User))).scalar_one()
    items = (await session.execute(select(func.count()).select_from(Item))).scalar_one()
    report = DailyReport(day=day, users=users, items=items, run_id=run_id)
    session.add(report)
    await session.flush()
    return report


async def send_digests(session: AsyncSession, *, day: datetime, run_id: int) -> int:
    """One digest per user who wants one and has not had `day`'s, each user stamped."""
    due = select(User).where(
        col(User.digest_enabled),
        or_(col(User.last_digest_at).is_(None), col(User.last_digest_at) < day),
    )
    users = (await session.execute(due.order_by(col(User.email)))).scalars().all()
    for user in users:
        # A real app would queue the e-mail here (cronlock's outbox commits with the run).
        session.add(Digest(user_id=user.id, day=day, run_id=run_id))
        user.last_digest_at = day
        await session.flush()
    return len(users)
