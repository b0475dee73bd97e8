"""Prometheus metrics, on a registry of the app's own (never the process-global one), so two
apps in one process (tests) or a reloaded app never share or double-register series.

Two kinds of series:

- **counted here** (`cronlock_runs_total`, `cronlock_run_duration_seconds`,
  `cronlock_skips_total`): per instance, incremented in exactly one place, `Runner._log`,
  which sees every outcome once. Sum them over instances (`sum by (job, outcome)`).
- **read from the database at scrape time** (overdue jobs, the outbox): facts about the whole
  deployment, so every instance reports the same value. Aggregate them with `max`, not `sum`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)

if TYPE_CHECKING:
    from cronlock.core.outcome import Outcome

__all__ = ["CONTENT_TYPE", "Metrics"]

# Finished runs; "accepted" (wait=false) is not one: the same run reports its end later.
FINISHED = ("succeeded", "failed", "timed_out", "cancelled", "lease_lost")
SKIP_REASONS = (
    "already running",
    "already done",
    "already attempted",
    "too late",
    "paused",
    "already retried",
    "schedule changed",
)
# A dynamic run's start after its due time (its tick plus the key's spread offset).
LATENESS_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300, 900, 3600)

# From a quick statement to the longest timeout worth having (an hour).
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


class Metrics:
    def __init__(self, jobs: Iterable[str] = (), lease_jobs: Iterable[str] = ()) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.runs = Counter(
            "cronlock_runs",
            "Runs that finished on this instance, by job and outcome.",
            ["job", "outcome"],
            registry=r,
        )
        self.duration = Histogram(
            "cronlock_run_duration_seconds",
            "Duration of finished runs on this instance, from lock to commit or rollback.",
            ["job", "outcome"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.skips = Counter(
            "cronlock_skips",
            "Triggers answered without running, by job and reason.",
            ["job", "reason"],
            registry=r,
        )
        self.lease_takeovers = Counter(
            "cronlock_lease_takeovers",
            "Lease runs this instance took over after their lease expired, by job.",
            ["job"],
            registry=r,
        )
        self.leases_lost = Counter(
            "cronlock_leases_lost",
            "Lease runs whose holder on this instance stopped because its lease was lost.",
            ["job"],
            registry=r,
        )
        self.fanout_items = Counter(
            "cronlock_fanout_items",
            "Attempts at fan-out items on this instance, by job and outcome (succeeded, "
            "retried, failed, lost: rolled back and worked again).",
            ["job", "outcome"],
            registry=r,
        )
        self.fanout_item_duration = Histogram(
            "cronlock_fanout_item_duration_seconds",
            "Duration of fan-out item attempts on this instance, claim to commit or rollback.",
            ["job", "outcome"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.overdue = Gauge(
            "cronlock_job_overdue",
            "1 if the job's latest tick past its grace period has no succeeded run "
            "(deployment-wide, read from the ledger at scrape time).",
            ["job"],
            registry=r,
        )
        self.overdue_jobs = Gauge(
            "cronlock_overdue_jobs", "How many jobs are overdue (deployment-wide).", registry=r
        )
        self.last_success = Gauge(
            "cronlock_job_last_success_slot_timestamp_seconds",
            "The newest slot with a succeeded scheduled or backfill run (deployment-wide).",
            ["job"],
            registry=r,
        )
        self.paused = Gauge(
            "cronlock_job_paused",
            "1 if the job is paused (deployment-wide, read from the database at scrape time).",
            ["job"],
            registry=r,
        )
        self.paused_for = Gauge(
            "cronlock_job_paused_seconds",
            "How long the job has been paused (0 when it is not; deployment-wide).",
            ["job"],
            registry=r,
        )
        self.clock_offset = Gauge(
            "cronlock_scheduler_clock_offset_seconds",
            "The database's clock minus this instance's, as the built-in scheduler measured it.",
            registry=r,
        )
        self.outbox_depth = Gauge(
            "cronlock_outbox_depth", "Emails waiting to be sent (pending).", registry=r
        )
        self.outbox_due = Gauge(
            "cronlock_outbox_due", "Pending emails that are due now.", registry=r
        )
        self.outbox_oldest = Gauge(
            "cronlock_outbox_oldest_pending_age_seconds",
            "Age of the oldest pending email (0 when none).",
            registry=r,
        )
        self.outbox_dead = Gauge(
            "cronlock_outbox_dead_rows", "Emails given up on (dead-lettered).", registry=r
        )
        self.database_up = Gauge(
            "cronlock_database_up",
            "1 if this scrape could read the database on a primary (0: down, unmigrated or a "
            "standby); the deployment-wide series are stale when it is 0.",
            registry=r,
        )
        # Dynamic jobs (cronlock/core/schedules.py): per instance, the lateness of the runs this
        # instance's dispatcher started; deployment-wide, the schedules' counts.
        self.start_lateness = Histogram(
            "cronlock_schedule_start_lateness_seconds",
            "Dynamic runs this instance dispatched: start after the due time (tick plus spread).",
            ["job"],
            buckets=LATENESS_BUCKETS,
            registry=r,
        )
        self.schedule_counts = Gauge(
            "cronlock_schedules",
            "Dynamic schedules by state: all, paused, due (now) and late (due for longer than "
            "SCHEDULER_CLAIM_TIMEOUT); deployment-wide, read at scrape time.",
            ["job", "state"],
            registry=r,
        )
        # Every known series starts at 0, so rate() and absence alerts work from the start.
        for job in jobs:
            for outcome in FINISHED:
                self.runs.labels(job, outcome)
            for reason in SKIP_REASONS:
                self.skips.labels(job, reason)
        for job in lease_jobs:
            self.lease_takeovers.labels(job)
            self.leases_lost.labels(job)

    def observe(self, outcome: Outcome) -> None:
        """Count one outcome, as `Runner._log` reports it."""
        if outcome.kind == "skipped":
            self.skips.labels(outcome.job, outcome.reason or "unknown").inc()
        elif outcome.kind in FINISHED:
            self.runs.labels(outcome.job, outcome.kind).inc()
            if outcome.duration_ms is not None:
                self.duration.labels(outcome.job, outcome.kind).observe(outcome.duration_ms / 1000)

    def observe_start_lateness(self, job: str, late: timedelta) -> None:
        self.start_lateness.labels(job).observe(max(0.0, late.total_seconds()))

    def set_schedules(self, counts: Mapping[str, Mapping[str, int]]) -> None:
        for job, by_state in counts.items():
            for state, n in by_state.items():
                label = "all" if state == "schedules" else state
                self.schedule_counts.labels(job, label).set(n)

    def observe_item(self, job: str, outcome: str, seconds: float) -> None:
        """Count one attempt at a fan-out item (cronlock/core/fanout_runner.py)."""
        self.fanout_items.labels(job, outcome).inc()
        self.fanout_item_duration.labels(job, outcome).observe(seconds)

    def set_jobs(self, overdue: Mapping[str, bool], last_success: Mapping[str, datetime]) -> None:
        for job, late in overdue.items():
            self.overdue.labels(job).set(1 if late else 0)
        self.overdue_jobs.set(sum(1 for late in overdue.values() if late))
        for job, slot in last_success.items():
            self.last_success.labels(job).set(slot.timestamp())
        for job in overdue.keys() - last_success.keys():
            # No succeeded run in the ledger (any more: pruned by hand, or lost in a failover):
            # no series, rather than the slot of a run that is gone.
            with contextlib.suppress(KeyError):
                self.last_success.remove(job)

    def set_paused(self, paused_for: Mapping[str, float], jobs: Iterable[str]) -> None:
        """`paused_for`: seconds since each paused job was paused; every other job is 0."""
        for job in jobs:
            seconds = paused_for.get(job)
            self.paused.labels(job).set(0 if seconds is None else 1)
            self.paused_for.labels(job).set(seconds or 0)

    def set_outbox(self, stats: Mapping[str, float]) -> None:
        self.outbox_depth.set(stats.get("pending", 0))
        self.outbox_due.set(stats.get("due", 0))
        self.outbox_oldest.set(stats.get("oldest_pending_seconds", 0))
        self.outbox_dead.set(stats.get("dead", 0))
