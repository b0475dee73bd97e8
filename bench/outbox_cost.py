"""What one email costs the database (issue 28): the outbox against a lean floor, in one run.

The floor is the leanest table that can carry the same emails (`lean.outbox`: id, user_id,
slot, to, subject, body, a primary key and a unique (user_id, slot)), filled by the same
`UPDATE ... RETURNING` + `INSERT ... SELECT`; for delivery it gets the few columns a claim
and a mark need (status, batch, sent time, provider id) and two partial indexes (pending
rows, sent rows), and a batch table (id, key, bytes, status).

1. **Enqueue**: the daily digest of `--users` users (90 % due) in one transaction
   (cronlock/demo/digest.py's own statement), and one step of the lease variant
   (cronlock/demo/chunked.py, `--chunks` chunks of 10,000 users, each its own transaction)
   and of the fan-out variant (cronlock/demo/fanout.py, `--chunks` items of 10,000 users by
   id range, each its own transaction), against the floor doing the same.
2. **Delivery**: the database's part of delivering `--deliver` of those emails in batches of
   100: claim and freeze into batches (outbox.form_batches), mark each batch sent with one
   provider id per member (outbox.mark_batch), prune them (outbox.prune_sent), against the
   floor doing the same claims, freezes, marks and prunes on its table. No provider: what is
   measured is the database.

Each variant runs on a fresh `CREATE DATABASE ... TEMPLATE` copy after a CHECKPOINT, rounds
interleaved (floor first, then reversed). Figures per email: wall time, the server backend's
CPU time (/proc: less disturbed by other load on a shared machine than wall time), WAL bytes,
and the outbox's bytes on disk (table + indexes + TOAST). `--with-0011` adds the previous
release's index set (migration 0011) as a third variant, for the before/after figure.

    .venv/bin/python bench/outbox_cost.py [--users 1000000] [--deliver 100000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import asyncpg

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
from bench.digest import PG_SETTINGS, SCHEDULE, load
from cronlock.delivery import outbox
from cronlock.delivery.mailer import Email, batch_bytes
from cronlock.demo.chunked import CHUNK_SQL
from cronlock.demo.digest import DIGEST_SQL, SENDER
from cronlock.demo.fanout import RANGE_SQL
from cronlock.sql import qualify

JOB = "daily-digest"
SCHEMA = "cronlock"
CHUNK = 10_000
BATCH = 100
BATCHES_PER_CLAIM = 10

# The previous release's index set (through migration 0011), rebuilt on a copy.
INDEXES_0011 = """
CREATE INDEX email_outbox_due ON cronlock.email_outbox (next_attempt_at) WHERE status = 'pending';
ALTER TABLE cronlock.email_outbox
    ADD CONSTRAINT email_outbox_idempotency_key_key UNIQUE (idempotency_key);
DROP INDEX cronlock.email_outbox_key;
ALTER TABLE cronlock.email_outbox ADD CONSTRAINT email_outbox_batch_id_fkey
    FOREIGN KEY (batch_id) REFERENCES cronlock.email_batch (id);
"""

FLOOR_DDL = """
CREATE SCHEMA lean;
CREATE TABLE lean.outbox (
    id      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    user_id bigint      NOT NULL,
    slot    timestamptz NOT NULL,
    "to"    text        NOT NULL,
    subject text        NOT NULL,
    body    text        NOT NULL,
    UNIQUE (user_id, slot)
);
"""
# What delivery needs on top (added before the delivery part, so the enqueue floor is the
# issue's table exactly).
FLOOR_DELIVERY_DDL = """
CREATE TABLE lean.batch (
    id     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key    text  NOT NULL,
    body   bytea NOT NULL,
    status text  NOT NULL DEFAULT 'pending'
);
ALTER TABLE lean.outbox
    ADD COLUMN status text NOT NULL DEFAULT 'pending',
    ADD COLUMN batch_id bigint,
    ADD COLUMN sent_at timestamptz,
    ADD COLUMN provider_message_id text;
