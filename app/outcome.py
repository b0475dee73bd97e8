"""What a trigger comes to: a run that succeeded, failed, timed out or was cancelled, a skip,
or a run accepted to go on in the background. The runner makes them; the HTTP layer, the
CLI and the metrics read them."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from app.jobs import Trigger

Kind = Literal["succeeded", "skipped", "accepted", "failed", "timed_out", "cancelled"]


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
