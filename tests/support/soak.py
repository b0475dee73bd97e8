"""The randomized soak: 3 instances behind nginx and PgBouncer, clients firing triggers for
jobs of every shape (tests/soak_jobs.py and the digest) while a fault injector, every few
seconds, picks one of: kill -9 and restart an instance, SIGSTOP then SIGCONT one, restart
PostgreSQL (cleanly or after a kill -9), restart PgBouncer, freeze PgBouncer. Then a checker
reads the whole history (answers, ledger, effect rows with their writers and times, pg_locks
and sessions, PgBouncer's pools, the provider's counts) and lists every violation.

The seed fixes the fault schedule and every client's choices (each client and the injector
draws from a Random of its own); the timing is the machine's, so a run replays the same
decisions, not the same interleaving. `tests/test_soak.py` runs a minute of it,
`bench/soak.py` ten or more.

Adding a shape is one line in SHAPES, plus its job in tests/soak_jobs.py if it needs its own:
a job writing one `soak_effects` row per run (`effect`) is checked like the others; lease jobs
write one `soak_lease_items` row per step and are checked per attempt chain.

Dynamic schedules: the instances run the built-in scheduler, and a changer sets, pauses and
removes the schedules of `soak-dynamic`'s tenants over HTTP all along (`change_loop`). Every
committed version of every row is logged by a trigger of the soak's own (`soak_schedule_log`,
with its transaction's commit time: the server runs with track_commit_timestamp), a watcher
marks when each logged version is first seen committed (`watch_log`), and the checker holds
each run against that history (`dynamic_violations`): each (key, slot) attempted at most once;
each run's slot a tick, after its setting, of a version of the row that was committed, not
paused, when the run decided (none for a removed row); when the soak ends the rows are removed,
and nothing runs after.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import httpx

from cronlock.core.schedules import slots_of
from cronlock.errors import DRIVER_ERRORS
from tests.soak_jobs import EFFECTS_SQL, LEASE_ITEMS_SQL
from tests.support.cluster import Cluster
from tests.support.delivery import API_KEY
from tests.support.faults import GRACEFUL_SHUTDOWN_TIMEOUT, leftovers, wait_ready
from tests.support.history import History, fire, minute_slots, settle_slots
from tests.support.postgres import ScratchPostgres
from tests.support.provider import Provider
from tests.util import AUTH

Params = Callable[[random.Random], dict[str, Any] | None]


@dataclass(frozen=True)
class Shape:
    job: str
    # The trigger's JSON body, drawn from the client's Random; none by default.
    params: Params = lambda rng: None
    # It writes one soak_effects row per succeeded run (tests/soak_jobs.py `effect`).
    effect: bool = True


SHAPES: list[Shape] = [
    Shape("soak-fast"),
    Shape("soak-slow", lambda rng: {"seconds": round(rng.uniform(0.1, 1.5), 2)}),
    Shape("soak-fails"),  # answers 500, its effect rolled back
    Shape("soak-times-out"),  # answers 504, its effect rolled back
    Shape(
        "soak-keyed",
        lambda rng: {"account": f"a{rng.randrange(6)}", "seconds": round(rng.uniform(0, 0.5), 2)},
    ),
    Shape("daily-digest", effect=False),  # its effects are emails
    Shape("soak-lease", lambda rng: {"n": rng.randrange(3, 12)}, effect=False),  # 202, steps
]
SLOTTED = "soak-minutely"  # backfilled slot by slot by its own workers
DYNAMIC = "soak-dynamic"  # dispatched from its rows, changed by `change_loop`
TENANTS = [f"t{i}" for i in range(8)]
# What a schedule change may be answered: done (200), nothing to remove (404), the database or
# PgBouncer away (503), no answer, or nginx's own 502 for an instance killed under it.
CHANGE_ANSWERS = {0, 200, 404, 502, 503}
# Seconds between two looks of the watcher at the schedules' log (`watch_log`).
WATCH_INTERVAL = 0.02
# A dynamic violation lists its row's versions from this long before the run to this long after.
VERSIONS_AROUND = timedelta(seconds=3)
FAULTS = (
    "kill-instance",
    "freeze-instance",
    "restart-postgres",
    "crash-postgres",
    "restart-pgbouncer",
    "freeze-pgbouncer",
)
USERS = 10


def soak_env(provider: Provider) -> dict[str, str]:
    """What the soak's instances run with (on top of tests.support.faults.CLUSTER_ENV)."""
    return {
        "CRON_JOBS": "tests.soak_jobs,cronlock.demo.digest",
        "OUTBOX_ENABLED": "true",
        "EMAIL_BACKEND": "http",
        "EMAIL_API_URL": provider.url,
        "EMAIL_API_KEY": API_KEY,
        "OUTBOX_RATE_LIMIT": "0",
        "OUTBOX_POLL_INTERVAL": "0.2",
        "OUTBOX_LEASE": "3",
        "OUTBOX_SEND_TIMEOUT": "2",
        "OUTBOX_BACKOFF_BASE": "0.2",
        "OUTBOX_BACKOFF_MAX": "2",
        # Faults for a minute must not exhaust a row's attempts.
        "OUTBOX_MAX_ATTEMPTS": "100",
        # Dynamic schedules are dispatched by the built-in scheduler (code schedules are
        # ticked by it too: their slots stay once-only, checked as before).
        "SCHEDULER_ENABLED": "true",
        "SCHEDULER_POLL_INTERVAL": "0.2",
    }


