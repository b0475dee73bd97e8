"""Operator routes: jobs, runs, locks, metrics (read access). Filled in by the operations work."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter(tags=["operations"])
