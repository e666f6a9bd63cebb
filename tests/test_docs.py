"""The docs hold together: every relative link and anchor in the README and docs/ resolves,
and the README stays short (the rest lives under docs/)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"^#{1,6} (.+)$", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    bad = []
    for target in links(page):
        if re.match(r"^[a-z]+:", target):  # http(s):, mailto:: not ours to check
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert bad == []


def test_the_checker_sees_links_and_anchors() -> None:
    """The checks above could pass by finding nothing: they do find the README's links."""
    readme = links(ROOT / "README.md")
    assert "docs/design.md" in readme and "docs/configuration.md#the-embedded-index" in readme
    assert "the-embedded-index" in anchors(ROOT / "docs" / "configuration.md")
    assert anchors(ROOT / "docs" / "guarantees.md") >= {"threat-model", "disk-stalls"}


def test_the_readme_stays_short_and_every_doc_is_linked_from_it() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    for doc in (ROOT / "docs").glob("*.md"):
        assert f"docs/{doc.name}" in readme, f"docs/{doc.name} is not linked from the README"


def test_testing_md_places_every_test_file_and_each_says_what_it_shows() -> None:
    """docs/testing.md lists the layers and places each test file in one; what a file shows
    is its own docstring, which every test file has (a list of what each test checks would
    drift from the tests)."""
    import ast

    text = (ROOT / "docs" / "testing.md").read_text()
    files = sorted(p.name for p in (ROOT / "tests").glob("test_*.py"))
    assert [f for f in files if f"`{f}`" not in text] == []
    assert [f for f in files if not ast.get_docstring(ast.parse((ROOT / "tests" / f).read_text()))] == []
