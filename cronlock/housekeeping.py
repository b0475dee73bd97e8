"""Built-in housekeeping jobs (in the default CRON_JOBS; drop `cronlock.housekeeping` from it to opt
out).

`ledger-prune` keeps `<DB_SCHEMA>.runs` to LEDGER_RETENTION_DAYS and closes `running` rows that no
lock stands behind any more (their instance died) as `abandoned`. It runs in its own job
transaction like any job, so a prune that fails rolls back whole. It opts into catching up: a
missed night is made up once, as soon as an instance notices (pruning late is harmless).
"""

from __future__ import annotations

from typing import Any

from cronlock.core import ledger
from cronlock.core.jobs import JobContext, job


@job("ledger-prune", schedule="17 3 * * *", tz="UTC", timeout=300, grace=6 * 3600, catch_up=True)
async def ledger_prune(ctx: JobContext) -> dict[str, Any]:
    """Delete finished runs older than LEDGER_RETENTION_DAYS; close abandoned `running` rows."""
    settings = ctx.settings
    # Sweep first, so a row abandoned long ago is also old enough to go in the same run.
    abandoned = await ledger.close_abandoned(ctx.conn, ctx.schema, settings.lock_namespace)
    pruned = await ledger.prune(ctx.conn, ctx.schema, settings.ledger_retention_days * 86400.0)
    return {
        "pruned": pruned,
        "abandoned": len(abandoned),
        "retention_days": settings.ledger_retention_days,
    }