CREATE INDEX outbox_pending ON lean.outbox (id) WHERE status = 'pending' AND batch_id IS NULL;
CREATE INDEX outbox_sent ON lean.outbox (sent_at) WHERE status = 'sent';
"""

FLOOR_SLOT_SQL = """
per_slot AS (
    SELECT 'Your daily digest for '
           || to_char($1::timestamptz AT TIME ZONE 'UTC', 'YYYY-MM-DD') AS subject
)"""
FLOOR_QUEUED_SQL = """
queued AS (
    INSERT INTO lean.outbox (user_id, slot, "to", subject, body)
    SELECT due.id, $1, due.email, per_slot.subject,
           'Hello ' || due.email || E',\\n\\nhere is what happened since your last digest.\\n'
    FROM due CROSS JOIN per_slot
    RETURNING user_id
)"""
# Both assembled from the constants above only (S608).
FLOOR_DIGEST_SQL = f"""
WITH {FLOOR_SLOT_SQL}, due AS (
    UPDATE cronlock_demo.users SET last_digest_at = greatest(now(), $1::timestamptz)
    WHERE digest_enabled AND (last_digest_at IS NULL OR last_digest_at < $1)
    RETURNING id, email
), {FLOOR_QUEUED_SQL}
SELECT count(*) FROM queued
"""  # noqa: S608
FLOOR_CHUNK_SQL = f"""
WITH {FLOOR_SLOT_SQL}, chunk AS (
    SELECT id FROM cronlock_demo.users
    WHERE id > $2 AND digest_enabled AND (last_digest_at IS NULL OR last_digest_at < $1)
    ORDER BY id LIMIT $3
), due AS (
    UPDATE cronlock_demo.users AS u SET last_digest_at = greatest(now(), $1::timestamptz)
    FROM chunk WHERE u.id = chunk.id
    RETURNING u.id, u.email
), {FLOOR_QUEUED_SQL}
SELECT count(*) AS queued, max(user_id) AS last_id FROM queued
"""  # noqa: S608

FLOOR_RANGE_SQL = f"""
WITH {FLOOR_SLOT_SQL}, due AS (
    UPDATE cronlock_demo.users SET last_digest_at = greatest(now(), $1::timestamptz)
    WHERE id >= $2 AND id < $3
      AND digest_enabled AND (last_digest_at IS NULL OR last_digest_at < $1)
    RETURNING id, email
), {FLOOR_QUEUED_SQL}
SELECT count(*) FROM queued
"""  # noqa: S608

FLOOR_FORM_SELECT = """
SELECT id, "to", subject, body FROM lean.outbox
WHERE status = 'pending' AND batch_id IS NULL
ORDER BY id LIMIT $1
FOR UPDATE SKIP LOCKED
"""
FLOOR_FORM_INSERT = """
INSERT INTO lean.batch (key, body) SELECT * FROM unnest($1::text[], $2::bytea[])
RETURNING id, key
"""
FLOOR_FORM_MEMBERS = """
UPDATE lean.outbox AS o SET batch_id = u.batch_id
FROM unnest($1::bigint[], $2::bigint[]) AS u(id, batch_id) WHERE o.id = u.id
"""
FLOOR_MARK = """
WITH b AS (UPDATE lean.batch SET status = 'done' WHERE id = $1 RETURNING id)
UPDATE lean.outbox AS o SET status = 'sent', sent_at = clock_timestamp(),
                            provider_message_id = u.message_id
FROM b, unnest($2::bigint[], $3::text[]) AS u(id, message_id)
WHERE o.batch_id = b.id AND o.id = u.id
"""
FLOOR_PRUNE = """
DELETE FROM lean.outbox WHERE id IN (
    SELECT id FROM lean.outbox WHERE status = 'sent' AND sent_at < now() LIMIT $1
    FOR UPDATE SKIP LOCKED)
"""
FLOOR_PRUNE_BATCHES = """
DELETE FROM lean.batch AS b WHERE b.status = 'done'
  AND NOT EXISTS (SELECT 1 FROM lean.outbox AS o WHERE o.batch_id = b.id)
