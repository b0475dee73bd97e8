"""The Docker files: no secret, virtualenv or database in a build context, an image or a commit;
every image pinned by version."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# What the quick start and the compose file leave in a checkout that must stay out.
PRIVATE = [".venv", "var/", "secrets/", ".env", ".git"]


def ignore_lines(name: str) -> list[str]:
    lines = (REPO / name).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_the_build_context_holds_no_secret_and_all_the_dockerfile_copies() -> None:
    ignored = ignore_lines(".dockerignore")
    for entry in PRIVATE:
        assert entry in ignored, f".dockerignore lacks {entry}"
    # The sources the Dockerfile copies from the context must not be ignored.
    copied = [
        source
        for line in (REPO / "Dockerfile").read_text().splitlines()
        if line.startswith("COPY ") and "--from=" not in line
        for source in line.split()[1:-1]
    ]
    assert copied, "the Dockerfile copies nothing from the context?"
    for source in copied:
        assert (REPO / source).exists(), source
        assert source not in ignored, f".dockerignore hides {source}, which the Dockerfile copies"
        assert source.rstrip("/") not in [e.rstrip("/") for e in ignored]


def test_git_ignores_the_secrets_the_quick_start_and_compose_write() -> None:
    """Asked of git itself: the compose secret, the generated secret, the embedded server's
    password file and a .env are never committed."""
    paths = ["secrets/cron_secret", "var/cron_secret", "var/pg.pgpass", ".env"]
    done = subprocess.run(
        ["git", "check-ignore", "--no-index", *paths],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert sorted(done.stdout.split()) == sorted(paths), done.stderr


def test_every_image_is_pinned_by_version() -> None:
    """No `latest`, said or implied: a tag with a digit in it, on every image of the compose
    file and every FROM of the Dockerfile."""
    compose = re.findall(
        r"^\s*image:\s*\"?([^\"\s]+)", (REPO / "docker-compose.yml").read_text(), re.M
    )
    dockerfile = re.findall(r"^FROM\s+(\S+)", (REPO / "Dockerfile").read_text(), re.M)
    assert len(compose) >= 5, compose
    for image in compose + dockerfile:
        _, _, tag = image.rpartition("/")[2].partition(":")
        assert tag, f"{image}: no tag (that is latest)"
        assert tag != "latest", image
        assert re.search(r"\d", tag), f"{image}: not a version"
