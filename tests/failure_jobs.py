"""Jobs that fail the way real ones do (tests/test_failures.py): deep in a call, with a cause,
quoting a secret their configuration gave them."""

from __future__ import annotations

import os

from cronlock import JobContext, job

# The test puts the settings' secrets here, as a job's own configuration would hold them.
LEAK = "CRONLOCK_TEST_LEAK"


def _connect(url: str) -> None:
    raise ConnectionError(f"cannot reach {url}")


@job("leaks-a-secret")
async def leaks_a_secret(ctx: JobContext) -> None:
    """Raise, from a cause, with the secrets in the message: none may be stored or logged."""
    try:
        _connect(os.environ[LEAK])
    except ConnectionError as exc:
        raise ValueError(f"billing failed with {os.environ[LEAK]}") from exc


@job("raises-long")
async def raises_long(ctx: JobContext) -> None:
    """A message far longer than a row should hold."""
    raise RuntimeError("x" * 100_000)