"""

OUTBOX_TABLES = {"floor": ("lean.outbox", "lean.batch")}
SERVICE_TABLES = ("cronlock.email_outbox", "cronlock.email_batch")


@dataclass
class Cost:
    seconds: float = 0.0
    cpu: float = 0.0
    wal: int = 0

    def __iadd__(self, other: Cost) -> Cost:
        self.seconds += other.seconds
        self.cpu += other.cpu
        self.wal += other.wal
        return self


@dataclass
class Run:
    variant: str
    round: int
    emails: int = 0
    digest: Cost = field(default_factory=Cost)
    chunk_emails: int = 0
    chunk: Cost = field(default_factory=Cost)
    range_emails: int = 0
    range: Cost = field(default_factory=Cost)
    delivered: int = 0
    delivery: Cost = field(default_factory=Cost)
    bytes_per_email: float = 0.0
    index_bytes_per_email: float = 0.0
    indexes: int = 0


def backend_cpu(pid: int) -> float:
    """User + system CPU seconds of one server backend."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(conn: asyncpg.Connection, work: Callable[[], Awaitable[Any]]) -> Cost:
    """Wall time, the backend's CPU time and the WAL written by `work` on `conn`."""
    pid = await conn.fetchval("SELECT pg_backend_pid()")
    lsn = await conn.fetchval("SELECT pg_current_wal_lsn()")
    cpu = backend_cpu(pid)
    start = time.perf_counter()
    await work()
    seconds = time.perf_counter() - start
    cpu = backend_cpu(pid) - cpu
    wal = await conn.fetchval("SELECT (pg_current_wal_lsn() - $1::pg_lsn)::bigint", lsn)
    return Cost(seconds, cpu, int(wal))


async def sizes(conn: asyncpg.Connection, name: str) -> tuple[int, int, int]:
    """(total bytes, index bytes, number of indexes) of a table."""
    row = await conn.fetchrow(
        """SELECT pg_total_relation_size($1::regclass), pg_indexes_size($1::regclass),
                  (SELECT count(*) FROM pg_index WHERE indrelid = $1::regclass)""",
        name,
    )
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


@contextlib.asynccontextmanager
async def fresh_copy(
    server: Server, template: str, variant: str
) -> AsyncIterator[tuple[asyncpg.Connection, datetime]]:
    """A connection to a new copy of the template set up for `variant`, vacuumed and
    checkpointed, and the digest's slot now; the copy is dropped afterwards."""
    name = await create_database(server, template=template)
    try:
        conn = await asyncpg.connect(server.dsn(name), statement_cache_size=0)
        try:
            if variant == "floor":
                await conn.execute(FLOOR_DDL)
            elif variant == "0011":
                await conn.execute(INDEXES_0011)
            await conn.execute("VACUUM ANALYZE")
            await conn.execute("CHECKPOINT")
            now: datetime = await conn.fetchval("SELECT now()")
            yield conn, SCHEDULE.slot_for(now, 5.0)
        finally:
            await conn.close()
    finally:
        await drop_database(server, name)


async def enqueue_all(conn: asyncpg.Connection, variant: str, slot: datetime) -> int:
    async with conn.transaction():
        if variant == "floor":
            queued = await conn.fetchval(FLOOR_DIGEST_SQL, slot)
        else:
            queued = await conn.fetchval(qualify(DIGEST_SQL, SCHEMA), slot, JOB, SENDER)
            await outbox.notify(conn, SCHEMA)
    return int(queued)


