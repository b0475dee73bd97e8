"""The docs: the output they show is what the commands print today (`scripts/docs-output`), and
every relative link in README.md and docs/*.md points at a file and heading that exist."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Linked before they exist: another change writes them. Remove each once it lands.
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def load_script() -> ModuleType:
    path = REPO / "scripts" / "docs-output"
    loader = importlib.machinery.SourceFileLoader("docs_output", str(path))
    spec = importlib.util.spec_from_loader("docs_output", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_output"] = module  # dataclasses look their module up there
    loader.exec_module(module)
    return module


@pytest.mark.slow
def test_shown_output_is_current() -> None:
    """Every `<!-- output: STEP -->` block is what its commands print now, times aside."""
    script = load_script()
    blocks = [b for page in PAGES for b in script.find_blocks(page, page.read_text())]
    assert {b.step for b in blocks} >= {
        "readme/first",
        "readme/request",
        "operating/jobs",
        "scheduler/crontab",
    }
    bodies = script.generate(blocks)
    stale = [
        f"{b.path.relative_to(REPO)} ({b.step}):\n--- shown\n{b.body}--- now\n{now}"
        for b in blocks
        if script.stale(b, now := bodies[(b.path, b.step)])
    ]
    assert not stale, "output in the docs is stale: run scripts/docs-output\n\n" + "\n".join(stale)


def test_the_readme_follows_the_run_its_answer_gave() -> None:
    """The README's request block, run in order (test_shown_output_is_current runs it against
    a real service): a 202's run_id is the id the next command follows, and the slot it shows
    done answers a bare `wait=false` with "already done", as shown."""
    script = load_script()
    [block] = [
        b
        for b in script.find_blocks(REPO / "README.md", (REPO / "README.md").read_text())
        if b.step == "readme/request"
    ]
    lines = block.body.splitlines()
    started = [i for i, line in enumerate(lines) if '"run_id"' in line and "processed" not in line]
    assert started, block.body
    run_id = json.loads(lines[started[-1]])["run_id"]
    following = next(line for line in lines[started[-1] :] if line.startswith("$ "))
    assert following.endswith(f"/cron/runs/{run_id}"), following
    assert json.loads(lines[lines.index(following) + 1])["id"] == run_id
    assert '"reason":"already done"' in lines[1]


def test_mask_hides_only_what_changes_between_runs() -> None:
    script = load_script()
    a = "2   daily-digest  2026-12-02 07:00:00Z  cancelled  pid 9889  4902 ms  run 2"
    b = "2   daily-digest  2026-12-03 07:00:00Z  cancelled  pid 20365  486 ms   run 2"
    assert script.mask(a) == script.mask(b)
    assert script.mask(a) != script.mask(a.replace("cancelled", "succeeded"))
    assert script.mask('"key": "-7884539002328793075"') != script.mask('"key": "-1"')


def _outside_fences(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _outside_code(text: str) -> str:
    return re.sub(r"`[^`\n]*`", "", _outside_fences(text))


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    found: set[str] = set()
    for heading in re.findall(r"^#+ (.+)$", _outside_fences(page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in found:
            n += 1
            candidate = f"{slug}-{n}"
        found.add(candidate)
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(_outside_code(page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / unquote(path_part)).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_every_page_is_in_the_index() -> None:
    index = (REPO / "docs" / "index.md").read_text()
    listed = {m for m in LINK.findall(index) if not re.match(r"[a-z]+:", m)}
    for page in sorted((REPO / "docs").glob("*.md")):
        if page.name != "index.md":
            assert page.name in listed, f"docs/index.md does not list {page.name}"
