"""A job the example app's tests add to it through CRON_JOBS (cronlock reads it in a host app
too): the example's own ORM writes, then an exception. Loaded by the example's instances,
from the venv cronlock was installed into; never by this repository's service."""

from __future__ import annotations

from cronlock import JobContext, job

# TEMPORARY: raw SQL on ctx.conn until ctx.session lands (then: the example's app.crud).


@job("report-then-fail", schedule="30 5 * * *")
async def report_then_fail(ctx: JobContext) -> None:
    day = ctx.slot or ctx.now
    await ctx.conn.execute(
        "INSERT INTO daily_report (day, users, items, run_id) VALUES ($1, 0, 0, $2)",
        day,
        ctx.run_id,
    )
    await ctx.conn.execute(
        'INSERT INTO digest (user_id, day, run_id) SELECT id, $1, $2 FROM "user"', day, ctx.run_id
    )
    await ctx.conn.execute('UPDATE "user" SET last_digest_at = $1', day)
    raise RuntimeError("the report's mail server refused it, after the ORM writes")