# Settings the soak's PostgreSQL needs: commit times, for the schedules' history.
SOAK_POSTGRES_SETTINGS = {"max_connections": "300", "track_commit_timestamp": "on"}


@dataclass
class Report:
    seed: int
    seconds: float
    faults: Counter[str] = field(default_factory=Counter)
    answers: Counter[int] = field(default_factory=Counter)
    triggers: int = 0
    runs: Counter[str] = field(default_factory=Counter)
    emails: int = 0
    changes: Counter[int] = field(default_factory=Counter)  # schedule changes by answer
    dynamic: Counter[str] = field(default_factory=Counter)  # soak-dynamic's runs by status
    # Schedule versions logged, and how long after its commit time each was seen committed:
    # the median and the longest, seconds (`watch_log`).
    versions: int = 0
    seen_after: tuple[float, float] | None = None
    violations: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        return [
            f"seed {self.seed}, {self.seconds:.0f} s of faults",
            "faults: " + ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())),
            f"triggers: {self.triggers} ("
            + ", ".join(f"{k or 'no answer'}: {v}" for k, v in sorted(self.answers.items()))
            + ")",
            "runs: " + ", ".join(f"{k} {v}" for k, v in sorted(self.runs.items())),
            f"emails delivered: {self.emails}",
            "schedule changes: "
            + ", ".join(f"{k or 'no answer'}: {v}" for k, v in sorted(self.changes.items())),
            "dynamic runs: " + ", ".join(f"{k} {v}" for k, v in sorted(self.dynamic.items())),
            f"schedule versions: {self.versions}"
            + (
                ""
                if self.seen_after is None
                else f", seen committed {self.seen_after[0] * 1000:.0f} ms after their commit"
                f" time (median), {self.seen_after[1] * 1000:.0f} ms at most"
            ),
            f"violations: {len(self.violations)}",
            *(f"  {v}" for v in self.violations),
        ]


