"""The wheel holds the library and nothing else: the `cronlock` package alone at the top of
site-packages (no `app`, no test cluster, no bench routes), with every file it needs; and
it lives beside an application whose own package is named `app`."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_wheel_holds_only_the_library(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "-q", "-w", str(tmp_path)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    [wheel] = tmp_path.glob("cronlock-*.whl")
    names = {n for n in zipfile.ZipFile(wheel).namelist() if ".dist-info/" not in n}
    library = REPO / "cronlock"
    shipped = {
        str(p.relative_to(REPO))
        for p in library.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert any(n.startswith("cronlock/web/ui/templates/") for n in shipped)
    assert any(n.startswith("cronlock/db/migrations/") and n.endswith(".sql") for n in shipped)
    assert names == shipped
    assert {n.split("/")[0] for n in names} == {"cronlock"}
    entry_points = next(
        zipfile.ZipFile(wheel).read(n).decode()
        for n in zipfile.ZipFile(wheel).namelist()
        if n.endswith(".dist-info/entry_points.txt")
    )
    assert "cronlock = cronlock.cli.main:main" in entry_points
    sources = {n: zipfile.ZipFile(wheel).read(n).decode() for n in names if n.endswith(".py")}
    text = "\n".join(sources.values())
    # Test knobs (no fsync, crashes on demand, standbys) and bench routes live in tests/support
    # and bench/.
    for test_only in ('"fsync"', "--no-sync", '"/bench"', "def kill", "standby("):
        assert test_only not in text, test_only
    # SIGKILL only where the embedded server ends what it started and would not stop (a
    # postmaster past its stop timeout, a tool's process group): never a crash on demand.
    assert [n for n, source in sources.items() if "SIGKILL" in source] == [
        "cronlock/cli/embedded.py"
    ]


def test_an_application_package_named_app_and_cronlock_live_in_one_process(
    tmp_path: Path,
) -> None:
    """The full-stack FastAPI template's backend is a package named `app`: its own modules
    import, and cronlock's public names with them (0.1's `app` package shadowed them)."""
    project = tmp_path / "project"
    (project / "app").mkdir(parents=True)
    (project / "app" / "__init__.py").write_text("")
    (project / "app" / "jobs.py").write_text(
        textwrap.dedent(
            """
            from cronlock import Cronlock, JobContext, Settings, job

            cron = Cronlock(
                Settings(_env_file=None, cron_secret="s" * 40, database_url=None),
                housekeeping=False,
            )

            @cron.job("report", every=60)
            async def report(ctx: JobContext) -> str:
                return "ok"

            @job("module-level", every=60)
            async def module_level(ctx: JobContext) -> None:
                return None

            OWN = "the app's own module"
            """
        )
    )
    script = textwrap.dedent(
        """
        import sys
        from app.jobs import OWN, cron
        import app, cronlock
        assert OWN == "the app's own module"
        assert app.__file__.startswith(sys.argv[1]), app.__file__
        assert cronlock.__file__.endswith("cronlock/__init__.py")
        assert sorted(cron.jobs) == ["report"], sorted(cron.jobs)
        print("ok")
        """
    )
    # The project first on the path, as `uvicorn app.main:app` run from it has it; cronlock
    # from this checkout behind it (an installed cronlock brings no `app` at all: the test
    # above).
    env_path = f"{project}:{REPO}"
    result = subprocess.run(
        [sys.executable, "-c", script, str(project)],
        cwd=project,
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_the_public_api_is_what_all_names() -> None:
    import cronlock

    assert {"job", "JobContext", "LeaseLost", "RunCancelled", "Cronlock", "Settings"} <= set(
        cronlock.__all__
    )
    assert "job_lock" in cronlock.__all__
    for name in cronlock.__all__:
        assert getattr(cronlock, name) is not None, name
