"""Alerts that arrive: Healthchecks.io-style pings and Standard Webhooks-signed webhooks,
through a durable queue in the database (`<DB_SCHEMA>.alerts`, migration 0009).

Events come from the database, not from the process that saw them happen: every instance's
alert loop reads the ledger (runs started or finished since its last look), the due slots
and the pauses, and queues one row per event and destination with a deterministic `msg_id`
(`failed:<run id>`, `overdue:<job>:<slot>`...), `ON CONFLICT DO NOTHING`. So an instance that
crashes after a run ended loses no alert (another instance, or itself after the restart,
raises it from the ledger), and an event seen by every instance at once (an overdue slot) is
queued once.

Delivery is the outbox's machinery in small (cronlock/delivery/outbox.py,
cronlock/delivery/sender.py): rows are claimed with SKIP LOCKED and a lease, sent, then marked sent,
or retried with a doubling backoff until ALERT_MAX_ATTEMPTS or their `expires_at`. A sender that
dies mid-send leaves its claim to expire, and another sends again: at least once, deduplicated by
the receiver on `webhook-id`. A ping's retries end with its job's grace: a late "start" or "success"
ping would lie.

Webhooks are signed the Standard Webhooks way (standardwebhooks.com): `webhook-id`,
`webhook-timestamp` (Unix seconds) and `webhook-signature: v1,<base64 HMAC-SHA256 of
id.timestamp.body>` with ALERT_WEBHOOK_SECRET, signed afresh at each attempt so a receiver's
replay window accepts a late retry.

Events: `failed`, `timed_out` (a run ended so), `recovered` (a success after one of those),
`overdue` (once per job and slot; for a dynamic job, once per episode: see `_raise_dynamic`),
`overdue_resolved` (a dynamic job's episode over), `paused_too_long` (once per pause),
`lease_lost` (a lease attempt closed `abandoned` by its takeover, cronlock/core/lease.py). Pings:
start, success and failure of every run.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import hmac
import json
import logging
import time
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import httpx

from cronlock.core import ledger, pause, schedules
from cronlock.core.due import due_slot, is_overdue
from cronlock.core.jobs import Job, Registry
from cronlock.db.lock import internal_lock
from cronlock.db.pool import Conn
from cronlock.errors import DATABASE_ERRORS, describe
from cronlock.settings import Settings, SettingsError
from cronlock.sql import qualify

if TYPE_CHECKING:
    from cronlock.core.runner import Runner

log = logging.getLogger("cronlock.alerts")

FAILURES = ("failed", "timed_out")
PING_FAILURES = ("failed", "timed_out", "abandoned", "cancelled")
# The scanner looks back this far behind its last look: a run that finished in the same
# instant as the previous look is seen again (and deduplicated), never missed.
OVERLAP = timedelta(seconds=10)


def webhook_key(secret: str) -> bytes:
    """The HMAC key of a Standard Webhooks secret (`whsec_` + base64)."""
    text = secret.removeprefix("whsec_")
    try:
        key = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise SettingsError("ALERT_WEBHOOK_SECRET must be whsec_ followed by base64") from exc
    if len(key) < 24:
        raise SettingsError("ALERT_WEBHOOK_SECRET is shorter than 24 bytes")
    return key


def sign(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header value for one attempt."""
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def verify(secret: str, headers: dict[str, str], body: bytes, tolerance: float = 300) -> bool:
    """A receiver's check (as in docs/triggering.md): signature and timestamp window."""
    msg_id, stamp = headers.get("webhook-id", ""), headers.get("webhook-timestamp", "")
    if not stamp.isdigit() or abs(time.time() - int(stamp)) > tolerance:
        return False
    expected = sign(webhook_key(secret), msg_id, int(stamp), body)
    # Space-separated `v1,<sig>` entries (several while a sender rotates its secret).
    offered = headers.get("webhook-signature", "").split()
    return any(hmac.compare_digest(expected, s) for s in offered)


def ping_url(job: Job, settings: Settings) -> str | None:
    if job.ping_url:
        return job.ping_url
    if settings.alert_ping_url:
        return settings.alert_ping_url.replace("{job}", job.name)
    return None


def webhook_url(job: Job, settings: Settings) -> str | None:
    return job.webhook_url or settings.alert_webhook_url