# Every committed version of a schedule row (an insert, a set or pause: its version grows; a
# delete), with its transaction, whose commit time the checker reads. The soak's own table and
# trigger, in its own database: the product's code knows nothing of them.
SCHEDULE_LOG_SQL = """
CREATE TABLE IF NOT EXISTS public.soak_schedule_log (
    id       bigserial PRIMARY KEY,
    op       text NOT NULL,
    job      text NOT NULL,
    key      text NOT NULL,
    version  bigint NOT NULL,
    schedule text,
    every    integer,
    tz       text,
    paused   boolean,
    next_at  timestamptz,
    tx_now   timestamptz NOT NULL,
    xid      bigint NOT NULL,
    seen     timestamptz  -- by when it was visible: `watch_log`
);
CREATE OR REPLACE FUNCTION public.soak_schedule_log() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        INSERT INTO public.soak_schedule_log (op, job, key, version, tx_now, xid)
        VALUES ('DELETE', OLD.job, OLD.key, OLD.version, now(), txid_current());
    ELSE
        INSERT INTO public.soak_schedule_log
            (op, job, key, version, schedule, every, tz, paused, next_at, tx_now, xid)
        VALUES (TG_OP, NEW.job, NEW.key, NEW.version, NEW.schedule, NEW.every, NEW.tz,
                NEW.paused, NEW.next_at, now(), txid_current());
    END IF;
    RETURN NULL;
END
$$;
DROP TRIGGER IF EXISTS soak_schedule_log_rows ON cronlock.schedules;
DROP TRIGGER IF EXISTS soak_schedule_log_versions ON cronlock.schedules;
CREATE TRIGGER soak_schedule_log_rows AFTER INSERT OR DELETE ON cronlock.schedules
    FOR EACH ROW EXECUTE FUNCTION public.soak_schedule_log();
CREATE TRIGGER soak_schedule_log_versions AFTER UPDATE ON cronlock.schedules
    FOR EACH ROW WHEN (OLD.version IS DISTINCT FROM NEW.version)
    EXECUTE FUNCTION public.soak_schedule_log();
"""


async def prepare(dsn: str) -> None:
    """The effects tables, the schedules' log and the digest's users (the cluster has migrated
    the database)."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(EFFECTS_SQL)
        await conn.execute(LEASE_ITEMS_SQL)
        await conn.execute(SCHEDULE_LOG_SQL)
        await conn.execute("DELETE FROM cronlock.schedules")
        await conn.execute("TRUNCATE soak_effects, soak_lease_items, public.soak_schedule_log")
        await conn.execute(
            "INSERT INTO cronlock_demo.users (email) "
            "SELECT 'soak' || i || '@example.com' FROM generate_series(1, $1) AS i "
            "ON CONFLICT DO NOTHING",
            USERS,
        )
    finally:
        await conn.close()


# The watcher's look: each entry not seen yet that this statement's snapshot holds gets the
# time of its update, which comes after the snapshot: by then its commit was visible.
MARK_SEEN_SQL = "UPDATE public.soak_schedule_log SET seen = clock_timestamp() WHERE seen IS NULL"


async def watch_log(dsn: str, stop: asyncio.Event) -> None:
    """Mark each version in the schedules' log with a time by which its commit was visible
    (`seen`), every WATCH_INTERVAL until `stop`: directly on PostgreSQL, so that PgBouncer's
    faults do not blind it, and again after each restart or crash of PostgreSQL.

    The checker needs it because a commit's time (`committed`) is taken before the commit
    becomes visible, by as long as its backend waits in between: on a loaded machine a run can
    begin well after a newer version's commit time and still rightly read the older one (see
    `dynamic_violations`)."""
    conn: asyncpg.Connection | None = None
    try:
        while not stop.is_set():
            pause = WATCH_INTERVAL
            try:
                if conn is None:
                    conn = await asyncpg.connect(dsn, timeout=2)
                await conn.execute(MARK_SEEN_SQL, timeout=2)
            except DRIVER_ERRORS:
                if conn is not None:
                    conn.terminate()
                conn, pause = None, 0.2  # PostgreSQL is away: look again shortly
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), pause)
    finally:
        if conn is not None:
            conn.terminate()


@contextlib.asynccontextmanager
async def watching(dsn: str) -> AsyncIterator[None]:
    """`watch_log` in the background for the block's duration."""
    stop = asyncio.Event()
    task = asyncio.create_task(watch_log(dsn, stop), name="soak:watch-log")
    try:
        yield
    finally:
        stop.set()
        await task


