"""`run` a job now, `catch-up` missed slots and `retry-items` of a failed fan-out run, in this
process: through a Runner on a pool of its own, the same lock, slot and ledger path as the
service's (a retry's items are then worked by the instances serving the job)."""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from cronlock import inputs
from cronlock.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    ID,
    PARAMS,
    fail,
    job_name,
    known_job,
    load_registry,
    translated,
)
from cronlock.core import catchup, fanout_retry, ledger
from cronlock.core.jobs import Registry
from cronlock.core.outcome import answer
from cronlock.core.params import parse_params
from cronlock.core.runner import Runner
from cronlock.db.pool import Conn, Database
from cronlock.errors import DatabaseUnavailable, InvalidTrigger, JobDefinitionError, RetryRefused
from cronlock.inputs import INT_MAX
from cronlock.settings import Settings, SettingsError


def add_run(sub: Any) -> None:
    run = sub.add_parser("run", help="run a job now, through the same lock/slot/ledger path")
    run.add_argument("job", type=job_name)
    run.add_argument("--force", action="store_true", help="run even if the slot is done")
    run.add_argument("--slot", type=inputs.timestamp, help="backfill this past tick")
    run.add_argument("--params", type=PARAMS, default=None, help="the job's params as JSON")
    run.add_argument("--json", action="store_true", help="print JSON")
    run.set_defaults(handler=cmd_run)


def add_retry_items(sub: Any) -> None:
    retry = sub.add_parser(
        "retry-items",
        help="retry a failed fan-out run's failed items (all, or --item N) in a new attempt "
        "that the instances serving the job work; succeeded items are never redone",
    )
    retry.add_argument("run_id", type=ID, help="the failed fan-out run")
    retry.add_argument(
        "--item", type=inputs.int_range(0, INT_MAX), help="only this item (its number, from 0)"
    )
    retry.add_argument("--json", action="store_true", help="print JSON (as the HTTP route)")
    retry.set_defaults(handler=cmd_retry_items)


def add_catch_up(sub: Any) -> None:
    catch_up = sub.add_parser(
        "catch-up", help="run, once, the missed slot of each job with catch_up=True"
    )
    catch_up.add_argument("--json", action="store_true")
    catch_up.set_defaults(handler=cmd_catch_up)


async def cmd_run(args: argparse.Namespace, settings: Settings) -> int:
    registry = load_registry(settings)
    known_job(registry, args.job)
    try:
        registry.check_leases(settings.db_query_timeout, settings.lease_margin)
    except JobDefinitionError as exc:
        raise SettingsError(str(exc)) from exc
    job = registry[args.job]
    try:
        params = parse_params(job, (args.params or "").encode())
        async with _runner(settings, registry) as runner:
            outcome = await runner.trigger(
                job, force=args.force, slot=args.slot, params=params, source="cli"
            )
            if outcome.kind == "accepted":
                # A lease job runs in the background of this process: wait for its end. If
                # this process dies first, its lease runs out and a running service takes it
                # over.
                outcome = await runner.leases.settle(outcome.run_id or 0) or outcome
    except InvalidTrigger as exc:
        return fail(f"invalid trigger: {exc}", EXIT_USAGE)
    _, body = answer(outcome)
    if args.json:
        print(json.dumps(body))
    else:
        print(" ".join(f"{k}={v}" for k, v in body.items()))
    return EXIT_OK if outcome.kind in ("succeeded", "skipped") else EXIT_FAILED


async def cmd_retry_items(args: argparse.Namespace, settings: Settings) -> int:
    registry = load_registry(settings)
    try:
        async with _runner(settings, registry) as runner:
            done = await fanout_retry.retry_items(
                runner.fanouts, args.run_id, args.item, source="cli"
            )
    except RetryRefused as exc:
        # A run or item that does not exist is a wrong argument; a state that forbids it now,
        # a refusal (the HTTP route's 404 and 409).
        return fail(f"not retried: {exc.reason}", EXIT_USAGE if exc.missing else EXIT_FAILED)
    body = {
        "job": done.job,
        "run_id": done.run_id,
        "retry_of": done.retry_of,
        "attempt": done.attempt,
        "slot": done.slot.isoformat() if done.slot else None,
        **({"key": done.key} if done.key is not None else {}),
        "retried": done.retried,
        "items": done.total,
    }
    if args.json:
        print(json.dumps(body))
    else:
        print(
            f"{done.job}: run {done.run_id} (attempt {done.attempt}) retries {done.retried} "
            f"failed item(s) of run {done.retry_of}; the instances serving the job work them"
        )
    return EXIT_OK


@contextlib.asynccontextmanager
async def _runner(settings: Settings, registry: Registry) -> AsyncIterator[Runner]:
    """A Runner on a pool of its own, for `run` and `catch-up`, on a database ready for jobs
    only: migrations are `migrate`'s (MIGRATE_ON_START is the service's), as for `jobs`."""
    settings = settings.model_copy(update={"migrate_on_start": False})
    names = list(registry)

    async def see_jobs(conn: Conn) -> None:
        # The jobs run from here are declared here: their history starts now at the latest.
        await ledger.see_jobs(conn, settings.db_schema, names)

    db = Database(settings, on_ready=see_jobs)
    try:
        with translated():
            await db.open()
            # A first connection, so that DATABASE_URL refused by the driver is configuration
            # (exit 2): check() reports every failure alike, as a problem.
            async with db.connection():
                pass
            problem = await db.check(apply_migrations=False)
        if problem is not None:
            hint = " (python -m cronlock migrate)" if "migrat" in problem else ""
            raise DatabaseUnavailable(problem + hint)
        runner = Runner(settings, registry, db)
        try:
            with translated():
                yield runner
        finally:
            # A lease run still held here (interrupted) gives its lease up before the pool
            # goes, so that a running service takes it over at once.
            await runner.leases.shutdown()
    finally:
        await db.close()


async def cmd_catch_up(args: argparse.Namespace, settings: Settings) -> int:
    registry = load_registry(settings)
    async with _runner(settings, registry) as runner:
        outcomes = await catchup.catch_up(runner)
    bodies = [answer(o)[1] for o in outcomes]
    if args.json:
        print(json.dumps({"caught_up": bodies}))
    elif not bodies:
        print("nothing to catch up")
    else:
        for body in bodies:
            print(" ".join(f"{k}={v}" for k, v in body.items()))
    failed = [o for o in outcomes if o.kind not in ("succeeded", "skipped")]
    return EXIT_FAILED if failed else EXIT_OK
