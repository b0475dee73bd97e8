"""Shared test constants and helpers (the fixtures themselves live in tests/conftest.py)."""

from __future__ import annotations

# Long enough for Settings.check_secrets and obviously not a real secret.
TEST_SECRET = "cronlock-test-secret-0123456789-abcdefghijklmnop"

__all__ = ["TEST_SECRET", "auth_headers"]


def auth_headers(secret: str = TEST_SECRET) -> dict[str, str]:
    """The Authorization header cronlock expects, as a dict for httpx."""
    return {"Authorization": f"Bearer {secret}"}