class Injector:
    """One fault at a time, every `every` seconds (jittered), until `stop`."""

    def __init__(
        self, cluster: Cluster, postgres: ScratchPostgres, rng: random.Random, report: Report
    ) -> None:
        self.cluster = cluster
        self.postgres = postgres
        self.rng = rng
        self.report = report

    def inject(self, kind: str) -> None:
        bouncer = self.cluster.pgbouncer
        assert bouncer is not None
        rng = self.rng
        if kind == "kill-instance":
            victim = rng.choice(self.cluster.instances)
            victim.kill()
            victim.start()
        elif kind == "freeze-instance":
            victim = rng.choice(self.cluster.instances)
            victim.freeze()
            time.sleep(rng.uniform(0.5, 3.0))
            victim.thaw()
        elif kind == "restart-postgres":
            self.postgres.restart()
        elif kind == "crash-postgres":
            self.postgres.kill()
            self.postgres.start()
        elif kind == "restart-pgbouncer":
            bouncer.terminate()
            bouncer.start()
        elif kind == "freeze-pgbouncer":
            bouncer.freeze()
            time.sleep(rng.uniform(0.5, 2.0))
            bouncer.thaw()
        else:
            raise ValueError(kind)
        self.report.faults[kind] += 1

    async def run(self, stop: float, every: float) -> None:
        while True:
            await asyncio.sleep(self.rng.uniform(0.5, 1.5) * every)
            if time.monotonic() >= stop:
                return
            await asyncio.to_thread(self.inject, self.rng.choice(FAULTS))


async def client_loop(
    client: httpx.AsyncClient, base: str, rng: random.Random, history: History, stop: float
) -> None:
    while time.monotonic() < stop:
        shape = rng.choice(SHAPES)
        await fire(client, base, shape.job, history, params=shape.params(rng), wait=20.0)
        await asyncio.sleep(rng.uniform(0.0, 0.2))


async def change(client: httpx.AsyncClient, base: str, rng: random.Random) -> int:
    """One schedule change of a random tenant over HTTP: set (every 1-3 s, or a cron
    expression; sometimes paused), or remove. Returns the answer's status (0: none)."""
    url = f"{base}/cron/jobs/{DYNAMIC}/schedules/{rng.choice(TENANTS)}"
    try:
        if rng.random() < 0.15:
            response = await client.delete(url, headers=AUTH, timeout=10)
        else:
            body: dict[str, Any] = (
                {"every": rng.choice([1, 2, 3])}
                if rng.random() < 0.8
                else {"schedule": "* * * * *"}
            )
            body["params"] = {"seconds": round(rng.uniform(0, 0.3), 2)}
            body["paused"] = rng.random() < 0.1
            response = await client.put(url, headers=AUTH, json=body, timeout=10)
    except httpx.HTTPError:
        return 0
    return response.status_code


async def change_loop(
    client: httpx.AsyncClient, base: str, rng: random.Random, report: Report, stop: float
) -> None:
    while time.monotonic() < stop:
        report.changes[await change(client, base, rng)] += 1
        await asyncio.sleep(rng.uniform(0.05, 0.3))


def heal(cluster: Cluster, postgres: ScratchPostgres) -> None:
    """Everything back up: PostgreSQL, PgBouncer, every instance."""
    bouncer = cluster.pgbouncer
    assert bouncer is not None
    if not postgres.is_running():
        postgres.start()
    bouncer.thaw()
    if not bouncer.is_alive():
        bouncer.start()
    for instance in cluster.instances:
        instance.thaw()
        if not instance.is_alive():
            instance.start()
    for instance in cluster.instances:
        wait_ready(instance, timeout=30)


