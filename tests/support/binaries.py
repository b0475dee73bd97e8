"""The Debian packages cluster tests need: their absence fails the run unless opted out."""

from __future__ import annotations

import os
import shutil

import pytest

SKIP_ENV = "CRONLOCK_SKIP_CLUSTER"


def require_binary(name: str) -> None:
    """Fail (CI installs it) or, with CRONLOCK_SKIP_CLUSTER=1, skip when `name` is missing."""
    if shutil.which(name):
        return
    reason = f"`{name}` is not installed (Debian package `{name}`; CI installs it)"
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(reason)
    pytest.fail(f"{reason}; set {SKIP_ENV}=1 to skip these tests")
