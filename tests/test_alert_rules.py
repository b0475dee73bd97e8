"""The shipped Prometheus alert rules (deploy/prometheus/cronlock-rules.yml), checked with the
real promtool (Debian's `prometheus` package; CI installs it): the file is valid, and its unit
tests (tests/data/prometheus/cronlock-rules.test.yml, one or more per rule) pass. The metric
names the rules use are the ones the app exports."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from prometheus_client import generate_latest

from cronlock.core.metrics import Metrics
from tests.support.binaries import require_binary

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "deploy" / "prometheus" / "cronlock-rules.yml"
TESTS = REPO / "tests" / "data" / "prometheus" / "cronlock-rules.test.yml"


def promtool(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    require_binary("promtool")
    return subprocess.run(
        ["promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def test_rules_are_valid() -> None:
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 6 rules found" in result.stdout


def test_rules_unit_tests_pass() -> None:
    result = promtool("test", "rules", TESTS.name, cwd=TESTS.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_rule_has_a_unit_test_and_uses_exported_metrics() -> None:
    rules = re.findall(r"- alert: (\w+)", RULES.read_text())
    tested = set(re.findall(r"alertname: (\w+)", TESTS.read_text()))
    assert set(rules) == tested
    exported = generate_latest(Metrics(["x"]).registry).decode()
    for name in set(re.findall(r"\b(cronlock_\w+)", RULES.read_text())):
        assert f"{name}" in exported or f"# TYPE {name.removesuffix('_total')}" in exported, name