async def soak(
    cluster: Cluster,
    postgres: ScratchPostgres,
    provider: Provider,
    *,
    seed: int,
    seconds: float,
    clients: int = 6,
    every: float = 3.0,
    slots: int = 40,
) -> Report:
    """Faults and load for `seconds`, then the system is healed and settled and checked."""
    report = Report(seed, seconds)
    dsn = cluster.postgres_dsn
    await prepare(dsn)
    assert cluster.nginx is not None
    base = cluster.nginx.url
    history = History()
    now = datetime.now(UTC)
    backfill = minute_slots(now, slots)
    start = time.monotonic()
    stop = start + seconds
    injector = Injector(cluster, postgres, random.Random(seed), report)
    limits = httpx.Limits(keepalive_expiry=2.0)
    async with watching(dsn), httpx.AsyncClient(limits=limits) as client:
        for tenant in TENANTS:  # every tenant starts with a schedule, every second
            response = await client.put(
                f"{base}/cron/jobs/{DYNAMIC}/schedules/{tenant}",
                headers=AUTH,
                json={"every": 1},
                timeout=10,
            )
            report.changes[response.status_code] += 1
        loops = [
            client_loop(client, base, random.Random(seed * 1000 + i), history, stop)
            for i in range(clients)
        ]
        pace = max(0.1, seconds / max(slots, 1))
        await asyncio.gather(
            injector.run(stop, every),
            settle_slots(
                client, base, SLOTTED, backfill, history, workers=1, deadline=stop, pause=pace
            ),
            change_loop(client, base, random.Random(seed * 1000 + 999), report, stop),
            *loops,
        )
        # Faults stop: everything comes back, the remaining slots are settled.
        await asyncio.to_thread(heal, cluster, postgres)
        # The tenants' schedules go (logged: nothing may run after), their last runs end.
        db = await asyncpg.connect(dsn)
        try:
            await db.execute("DELETE FROM cronlock.schedules WHERE job = $1", DYNAMIC)
            deadline = time.monotonic() + 30
            while await db.fetchval(
                "SELECT count(*) FROM cronlock.runs WHERE job = $1 AND status = 'running'", DYNAMIC
            ):
                # A run whose instance was killed stays `running` until a listing of the jobs
                # closes it as abandoned (its lock is gone).
                with contextlib.suppress(httpx.HTTPError):
                    await client.get(f"{base}/cron/jobs", headers=AUTH, timeout=10)
                if time.monotonic() > deadline:
                    report.violations.append(f"{DYNAMIC} runs still running 30 s after removal")
                    break
                await asyncio.sleep(0.2)
        finally:
            await db.close()
        unsettled = await settle_slots(
            client, base, SLOTTED, backfill, history, workers=4, deadline=time.monotonic() + 30
        )
        report.violations += [f"{SLOTTED} slot {s} never settled" for s in unsettled]
        # The digest's slot is settled too (it may never have run amid the faults).
        for _ in range(50):
            if (await fire(client, base, "daily-digest", history)).settled:
                break
            await asyncio.sleep(0.2)
        # Lease runs go on after their 202: wait for them (a trigger also takes over a run
        # whose lease expired with a killed or frozen holder).
        deadline = time.monotonic() + 90
        db = await asyncpg.connect(dsn)
        try:
            while await db.fetchval(
                "SELECT count(*) FROM cronlock.runs WHERE job = 'soak-lease' AND status = 'running'"
            ):
                if time.monotonic() > deadline:
                    report.violations.append("lease runs still running 90 s after the faults")
                    break
                await fire(client, base, "soak-lease", history, params={"n": 1})
                await asyncio.sleep(1.0)
        finally:
            await db.close()
        # Listing the jobs closes `running` rows whose lock is gone as `abandoned`.
        listed = await client.get(f"{base}/cron/jobs", headers=AUTH, timeout=10)
        if listed.status_code != 200:
            report.violations.append(f"GET /cron/jobs after the soak: {listed.status_code}")
    report.triggers = len(history.answers)
    report.answers = history.by_status()
    report.violations += await check(cluster, dsn, history, provider, report)
    return report