async def enqueue_chunks(
    conn: asyncpg.Connection, variant: str, slot: datetime, chunks: int
) -> tuple[int, Cost]:
    """`chunks` steps of the lease digest, each its own transaction (the lease's own
    bookkeeping, a runs row update per step, is not counted: the floor has none)."""
    last, total, cost = 0, 0, Cost()
    for _ in range(chunks):

        async def step() -> None:
            nonlocal last, total
            async with conn.transaction():
                if variant == "floor":
                    row = await conn.fetchrow(FLOOR_CHUNK_SQL, slot, last, CHUNK)
                else:
                    row = await conn.fetchrow(
                        qualify(CHUNK_SQL, SCHEMA), slot, JOB, SENDER, last, CHUNK
                    )
                    await outbox.notify(conn, SCHEMA)
                assert row is not None
                last, total = int(row["last_id"]), total + int(row["queued"])

        cost += await measure(conn, step)
    return total, cost


async def enqueue_ranges(
    conn: asyncpg.Connection, variant: str, slot: datetime, items: int
) -> tuple[int, Cost]:
    """`items` items of the fan-out digest (cronlock/demo/fanout.py: users in ranges of
    10,000 by id), each its own transaction; the items' own bookkeeping (claim, mark) is not
    counted, as the lease's is not: the floor has none."""
    total, cost = 0, Cost()
    for n in range(items):
        lo, hi = 1 + n * CHUNK, 1 + (n + 1) * CHUNK

        async def item(lo: int = lo, hi: int = hi) -> None:
            nonlocal total
            async with conn.transaction():
                if variant == "floor":
                    queued = await conn.fetchval(FLOOR_RANGE_SQL, slot, lo, hi)
                else:
                    queued = await conn.fetchval(
                        qualify(RANGE_SQL, SCHEMA), slot, JOB, SENDER, lo, hi
                    )
                    await outbox.notify(conn, SCHEMA)
                total += int(queued)

        cost += await measure(conn, item)
    return total, cost


async def deliver_service(conn: asyncpg.Connection, limit: int) -> int:
    delivered = 0
    while delivered < limit:
        batches = await outbox.form_batches(
            conn, schema=SCHEMA, batches=BATCHES_PER_CLAIM, size=BATCH, lease=300
        )
        if not batches:
            break
        for b in batches:
            marks = tuple(outbox.Mark("sent", message_id=f"msg-{b.id}-{i}") for i in range(b.size))
            marked = await outbox.mark_batch(
                conn,
                b,
                outbox.BatchMark("done", members=marks),
                schema=SCHEMA,
                max_attempts=5,
                retry_window=82800,
            )
            assert marked is not None
            assert marked.status == "done"
            delivered += b.size
    await outbox.prune_sent(conn, 0, schema=SCHEMA)
    return delivered


async def deliver_floor(conn: asyncpg.Connection, limit: int) -> int:
    """The same claims, freezes (same bytes), marks and prunes on the floor's table."""
    delivered = 0
    while delivered < limit:
        async with conn.transaction():
            rows = await conn.fetch(FLOOR_FORM_SELECT, BATCHES_PER_CLAIM * BATCH)
            if not rows:
                break
            planned = []
            for start in range(0, len(rows), BATCH):
                chunk = rows[start : start + BATCH]
                emails = [
                    Email(
                        idempotency_key=f"{JOB}:{r['id']}",
                        sender=SENDER,
                        recipient=r["to"],
                        subject=r["subject"],
                        body=r["body"],
                    )
                    for r in chunk
                ]
                key = outbox.batch_key([e.idempotency_key for e in emails])
                planned.append((key, batch_bytes(emails), [r["id"] for r in chunk]))
            inserted = await conn.fetch(
                FLOOR_FORM_INSERT, [p[0] for p in planned], [p[1] for p in planned]
            )
            ids = {r["key"]: r["id"] for r in inserted}
            members = [(i, ids[p[0]]) for p in planned for i in p[2]]
            await conn.execute(FLOOR_FORM_MEMBERS, [m[0] for m in members], [m[1] for m in members])
        for key, _, member_ids in planned:
            await conn.execute(
                FLOOR_MARK,
                ids[key],
                member_ids,
                [f"msg-{ids[key]}-{i}" for i in range(len(member_ids))],
            )
            delivered += len(member_ids)
    while await conn.execute(FLOOR_PRUNE, outbox.PRUNE_CHUNK) != "DELETE 0":
        await conn.execute(FLOOR_PRUNE_BATCHES)
    await conn.execute(FLOOR_PRUNE_BATCHES)
    return delivered


