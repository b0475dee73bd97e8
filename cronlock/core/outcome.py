"""What a trigger comes to: a run that succeeded, failed, timed out or was cancelled, a skip,
or a run accepted to go on in the background. The runner makes them; the HTTP layer, the
CLI and the metrics read them."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from cronlock.core.jobs import Trigger
from cronlock.core.ledger import iso
from cronlock.tracing import Span

# "lease_lost": a lease run's attempt on this instance that stopped because its lease was no
# longer its own (another instance took the run over); only ever logged and counted, since a
# lease run's trigger was answered 202 when it began.
Kind = Literal["succeeded", "skipped", "accepted", "failed", "timed_out", "cancelled", "lease_lost"]


@dataclass
class Outcome:
    job: str
    kind: Kind
    run_id: int | None = None
    slot: datetime | None = None
    processed: Any = None
    duration_ms: float | None = None
    reason: str | None = None
    trigger: Trigger = "scheduled"
    key: str | None = None  # a keyed job's key, shown in every answer about its run
    lease_expires_at: datetime | None = None  # a lease run's, as it began (database clock)
    # A failed run whose connection broke during its COMMIT: whether the commit landed is not
    # known here (the run's ledger row tells: `ledger.finish` leaves a succeeded row alone).
    commit_unknown: bool = False
    # A fan-out run's number of items (cronlock/core/fanout.py), in its 202 answer.
    items: int | None = None
    # A run that raised: its exception's type, message and traceback (cronlock/core/failure.py),
    # logged at error with the run's line; never in the trigger's answer (GET /cron/runs/{id}).
    failure: dict[str, Any] | None = None


# What a span's status calls an error: the kinds answered with a 5xx.
ERROR_KINDS = frozenset({"failed", "timed_out", "cancelled", "lease_lost"})


def annotate(span: Span, outcome: Outcome) -> None:
    """What a trigger's or a run's span says of its outcome (cronlock/tracing.py)."""
    if not span.recording:
        return
    skipped = outcome.kind == "skipped"
    span.set(
        outcome=outcome.kind,
        key=outcome.key,
        slot=outcome.slot,
        trigger=outcome.trigger,
        run_id=outcome.run_id,
        skip_reason=outcome.reason if skipped else None,
        reason=None if skipped else outcome.reason,
        duration_ms=outcome.duration_ms,
    )
    if outcome.kind in ERROR_KINDS:
        span.fail(outcome.reason or outcome.kind)


def answer(outcome: Outcome) -> tuple[int, dict[str, Any]]:
    """The HTTP status and JSON body that answer a trigger (the CLI prints the same body)."""
    # A key-less job's answers are as they were before keys: no "key" member at all.
    ids: dict[str, Any] = {"job": outcome.job, "run_id": outcome.run_id}
    if outcome.key is not None:
        ids["key"] = outcome.key
    if outcome.kind == "succeeded":
        done: dict[str, Any] = {
            "job": outcome.job,
            "processed": outcome.processed,
            "run_id": outcome.run_id,
            "slot": iso(outcome.slot),
            "duration_ms": outcome.duration_ms,
        }
        if outcome.key is not None:
            done["key"] = outcome.key
        return 200, done
    if outcome.kind == "skipped":
        body: dict[str, Any] = {"job": outcome.job, "skipped": True, "reason": outcome.reason}
        if outcome.key is not None:
            body["key"] = outcome.key
        if outcome.slot is not None:
            body["slot"] = iso(outcome.slot)
        if outcome.run_id is not None:  # a redelivered message's run (Runner.message_done)
            body["run_id"] = outcome.run_id
        return 200, body
    if outcome.kind == "accepted":
        accepted = {**ids, "slot": iso(outcome.slot)}
        if outcome.lease_expires_at is not None:
            accepted["lease_expires_at"] = iso(outcome.lease_expires_at)
        if outcome.items is not None:
            accepted["items"] = outcome.items
        return 202, accepted
    if outcome.kind == "timed_out":
        return 504, {"error": "job timed out", **ids}
    if outcome.kind == "lease_lost":
        # Only `python -m cronlock run` of a lease job prints this (a trigger answered 202 long
        # before): the run was handed over and goes on, or is recorded, elsewhere.
        return 500, {
            "error": "lease lost: the run goes on elsewhere",
            "reason": outcome.reason,
            **ids,
        }
    if outcome.kind == "cancelled":
        # Still a 5xx: the slot is not done, and a scheduler should know.
        return 500, {"error": "job cancelled", **ids}
    if outcome.commit_unknown:
        return 500, {"error": "job failed", **ids, "commit": "unknown"}
    return 500, {"error": "job failed", **ids}