def enabled(registry: Registry, settings: Settings) -> bool:
    return any(ping_url(j, settings) or webhook_url(j, settings) for j in registry.values())


def check(registry: Registry, settings: Settings) -> None:
    """At start-up: a webhook needs a secret, and the secret must be one."""
    if any(webhook_url(j, settings) for j in registry.values()):
        if settings.alert_webhook_secret is None:
            raise SettingsError("a webhook URL is set: ALERT_WEBHOOK_SECRET is required")
        webhook_key(settings.alert_webhook_secret.get_secret_value())


# --- raising events ---------------------------------------------------------------------------

QUEUE_SQL = """
INSERT INTO {schema}.alerts (msg_id, kind, event, job, url, body, expires_at)
VALUES ($1, $2, $3, $4, $5, $6, now() + make_interval(secs => $7))
ON CONFLICT (msg_id) DO NOTHING
"""


def payload(event: str, job: str, at: datetime, run: ledger.Run | None = None, **extra: Any) -> Any:
    data: dict[str, Any] = {"job": job, **extra}
    if run is not None:
        data.update(
            key=run.key,
            run_id=run.id,
            slot=ledger.iso(run.slot),
            outcome=run.status,
            error=run.error,
            instance=run.instance,
            attempt=run.attempt,
        )
    return {"type": f"cronlock.{event}", "timestamp": at.isoformat(), "data": data}


async def _queue(
    conn: Conn,
    settings: Settings,
    msg_id: str,
    kind: str,
    event: str,
    job: str,
    url: str,
    body: Any,
    ttl: float,
) -> None:
    await conn.execute(
        qualify(QUEUE_SQL, settings.db_schema), msg_id, kind, event, job, url, body, ttl
    )


async def raise_events(
    conn: Conn, registry: Registry, settings: Settings, since: datetime
) -> datetime:
    """Queue the events since `since` (database time); returns when this look began."""
    schema = settings.db_schema
    now: datetime = await conn.fetchval("SELECT now()")
    jobs = [j for j in registry.values() if ping_url(j, settings) or webhook_url(j, settings)]
    names = [j.name for j in jobs]
    if not jobs:
        return now
    for run in await ledger.started_since(conn, schema, names, since):
        job = registry[run.job]
        url = ping_url(job, settings)
        if url:
            await _queue(
                conn,
                settings,
                f"ping:{run.id}:start",
                "ping",
                "start",
                job.name,
                url.rstrip("/") + "/start",
                {"run_id": run.id},
                job.grace,
            )
    for run in await ledger.finished_since(conn, schema, names, since):
        job = registry[run.job]
        url = ping_url(job, settings)
        if url and (run.status == "succeeded" or run.status in PING_FAILURES):
            ok = run.status == "succeeded"
            await _queue(
                conn,
                settings,
                f"ping:{run.id}:{'success' if ok else 'fail'}",
                "ping",
                "success" if ok else "fail",
                job.name,
                url.rstrip("/") if ok else url.rstrip("/") + "/fail",
                {"run_id": run.id, "outcome": run.status, "error": run.error},
                job.grace,
            )
        hook = webhook_url(job, settings)
        if not hook:
            continue
        event = None
        if run.status in FAILURES:
            event = run.status
        elif run.status == "abandoned" and run.lease_token is not None:
            event = "lease_lost"  # a lease attempt closed by its takeover (cronlock/core/lease.py)
        elif run.status == "succeeded":
            before = await ledger.previous_status(conn, schema, run)
            if before in (*FAILURES, "abandoned"):
                event = "recovered"
        if event is not None:
            await _queue(
                conn,
                settings,
                f"{event}:{run.id}",
                "webhook",
                event,
                job.name,
                hook,
                payload(event, job.name, now, run),
                settings.alert_retry_window,
            )
    await _raise_state(conn, registry, settings, jobs, now)
    return now


