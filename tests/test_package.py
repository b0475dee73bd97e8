"""The wheel holds the product and nothing else: no test cluster, no bench routes, every
migration file it needs."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_wheel_holds_only_the_product(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "-q", "-w", str(tmp_path)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    [wheel] = tmp_path.glob("cronlock-*.whl")
    names = {n for n in zipfile.ZipFile(wheel).namelist() if ".dist-info/" not in n}
    shipped_sql = {str(p.relative_to(REPO)) for p in (REPO / "app").rglob("*.sql")}
    modules = {str(p.relative_to(REPO)) for p in (REPO / "app").rglob("*.py")}
    # The dashboard's templates and static files are product too (cronlock/web/ui).
    ui = {
        str(p.relative_to(REPO))
        for folder in ("templates", "static")
        for p in (REPO / "app" / "ui" / folder).rglob("*")
        if p.is_file()
    }
    assert ui, "the dashboard's files are found"
    assert names == modules | shipped_sql | ui | {"app/py.typed"}
    assert not any(n.startswith(("tests/", "bench/", "scripts/")) for n in names)
    # What only tests and benchmarks need lives with them.
    assert "app/cluster.py" not in names
    text = "\n".join(zipfile.ZipFile(wheel).read(n).decode() for n in names if n.endswith(".py"))
    # Test knobs (no fsync, crashes on demand, standbys) and bench routes live in tests/support
    # and bench/.
    for test_only in ('"fsync"', "SIGKILL", "--no-sync", '"/bench"', "def kill", "standby("):
        assert test_only not in text, test_only
