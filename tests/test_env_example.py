"""`.env.example` documents every setting, and the service refuses to run with it as is."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cronlock.settings import PLACEHOLDER_SECRET, Settings, SettingsError

EXAMPLE = Path(__file__).resolve().parent.parent / ".env.example"


def documented() -> set[str]:
    return set(re.findall(r"^([A-Z][A-Z0-9_]*)=", EXAMPLE.read_text(), flags=re.MULTILINE))


def test_every_setting_is_documented() -> None:
    fields = {name.upper() for name in Settings.model_fields}
    assert fields - documented() == set()
    assert documented() - fields == set()


def test_the_example_itself_refuses_to_start() -> None:
    settings = Settings(_env_file=EXAMPLE)
    assert settings.cron_secret is not None
    assert settings.cron_secret.get_secret_value() == PLACEHOLDER_SECRET
    with pytest.raises(SettingsError, match="placeholder"):
        settings.check_secrets()