async def lease_violations(db: asyncpg.Connection) -> list[str]:
    """Lease runs: each item committed once per attempt chain (a run and the runs that took it
    over, `retry_of`), and a succeeded chain has every item 1..n."""
    runs = {
        r["id"]: r
        for r in await db.fetch(
            "SELECT id, retry_of, status, params FROM cronlock.runs WHERE job = 'soak-lease'"
        )
    }

    def root(run_id: int) -> int:
        seen = set()
        while (parent := runs[run_id]["retry_of"]) is not None and parent in runs:
            if run_id in seen:
                break
            seen.add(run_id)
            run_id = parent
        return run_id

    items = await db.fetch("SELECT run_id, item FROM soak_lease_items")
    found: list[str] = []
    per_chain: dict[int, Counter[int]] = {}
    for row in items:
        if row["run_id"] not in runs:
            found.append(f"lease item {row['item']} of unknown run {row['run_id']}")
            continue
        per_chain.setdefault(root(row["run_id"]), Counter())[row["item"]] += 1
    for chain, counts in per_chain.items():
        found += [
            f"lease run {chain}: item {i} committed {n} times" for i, n in counts.items() if n > 1
        ]
    for run_id, run in runs.items():
        if run["status"] != "succeeded":
            continue
        params = run["params"] or {}
        if isinstance(params, str):  # jsonb as text: this connection has no codec for it
            params = json.loads(params)
        wanted = set(range(1, int(params.get("n", 5)) + 1))
        got = set(per_chain.get(root(run_id), Counter()))
        if got != wanted:
            found.append(
                f"lease run {run_id} succeeded with items {sorted(got)}, not 1..{len(wanted)}"
            )
    return found


def dynamic_violations(
    log: Sequence[Mapping[str, Any]], runs: Sequence[Mapping[str, Any]], now: datetime
) -> list[str]:
    """`soak-dynamic`'s runs against its rows' history (`log`: committed versions with their
    commit time, `committed`, and a time by which their commit was visible, `seen`): each
    (key, slot) attempted at most once; each run's slot a tick, after that version was set, of
    a version of its row, not paused, that the run's decision could read: committed before the
    run ended, and not yet replaced when it began. A removed row has no version: a run that
    began after the removal was seen has none.

    The run decides under its lock, between its start (`started_at`, its transaction's) and its
    end, reading the row as then visible. A version whose commit time is after the run ended
    was not visible to it. A version replaced is judged by when its successor was *seen*, not
    by the successor's commit time: PostgreSQL takes a commit's time before the commit becomes
    visible, by as long as the committing backend waits in between (a backend stopped there
    for 0.3 s made one visible 0.31 s after its commit time), so on a loaded machine a run may
    begin after a newer version's commit time and still rightly read the older one. Once a
    successor was seen, every run beginning after read it: no allowance is needed, and none
    is made."""
    found: list[str] = []
    versions: dict[str, list[Mapping[str, Any]]] = {}
    for entry in sorted(log, key=lambda e: (e["committed"], e["id"])):
        chain = versions.setdefault(entry["key"], [])
        if chain and chain[-1]["xid"] == entry["xid"]:
            chain[-1] = entry  # one transaction, one committed state: its last
        else:
            chain.append(entry)
    firsts: dict[tuple[str, datetime], list[Mapping[str, Any]]] = {}
    for r in runs:
        if r["trigger"] == "scheduled":
            firsts.setdefault((r["key"], r["slot"]), []).append(r)
    found += [
        f"{DYNAMIC}/{k}: slot {s.isoformat()} attempted {len(rs)} times: "
        + ", ".join(
            f"run {r['id']} ({r['status']} on {r['instance']}, began {_when(r['started_at'])})"
            for r in rs
        )
        for (k, s), rs in firsts.items()
        if len(rs) > 1
    ]
    for run in runs:
        if run["trigger"] != "scheduled":
            found.append(f"{DYNAMIC} run {run['id']}: trigger {run['trigger']}, not the dispatcher")
            continue
        chain = versions.get(run["key"], [])
        decided = run["finished_at"] or now
        held = False
        for i, v in enumerate(chain):
            replaced = chain[i + 1]["seen"] if i + 1 < len(chain) else None
            if v["op"] == "DELETE" or v["paused"] or v["committed"] > decided:
                continue
            if replaced is not None and replaced < run["started_at"]:
                continue
            slots = slots_of(v["schedule"], v["every"], v["tz"])
            if slots.is_tick(run["slot"]) and v["tx_now"] < run["slot"] <= run["started_at"]:
                held = True
                break
        if not held:
            found.append(
                f"{DYNAMIC}/{run['key']}: run {run['id']} of slot {run['slot'].isoformat()} "
                f"({run['status']} on {run['instance']}, began {_when(run['started_at'])}, "
                f"ended {_when(run['finished_at'])}) is held by no version of its row; "
                "its versions then:"
                + "".join(f"\n      {line}" for line in _versions_around(chain, run, decided))
            )
    return found