async def run_variant(
    server: Server, template: str, variant: str, number: int, args: argparse.Namespace
) -> Run:
    run = Run(variant, number)
    tables = ("lean.outbox", "lean.batch") if variant == "floor" else SERVICE_TABLES
    # The one-transaction digest, then delivery of the first emails it queued.
    async with fresh_copy(server, template, variant) as (conn, slot):
        emails = 0

        async def digest() -> None:
            nonlocal emails
            emails = await enqueue_all(conn, variant, slot)

        run.digest = await measure(conn, digest)
        run.emails = emails
        total, indexes, count = await sizes(conn, tables[0])
        run.bytes_per_email = total / emails
        run.index_bytes_per_email = indexes / emails
        run.indexes = count
        if variant == "floor":
            await conn.execute(FLOOR_DELIVERY_DDL)
        await conn.execute("VACUUM ANALYZE")
        await conn.execute("CHECKPOINT")
        delivered = 0

        async def deliver() -> None:
            nonlocal delivered
            if variant == "floor":
                delivered = await deliver_floor(conn, args.deliver)
            else:
                delivered = await deliver_service(conn, args.deliver)

        run.delivery = await measure(conn, deliver)
        run.delivered = delivered
    # The lease variant's steps, on a copy of their own.
    async with fresh_copy(server, template, variant) as (conn, slot):
        run.chunk_emails, run.chunk = await enqueue_chunks(conn, variant, slot, args.chunks)
    # The fan-out variant's items, on a copy of their own.
    async with fresh_copy(server, template, variant) as (conn, slot):
        run.range_emails, run.range = await enqueue_ranges(conn, variant, slot, args.chunks)
    return run


def per(cost: Cost, emails: int) -> tuple[float, float, float]:
    """(µs wall, µs CPU, WAL bytes) per email."""
    return cost.seconds / emails * 1e6, cost.cpu / emails * 1e6, cost.wal / emails


async def run(args: argparse.Namespace, server: Server) -> dict[str, Any]:
    print(f"loading {args.users:,} users ...", file=sys.stderr)
    template = await load(server, args.users)
    version = await server_version(server.dsn(template))
    variants = ["floor", "0012"] + (["0011"] if args.with_0011 else [])
    runs: list[Run] = []
    for number in range(args.rounds):
        for variant in variants if number % 2 == 0 else variants[::-1]:
            result = await run_variant(server, template, variant, number, args)
            runs.append(result)
            print(
                f"  round {number} {variant}: digest {result.digest.seconds:.2f} s "
                f"(cpu {result.digest.cpu:.2f} s), chunks {result.chunk.seconds:.2f} s, "
                f"items {result.range.seconds:.2f} s, "
                f"delivery {result.delivery.seconds:.2f} s (cpu {result.delivery.cpu:.2f} s)",
                file=sys.stderr,
            )
    await drop_database(server, template)
    return report(args, runs, variants, version)


def median(values: list[float]) -> float:
    return stats(values)[1]


