"""The app's scheduled jobs: each runs once per slot across all of the app's instances, on
the connection that holds its advisory lock; `ctx.session` is the app's ORM inside that
transaction, so the job's writes commit with cronlock's ledger row, once, or not at all."""

from sqlmodel.ext.asyncio.session import AsyncSession

from app import crud
from app.core.db import engine
from cronlock import Cronlock, JobContext

cron = Cronlock(engine=engine, session_class=AsyncSession)


@cron.job("daily-report", schedule="0 6 * * *")
async def daily_report(ctx: JobContext) -> int | None:
    day = ctx.slot or ctx.now
    return (await crud.write_daily_report(ctx.session, day=day, run_id=ctx.run_id)).id


@cron.job("user-digest", schedule="0 7 * * *", tz="Europe/Berlin")
async def user_digest(ctx: JobContext) -> int:
    return await crud.send_digests(ctx.session, day=ctx.slot or ctx.now, run_id=ctx.run_id)
