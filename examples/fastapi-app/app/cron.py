"""The app's scheduled jobs, run once per slot across all of its instances by cronlock.

TEMPORARY: raw SQL on ctx.conn until ctx.session (SQLAlchemy on the lock's transaction) lands.
"""

from datetime import datetime

from cronlock import Cronlock, JobContext

cron = Cronlock()


def _day(ctx: JobContext) -> datetime:
    return ctx.slot or ctx.now


@cron.job("daily-report", schedule="0 6 * * *")
async def daily_report(ctx: JobContext) -> int:
    report_id: int = await ctx.conn.fetchval(
        "INSERT INTO daily_report (day, users, items, run_id) SELECT $1, "
        '(SELECT count(*) FROM "user"), (SELECT count(*) FROM item), $2 RETURNING id',
        _day(ctx),
        ctx.run_id,
    )
    return report_id


@cron.job("user-digest", schedule="0 7 * * *", tz="Europe/Berlin")
async def user_digest(ctx: JobContext) -> int:
    day = _day(ctx)
    users = await ctx.conn.fetch(
        'SELECT id FROM "user" WHERE digest_enabled '
        "AND (last_digest_at IS NULL OR last_digest_at < $1) ORDER BY email",
        day,
    )
    for user in users:
        await ctx.conn.execute(
            "INSERT INTO digest (user_id, day, run_id) VALUES ($1, $2, $3)",
            user["id"],
            day,
            ctx.run_id,
        )
        await ctx.conn.execute(
            'UPDATE "user" SET last_digest_at = $1 WHERE id = $2', day, user["id"]
        )
    return len(users)
