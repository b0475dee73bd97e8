"""Jobs whose COMMIT is where things go wrong (CRON_JOBS=tests.jobs,tests.commit_jobs): a
deferred constraint the server refuses at commit, and a deferred trigger that makes the
commit outlast DB_QUERY_TIMEOUT. Their objects are temporary and dropped at commit."""

from __future__ import annotations

from cronlock.core.jobs import JobContext, job
from tests.jobs import Sleep, record


@job("commit-refused")
async def commit_refused(ctx: JobContext) -> int:
    """Two equal values under a deferred unique constraint: the server refuses the COMMIT."""
    await record(ctx)
    await ctx.conn.execute(
        "CREATE TEMP TABLE refused (x int UNIQUE DEFERRABLE INITIALLY DEFERRED) ON COMMIT DROP"
    )
    await ctx.conn.execute("INSERT INTO refused VALUES (1), (1)")
    return 1


SLOW_COMMIT_SQL = [
    "CREATE TEMP TABLE slow (x int) ON COMMIT DROP",
    """CREATE OR REPLACE FUNCTION pg_temp.slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
       BEGIN PERFORM pg_sleep(TG_ARGV[0]::float8); RETURN NULL; END $$""",
]


@job("slow-commit", params=Sleep, timeout=20)
async def slow_commit(ctx: JobContext) -> int:
    """A deferred constraint trigger that sleeps `seconds` while the run commits."""
    await record(ctx)
    for sql in SLOW_COMMIT_SQL:
        await ctx.conn.execute(sql)
    await ctx.conn.execute(
        "CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON slow DEFERRABLE INITIALLY DEFERRED"
        f" FOR EACH ROW EXECUTE FUNCTION pg_temp.slow_commit('{float(ctx.params.seconds)}')"
    )
    await ctx.conn.execute("INSERT INTO slow VALUES (1)")
    return 1