def report(
    args: argparse.Namespace, runs: list[Run], variants: list[str], version: str
) -> dict[str, Any]:
    label = {
        "floor": "lean floor",
        "0012": "cronlock (0012)",
        "0011": "cronlock before (0011)",
    }
    by = {v: [r for r in runs if r.variant == v] for v in variants}
    parts: dict[str, Callable[[Run], tuple[Cost, int]]] = {
        "digest, one transaction": lambda r: (r.digest, r.emails),
        f"lease step ({CHUNK:,} users)": lambda r: (r.chunk, r.chunk_emails),
        f"fan-out item ({CHUNK:,} users)": lambda r: (r.range, r.range_emails),
        "delivery (claim, batch, mark, prune)": lambda r: (r.delivery, r.delivered),
    }
    rows: list[list[Any]] = []
    ratios: dict[str, dict[str, dict[str, float]]] = {}
    for part, pick in parts.items():
        floor_wall = median([per(*pick(r))[0] for r in by["floor"]])
        floor_cpu = median([per(*pick(r))[1] for r in by["floor"]])
        floor_wal = median([per(*pick(r))[2] for r in by["floor"]])
        ratios[part] = {}
        for v in variants:
            walls = [per(*pick(r))[0] for r in by[v]]
            cpus = [per(*pick(r))[1] for r in by[v]]
            wals = [per(*pick(r))[2] for r in by[v]]
            emails = pick(by[v][0])[1]
            # Each round's run against the same round's floor (run next to it in time).
            paired = [
                per(*pick(r))[0] / per(*pick(f))[0] for r, f in zip(by[v], by["floor"], strict=True)
            ]
            ratios[part][v] = {
                "wall": median(walls) / floor_wall,
                "wall_paired": median(paired),
                "cpu": median(cpus) / floor_cpu,
                "wal": median(wals) / floor_wal,
            }
            rows.append(
                [
                    part,
                    label[v],
                    emails,
                    len(walls),
                    min(walls),
                    median(walls),
                    max(walls),
                    median(cpus),
                    median(wals),
                    f"{ratios[part][v]['wall']:.2f}",
                    " ".join(f"{x:.2f}" for x in paired),
                    f"{ratios[part][v]['cpu']:.2f}",
                    f"{ratios[part][v]['wal']:.2f}",
                ]
            )
    figures = table(
        [
            "part",
            "variant",
            "emails",
            "runs",
            "µs/email wall min",
            "med",
            "max",
            "µs/email CPU med",
            "WAL B/email",
            "wall vs floor",
            "wall vs floor, per round",
            "CPU vs floor",
            "WAL vs floor",
        ],
        rows,
    )
    size_rows = [
        [
            label[v],
            by[v][0].indexes,
            round(median([r.bytes_per_email for r in by[v]])),
            round(median([r.index_bytes_per_email for r in by[v]])),
        ]
        for v in variants
    ]
    sizes_table = table(
        ["variant", "indexes", "bytes/email on disk (table + indexes)", "of which indexes"],
        size_rows,
    )
    goal_rows = []
    for part in parts:
        r = ratios[part]["0012"]
        goal_rows.append(
            [
                f"{part}: <= 1.5 x the floor",
                f"wall {r['wall']:.2f} x (per round, median {r['wall_paired']:.2f} x), "
                f"CPU {r['cpu']:.2f} x, WAL {r['wal']:.2f} x",
                "met" if max(r["wall"], r["cpu"]) <= 1.5 else "MISSED",
            ]
        )
    goals = table(["goal", "figure (medians)", "verdict"], goal_rows)
    print(f"\n### What one email costs the database ({args.users:,} users)\n")
    print(figures)
    print()
    print(sizes_table)
    print()
    print(goals)
    print(
        f"\n{args.rounds} interleaved rounds, each variant on a fresh CREATE DATABASE ... "
        f"TEMPLATE copy after a CHECKPOINT. Delivery: the first {args.deliver:,} emails, "
        f"{BATCHES_PER_CLAIM} batches of {BATCH} per claim. Lease: {args.chunks} steps of "
        f"{CHUNK:,} users; fan-out: {args.chunks} items of {CHUNK:,} users. PostgreSQL {version}."
    )
    return {
        "machine": machine(version),
        "runs": [
            vars(r) | {k: vars(getattr(r, k)) for k in ("digest", "chunk", "range", "delivery")}
            for r in runs
        ],
        "ratios": ratios,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--users", type=int, default=1_000_000)
    parser.add_argument("--deliver", type=int, default=100_000)
    parser.add_argument("--chunks", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--with-0011", action="store_true", help="add the previous index set")
    parser.add_argument("--json", type=Path, default=None, help="write the raw figures here")
    args = parser.parse_args(argv)
    with postgres(PG_SETTINGS) as server:
        output = asyncio.run(run(args, server))
    write_json(args.json, output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
