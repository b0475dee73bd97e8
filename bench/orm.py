"""The daily digest through `ctx.session` (one set-based SQLAlchemy Core statement: an
`update(...).returning` CTE feeding `insert().from_select`) against the same statement through
`ctx.conn` (the demo's DIGEST_SQL), in one run on one database server.

Both run in this process, each on a fresh `CREATE DATABASE ... TEMPLATE` copy of the loaded
users, through the real Runner (lock, ledger row, commit): the figure is a whole trigger.
Goal (issue 23): the session's run costs <= 1.1 x the connection's (medians).

    .venv/bin/python bench/orm.py [--users 100000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    MetaData,
    Table,
    Text,
    cast,
    func,
    insert,
    literal,
    or_,
    select,
    update,
)

from bench.common import (
    Server,
    create_database,
    drop_database,
    machine,
    postgres,
    server_version,
    stats,
    table,
    write_json,
)
from bench.digest import LOAD_SQL, PG_SETTINGS
from cronlock.core.jobs import JobContext, job, load
from cronlock.core.runner import Runner
from cronlock.db.pool import Database
from cronlock.delivery import outbox
from cronlock.demo.digest import DIGEST_SQL, SENDER
from cronlock.settings import Settings
from cronlock.sql import qualify

users = Table(
    "users",
    MetaData(schema="cronlock_demo"),
    Column("id", BigInteger, primary_key=True),
    Column("email", Text),
    Column("digest_enabled", Boolean),
    Column("last_digest_at", DateTime(timezone=True)),
)
email_outbox = Table(
    "email_outbox",
    MetaData(schema="cronlock"),
    Column("id", BigInteger, primary_key=True),
    Column("idempotency_key", Text),
    Column("job", Text),
    Column("slot", DateTime(timezone=True)),
    Column("user_id", BigInteger),
    Column("sender", Text),
    Column("recipient", Text),
    Column("subject", Text),
    Column("body", Text),
)


def digest_statement(job_name: str, slot: Any) -> Any:
    """DIGEST_SQL as SQLAlchemy Core: stamp the due users, queue their emails, count them."""
    slot_param = literal(slot, DateTime(timezone=True))
    due = (
        update(users)
        .where(
            users.c.digest_enabled,
            or_(users.c.last_digest_at.is_(None), users.c.last_digest_at < slot_param),
        )
        .values(last_digest_at=func.greatest(func.now(), slot_param))
        .returning(users.c.id, users.c.email)
        .cte("due")
    )
    per_slot = select(
        func.format(
            "%s:%s:",
            cast(literal(job_name), Text),
            cast(func.extract("epoch", slot_param), BigInteger),
        ).label("key"),
        (
            literal("Your daily digest for ")
            + func.to_char(func.timezone("UTC", slot_param), "YYYY-MM-DD")
        ).label("subject"),
    ).cte("per_slot")
    queued = (
        insert(email_outbox)
        .from_select(
            ["idempotency_key", "job", "slot", "user_id", "sender", "recipient", "subject", "body"],
            select(
                per_slot.c.key + cast(due.c.id, Text),
                literal(job_name, Text),
                slot_param,
                due.c.id,
                literal(SENDER, Text),
                due.c.email,
                per_slot.c.subject,
                literal("Hello ", Text)
                + due.c.email
                + literal(",\n\nhere is what happened since your last digest.\n", Text),
            ).select_from(due.join(per_slot, literal(True))),
        )
        .returning(email_outbox.c.user_id)
        .cte("queued")
    )
    return select(func.count()).select_from(queued)


@job("digest-session", timeout=600)
async def digest_session(ctx: JobContext) -> int:
    queued = (await ctx.session.execute(digest_statement(ctx.job.name, ctx.now))).scalar_one()
    if queued:
        await outbox.notify(ctx.conn, ctx.schema)
    return int(queued)


@job("digest-conn", timeout=600)
async def digest_conn(ctx: JobContext) -> int:
    queued = await ctx.conn.fetchval(qualify(DIGEST_SQL, ctx.schema), ctx.now, ctx.job.name, SENDER)
    if queued:
        await outbox.notify(ctx.conn, ctx.schema)
    return int(queued)


async def load_users(server: Server, count: int) -> str:
    import asyncpg

    name = await create_database(server)
    conn = await asyncpg.connect(server.dsn(name), statement_cache_size=0)
    try:
        await conn.execute(LOAD_SQL, count)
        await conn.execute("VACUUM (FREEZE, ANALYZE) cronlock_demo.users")
    finally:
        await conn.close()
    return name


async def one_run(server: Server, template: str, name: str) -> tuple[float, int]:
    import asyncpg

    copy = await create_database(server, template=template)
    # As bench/digest.py: each run starts after a checkpoint, not in the middle of one.
    conn = await asyncpg.connect(server.dsn(copy), statement_cache_size=0)
    try:
        await conn.execute("CHECKPOINT")
    finally:
        await conn.close()
    settings = Settings(
        _env_file=None,
        database_url=server.dsn(copy),
        cron_secret="bench-orm-" + "x" * 32,
        cron_jobs="__main__",
        outbox_enabled=False,
    )
    database = Database(settings)
    await database.open()
    try:
        await database.check(apply_migrations=False)
        runner = Runner(settings, load(["__main__"]), database)
        start = time.perf_counter()
        outcome = await runner.trigger(runner.registry[name], force=True)
        seconds = time.perf_counter() - start
        if outcome.kind != "succeeded":
            raise RuntimeError(f"{name}: {outcome}")
        return seconds, int(outcome.processed)
    finally:
        await database.close()
        await drop_database(server, copy)


async def run(args: argparse.Namespace, server: Server) -> dict[str, Any]:
    print(f"loading {args.users:,} users ...", file=sys.stderr)
    template = await load_users(server, args.users)
    version = await server_version(server.dsn(template))
    times: dict[str, list[float]] = {"digest-conn": [], "digest-session": []}
    processed: dict[str, int] = {}
    # One discarded pair first (imports, the server's caches), then interleaved rounds.
    for number in range(args.rounds + 1):
        order = (
            ("digest-conn", "digest-session") if number % 2 else ("digest-session", "digest-conn")
        )
        for name in order:
            seconds, count = await one_run(server, template, name)
            if number:
                times[name].append(seconds)
                processed[name] = count
                print(f"  {name}: {seconds * 1000:.1f} ms ({count:,})", file=sys.stderr)
    await drop_database(server, template)
    conn_s = stats(times["digest-conn"])
    session_s = stats(times["digest-session"])
    ratio = session_s[1] / conn_s[1]
    rows = [
        ["ctx.conn: DIGEST_SQL", processed["digest-conn"], *(s * 1000 for s in conn_s), 1.0],
        [
            "ctx.session: Core update/insert",
            processed["digest-session"],
            *(s * 1000 for s in session_s),
            ratio,
        ],
    ]
    print("\n### The digest through ctx.session\n")
    print(table(["variant", "queued", "ms min", "ms med", "ms max", "vs ctx.conn"], rows))
    print()
    print(
        table(
            ["goal", "figure", "verdict"],
            [
                [
                    "ctx.session within 1.1 x ctx.conn (medians)",
                    f"{ratio:.3f} x",
                    "met" if ratio <= 1.1 else "MISSED",
                ]
            ],
        )
    )
    print(
        f"\n{args.users:,} users (90 % enabled), {args.rounds} interleaved rounds after one "
        "discarded, each on a fresh TEMPLATE copy after a CHECKPOINT; a whole trigger "
        "(lock, ledger, commit). "
        f"PostgreSQL {version}."
    )
    return {
        "machine": machine(version),
        "users": args.users,
        "ms": {k: [t * 1000 for t in v] for k, v in times.items()},
        "ratio": ratio,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--users", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None, help="write the raw figures here")
    args = parser.parse_args(argv)
    with postgres(PG_SETTINGS) as server:
        output = asyncio.run(run(args, server))
    write_json(args.json, output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