def _when(at: datetime | None) -> str:
    return "-" if at is None else at.isoformat(timespec="milliseconds")


def _versions_around(
    chain: Sequence[Mapping[str, Any]], run: Mapping[str, Any], decided: datetime
) -> list[str]:
    """The key's versions in force from a little before the run's slot to its end (what a
    reader of a violation needs, and not the key's whole history)."""
    start = min(run["slot"], run["started_at"]) - VERSIONS_AROUND
    end = decided + VERSIONS_AROUND
    lines = []
    for i, v in enumerate(chain):
        following = chain[i + 1]["committed"] if i + 1 < len(chain) else None
        if v["committed"] > end or (following is not None and following < start):
            continue
        expr = v["schedule"] or f"every {v['every']}s"
        what = "" if v["op"] == "DELETE" else f" {expr}" + (" paused" if v["paused"] else "")
        lines.append(
            f"v{v['version']} {v['op'].lower()}{what}: set {_when(v['tx_now'])}, "
            f"committed {_when(v['committed'])}, seen {_when(v['seen'])}"
        )
    return lines or ["(none)"]


SCHEDULE_HISTORY_SQL = """
SELECT l.*, pg_xact_commit_timestamp((l.xid % 4294967296)::text::xid) AS committed
FROM public.soak_schedule_log AS l WHERE l.job = $1
"""


def overlaps(effects: Iterable[Mapping[str, Any]]) -> list[str]:
    """Two runs of one job (or key) that held the lock at once: each effect's span [started,
    ended] lies inside its run's lock span, so two spans that overlap mean two holders."""
    found: list[str] = []
    spans: dict[tuple[str, str | None], list[Mapping[str, Any]]] = {}
    for e in effects:
        spans.setdefault((e["job"], e["key"]), []).append(e)
    for (job, key), items in spans.items():
        items.sort(key=lambda e: e["started"])
        for before, after in itertools.pairwise(items):
            if after["started"] < before["ended"]:
                found.append(
                    f"{job}/{key}: runs {before['run_id']} ({before['instance']}) and "
                    f"{after['run_id']} ({after['instance']}) overlap"
                )
    return found