async def _raise_state(
    conn: Conn, registry: Registry, settings: Settings, jobs: list[Job], now: datetime
) -> None:
    """Overdue (once per job and due slot) and paused too long (once per pause)."""
    paused = await pause.active(conn, settings.db_schema)
    names = [j.name for j in jobs]
    succeeded = await ledger.last_succeeded_slots(conn, settings.db_schema, names)
    seen = await ledger.first_seen(conn, settings.db_schema, names)
    for job in jobs:
        hook = webhook_url(job, settings)
        if not hook:
            continue
        state = paused.get(job.name)
        if state is not None:
            if (now - state.at).total_seconds() >= settings.alert_paused_too_long:
                at = state.at.isoformat()
                await _queue(
                    conn,
                    settings,
                    f"paused_too_long:{job.name}:{at}",
                    "webhook",
                    "paused_too_long",
                    job.name,
                    hook,
                    payload(
                        "paused_too_long",
                        job.name,
                        now,
                        paused_at=at,
                        paused_by=state.by,
                        note=state.note,
                    ),
                    settings.alert_retry_window,
                )
            continue  # a paused job is never overdue
        if job.dynamic:
            await _raise_dynamic(conn, settings, job, hook, now)
        elif job.key is None and is_overdue(job, now, succeeded.get(job.name), seen.get(job.name)):
            slot = due_slot(job, now)
            assert slot is not None
            await _queue(
                conn,
                settings,
                f"overdue:{job.name}:{slot.isoformat()}",
                "webhook",
                "overdue",
                job.name,
                hook,
                payload("overdue", job.name, now, slot=slot.isoformat()),
                settings.alert_retry_window,
            )


# A dynamic job's overdue keys: one alert per job and episode (from the first look that finds a
# key due for longer than the job's grace to the first that finds none), naming how many and
# the WORST_KEYS most overdue. Not one per key: a million keys late at once (every dispatcher
# down) is one problem, and a million webhooks would bury it. The episode's state is its newest
# row in the alerts table, read and written under a lock per job, so instances looking at once
# raise it once.
WORST_KEYS = 10
OVERDUE_KEYS_LOCK_SQL = "SELECT pg_advisory_xact_lock(hashtextextended($1, $2))"
OVERDUE_KEYS_STATE_SQL = """
SELECT event, msg_id FROM {schema}.alerts
WHERE job = $1 AND kind = 'webhook' AND event IN ('overdue', 'overdue_resolved')
ORDER BY id DESC
LIMIT 1
"""


async def _raise_dynamic(
    conn: Conn, settings: Settings, job: Job, hook: str, now: datetime
) -> None:
    """`overdue` when a key of dynamic `job` is late and no episode is open; `overdue_resolved`
    when none is and one is. In the alert loop's transaction (the lock ends with it)."""
    schema = settings.db_schema
    await conn.execute(
        OVERDUE_KEYS_LOCK_SQL,
        internal_lock(schema, f"overdue-keys:{job.name}"),
        settings.lock_namespace,
    )
    worst = await schedules.late_keys(conn, schema, job, WORST_KEYS)
    last = await conn.fetchrow(qualify(OVERDUE_KEYS_STATE_SQL, schema), job.name)
    opened = last["msg_id"].rpartition(":keys:")[2] if last and last["event"] == "overdue" else None
    if worst and opened is None:
        since = now.isoformat()
        count = await schedules.late_count(conn, schema, job)
        body = payload("overdue", job.name, now, keys_overdue=count, worst=worst, grace=job.grace)
        await _queue(
            conn,
            settings,
            f"overdue:{job.name}:keys:{since}",
            "webhook",
            "overdue",
            job.name,
            hook,
            body,
            settings.alert_retry_window,
        )
    elif not worst and opened is not None:
        await _queue(
            conn,
            settings,
            f"overdue_resolved:{job.name}:keys:{opened}",
            "webhook",
            "overdue_resolved",
            job.name,
            hook,
            payload("overdue_resolved", job.name, now, overdue_since=opened),
            settings.alert_retry_window,
        )


# --- delivering -------------------------------------------------------------------------------

