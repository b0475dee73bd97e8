"""Fail closed: no secret, a short one or the placeholder stops the service before it starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError

from cronlock.settings import PLACEHOLDER_SECRET, Settings, SettingsError

GOOD = "g" * 32


def settings(**kw: object) -> Settings:
    return Settings(_env_file=None, **kw)  # type: ignore[arg-type]


def test_no_secret_refuses() -> None:
    with pytest.raises(SettingsError, match="CRON_SECRET is not set"):
        settings().check_secrets()


def test_blank_secret_is_no_secret() -> None:
    with pytest.raises(SettingsError, match="not set"):
        settings(cron_secret="   ").check_secrets()


def test_short_secret_refuses() -> None:
    with pytest.raises(SettingsError, match="shorter than 32"):
        settings(cron_secret="x" * 31).check_secrets()


def test_placeholder_refuses() -> None:
    with pytest.raises(SettingsError, match="placeholder"):
        settings(cron_secret=PLACEHOLDER_SECRET).check_secrets()


def test_weak_previous_secret_refuses() -> None:
    with pytest.raises(SettingsError, match="CRON_SECRET_PREVIOUS"):
        settings(cron_secret=GOOD, cron_secret_previous="short").check_secrets()


def test_secret_file(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text(GOOD + "\n")
    s = settings(cron_secret_file=path)
    s.check_secrets()
    assert s.secrets() == [GOOD.encode()]


def test_unreadable_secret_file(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="cannot be read"):
        settings(cron_secret_file=tmp_path / "missing").check_secrets()


def test_rotation_accepts_both() -> None:
    s = settings(cron_secret=GOOD, cron_secret_previous="p" * 32)
    assert s.secrets() == [GOOD.encode(), b"p" * 32]


def test_empty_env_values_mean_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INSTANCE_NAME", "")
    monkeypatch.setenv("CRON_SECRET_FILE", "")
    s = settings(cron_secret=SecretStr(GOOD))
    assert s.instance_name
    assert s.cron_secret_file is None


def test_http_email_backend_needs_a_key() -> None:
    with pytest.raises(SettingsError, match="EMAIL_API_KEY"):
        settings(cron_secret=GOOD, email_backend="http").check_email()
    settings(cron_secret=GOOD, email_backend="http", outbox_enabled=False).check_email()
    settings(cron_secret=GOOD, email_backend="http", email_api_key="k").check_email()


def test_the_ledger_must_outlive_the_backfill_window() -> None:
    with pytest.raises(SettingsError, match="shorter than BACKFILL_WINDOW"):
        settings(
            cron_secret=GOOD, ledger_retention_days=1, backfill_window=2 * 86400
        ).check_retention()
    settings(cron_secret=GOOD, ledger_retention_days=2, backfill_window=2 * 86400).check_retention()
    settings(cron_secret=GOOD).check_retention()  # the defaults: 90 days against 7


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("database_url", "postgresql://u:hunter2@h:abc/x"),
        ("database_direct_url", "mysql://u:hunter2@h/x"),
        ("cron_secret", "hunter2-é" * 4),
    ],
)
def test_a_bad_setting_is_named_never_quoted(field: str, value: str) -> None:
    """The error names the setting; its text (a start-up log) never holds the value."""
    with pytest.raises(ValidationError) as refused:
        settings(**{field: value})
    assert refused.value.errors()[0]["loc"] == (field,)
    assert "hunter2" not in str(refused.value)
