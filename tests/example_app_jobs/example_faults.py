"""A job the example app's tests add to it through CRON_JOBS (cronlock reads it in a host app
too): the example's own ORM writes, then an exception. Loaded by the example's instances,
from the venv cronlock was installed into; never by this repository's service."""

from __future__ import annotations

import importlib

from cronlock import JobContext, job


@job("report-then-fail", schedule="30 5 * * *")
async def report_then_fail(ctx: JobContext) -> None:
    # The example's `app`, which only its instances can import (this repository has its own).
    crud = importlib.import_module("app.crud")
    day = ctx.slot or ctx.now
    await crud.write_daily_report(ctx.session, day=day, run_id=ctx.run_id)
    await crud.send_digests(ctx.session, day=day, run_id=ctx.run_id)
    raise RuntimeError("the report's mail server refused it, after the ORM writes")