EXPIRE_SQL = """
UPDATE {schema}.alerts SET status = 'dead', last_error = coalesce(last_error, 'expired')
WHERE status = 'pending' AND expires_at < now()
"""
CLAIM_SQL = """
UPDATE {schema}.alerts a
SET claimed_until = now() + make_interval(secs => $2), claimed_by = $3, attempts = attempts + 1
WHERE a.id IN (
    SELECT id FROM {schema}.alerts
    WHERE status = 'pending' AND next_attempt_at <= now()
      AND (claimed_until IS NULL OR claimed_until < now())
    ORDER BY next_attempt_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
RETURNING a.id, a.msg_id, a.kind, a.url, a.body, a.attempts
"""
SENT_SQL = """
UPDATE {schema}.alerts SET status = 'sent', sent_at = now(), claimed_until = NULL,
    last_error = NULL
WHERE id = $1 AND claimed_by = $2
"""
RETRY_SQL = """
UPDATE {schema}.alerts
SET claimed_until = NULL, last_error = $3,
    status = CASE WHEN attempts >= $4 OR expires_at < now() + make_interval(secs => $5)
                  THEN 'dead' ELSE 'pending' END,
    next_attempt_at = now() + make_interval(secs => $5)
WHERE id = $1 AND claimed_by = $2
"""
PRUNE_SQL = """
DELETE FROM {schema}.alerts
WHERE status <> 'pending' AND created_at < now() - make_interval(secs => $1)
"""


def backoff(settings: Settings, attempts: int) -> float:
    return float(min(settings.alert_backoff_base * 2 ** (attempts - 1), settings.alert_backoff_max))


class Sender:
    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.settings = runner.settings
        secret = self.settings.alert_webhook_secret
        self.key = webhook_key(secret.get_secret_value()) if secret is not None else None
        self.client = httpx.AsyncClient(timeout=self.settings.alert_send_timeout)
        self.since: datetime | None = None

    async def once(self) -> int:
        """Raise new events, then send what is due; returns how many were sent."""
        schema, settings = self.settings.db_schema, self.settings
        async with self.runner.db.connection() as conn:
            if self.since is None:
                now: datetime = await conn.fetchval("SELECT now()")
                self.since = now - timedelta(seconds=settings.alert_lookback)
            async with conn.transaction():
                began = await raise_events(conn, self.runner.registry, settings, self.since)
            self.since = began - OVERLAP
            await conn.execute(qualify(EXPIRE_SQL, schema))
            rows = await conn.fetch(
                qualify(CLAIM_SQL, schema), 50, settings.alert_lease, settings.instance_name
            )
        results = await asyncio.gather(*(self._send(r) for r in rows))
        async with self.runner.db.connection() as conn:
            for row, error in zip(rows, results, strict=True):
                if error is None:
                    await conn.execute(qualify(SENT_SQL, schema), row["id"], settings.instance_name)
                else:
                    await conn.execute(
                        qualify(RETRY_SQL, schema),
                        row["id"],
                        settings.instance_name,
                        error[:500],
                        settings.alert_max_attempts,
                        backoff(settings, row["attempts"]),
                    )
        return sum(1 for e in results if e is None)

    async def _send(self, row: Any) -> str | None:
        """Send one alert; None when the receiver took it, else why not."""
        body = json.dumps(row["body"], separators=(",", ":")).encode()
        headers = {"content-type": "application/json", "user-agent": "cronlock"}
        if row["kind"] == "webhook":
            if self.key is None:
                return "no ALERT_WEBHOOK_SECRET"
            stamp = int(time.time())  # signed afresh at each attempt
            headers.update(
                {
                    "webhook-id": row["msg_id"],
                    "webhook-timestamp": str(stamp),
                    "webhook-signature": sign(self.key, row["msg_id"], stamp, body),
                }
            )
        try:
            answer = await self.client.post(row["url"], content=body, headers=headers)
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        if 200 <= answer.status_code < 300:
            return None
        return f"HTTP {answer.status_code}"

    async def aclose(self) -> None:
        await self.client.aclose()


async def alert_loop(runner: Runner, stop: asyncio.Event) -> None:
    """Raise and deliver alerts from this instance, every ALERT_POLL_INTERVAL seconds."""
    sender = Sender(runner)
    pruned = 0.0
    try:
        while not stop.is_set():
            if runner.db.migrated:
                try:
                    await sender.once()
                    if time.monotonic() - pruned > 3600:
                        async with runner.db.connection() as conn:
                            await conn.execute(
                                qualify(PRUNE_SQL, runner.settings.db_schema),
                                runner.settings.alert_lookback + 7 * 86400,
                            )
                        pruned = time.monotonic()
                except DATABASE_ERRORS as exc:
                    log.warning("alerts skipped: %s", describe(exc))
                except Exception:
                    log.exception("alert pass failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), runner.settings.alert_poll_interval)
    finally:
        await sender.aclose()