async def check(
    cluster: Cluster, dsn: str, history: History, provider: Provider, report: Report
) -> list[str]:
    found: list[str] = []
    db = await asyncpg.connect(dsn)
    try:
        # Every queued email goes out (faults have stopped), each key accepted once.
        deadline = time.monotonic() + 30
        while await db.fetchval(
            "SELECT count(*) FROM cronlock.email_outbox WHERE status = 'pending'"
        ):
            if time.monotonic() > deadline:
                found.append("emails still pending 30 s after the faults stopped")
                break
            await asyncio.sleep(0.2)
        dead = await db.fetchval("SELECT count(*) FROM cronlock.email_outbox WHERE status = 'dead'")
        if dead:
            found.append(f"{dead} emails dead")
        keys = {r[0] for r in await db.fetch("SELECT idempotency_key FROM cronlock.email_outbox")}
        delivered = provider.delivered()
        report.emails = sum(delivered.values())
        found += [f"email key {k} delivered {n} times" for k, n in delivered.items() if n > 1]
        found += [f"email key {k} delivered, not in the outbox" for k in set(delivered) - keys]
        found += [f"email key {k} never delivered" for k in keys - set(delivered)]

        effects = await db.fetch("SELECT * FROM soak_effects")
        runs = await db.fetch("SELECT id, job, key, slot, status, trigger FROM cronlock.runs")
        report.runs = Counter(r["status"] for r in runs)
        succeeded = {r["id"] for r in runs if r["status"] == "succeeded"}
        per_run = Counter(e["run_id"] for e in effects)
        # No effect without a succeeded run; one effect per succeeded run of an effect job.
        found += [f"run {rid}: {n} effects" for rid, n in per_run.items() if n > 1]
        found += [
            f"effect of run {rid} ({job}) without a succeeded run"
            for rid, job in {(e["run_id"], e["job"]) for e in effects}
            if rid not in succeeded
        ]
        effect_jobs = {s.job for s in SHAPES if s.effect} | {SLOTTED, DYNAMIC}
        found += [
            f"succeeded run {r['id']} ({r['job']}) has no effect"
            for r in runs
            if r["status"] == "succeeded" and r["job"] in effect_jobs and r["id"] not in per_run
        ]
        # At most one succeeded run per slot (and key).
        once = Counter(
            (r["job"], r["key"], r["slot"])
            for r in runs
            if r["status"] == "succeeded" and r["slot"] is not None and r["trigger"] != "manual"
        )
        found += [f"{k}: {n} succeeded runs" for k, n in once.items() if n > 1]
        # Every `200 processed` has its succeeded row (and its effect).
        for answer in history.processed():
            rid = answer.body["run_id"]
            if rid not in succeeded:
                found.append(f"{answer.job} run {rid} answered 200 is not succeeded")
            elif answer.job in effect_jobs and rid not in per_run:
                found.append(f"{answer.job} run {rid} answered 200 has no effect")
        # Nothing but the expected answers: 200; 500 and 504 (failed and timed-out runs, JSON
        # with the run id); 503 (the database or PgBouncer away); no answer (a frozen instance
        # or one killed mid-request); nginx's own 502 for a POST whose instance was killed
        # under it (nginx does not retry a POST elsewhere).
        for a in history.answers:
            nginx_502 = a.status == 502 and "nginx" in str(a.body.get("text", ""))
            if a.status not in {0, 200, 202, 500, 503, 504} and not nginx_502:
                found.append(f"{a.job}: answered {a.status} {a.body}")
            if a.status in {500, 504} and "run_id" not in a.body:
                found.append(f"{a.job}: answered {a.status} without a run id: {a.body}")
        found += overlaps(dict(e) for e in effects)
        found += await lease_violations(db)
        found += [
            f"schedule change answered {k}" for k in report.changes if k not in CHANGE_ANSWERS
        ]
        # Versions committed since the watcher's last look (none, normally) are seen now.
        await db.execute(MARK_SEEN_SQL)
        log = [dict(r) for r in await db.fetch(SCHEDULE_HISTORY_SQL, DYNAMIC)]
        lags = sorted((e["seen"] - e["committed"]).total_seconds() for e in log)
        report.versions = len(log)
        report.seen_after = (lags[len(lags) // 2], lags[-1]) if lags else None
        dynamic = [
            dict(r)
            for r in await db.fetch(
                "SELECT id, key, slot, status, trigger, instance, started_at, finished_at"
                " FROM cronlock.runs WHERE job = $1",
                DYNAMIC,
            )
        ]
        report.dynamic = Counter(r["status"] for r in dynamic)
        found += dynamic_violations(log, dynamic, await db.fetchval("SELECT now()"))
        # Nothing left behind once faults stop.
        deadline = time.monotonic() + 15 + GRACEFUL_SHUTDOWN_TIMEOUT
        while left := await leftovers(db, cluster):
            if time.monotonic() > deadline:
                found.append(f"left behind: {left}")
                break
            await asyncio.sleep(0.2)
        running = await db.fetchval("SELECT count(*) FROM cronlock.runs WHERE status = 'running'")
        if running:
            found.append(f"{running} runs left 'running'")
    finally:
        await db.close()
    return found
