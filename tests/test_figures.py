"""Every figure the README and docs quote comes from a committed result file: each marked
figure (``<!--f:NAME-->value<!--/f-->``) equals what ``scripts/figures.py`` computes from
its file, and no measurement-like number (a ratio, a share, a latency, a rate) stands in
the prose unmarked, unless it is one of the constants listed here (a setting, a bound, a
target), which no result file measures."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tierstore_kit.checkout import ROOT, load_script

figures = load_script("figures")

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
NUMBER = r"(?<![\w.+-])\d[\d,]*(?:\.\d+)?(?:-\d[\d,]*(?:\.\d+)?)?"
MEASURE = re.compile(NUMBER + r"(?:x\b| ?(?:%|ms\b|µs|us\b|ns\b|GB/s|MB/s|bytes per page|GiB per TB))"
                     r"|(?<![\w.+-])\d[\d,]*\.\d+(?:-\d[\d,]*(?:\.\d+)?)? ?s\b"  # fractional seconds: measured, not set
                     r"|(?<![\w.+-])\d{1,3}(?:,\d{3})+ (?:pages|hits|misses|batches|calls|requests)\b")

# Numbers in the docs that are not measurements: settings, bounds, targets and arithmetic
# on stated inputs. Each is (page, the exact text); a figure measured by a run belongs in a
# result file and a marker instead.
CONSTANTS: dict[str, set[str]] = {
    "README.md": {"500 ms"},  # the Sentinel test's down-after-milliseconds
    "docs/configuration.md": {"0.62 s"},  # the bound on following TRYAGAIN/CLUSTERDOWN
    "docs/design.md": {"5 ms", "200 us"},  # Python's switch interval; index.wire.HOLD_NS
    "docs/loadtest.md": {"10x", "95%"},  # the CPU model's design goal; the interval's level
    "docs/guarantees.md": {"20,000 pages"},  # test_check.py's store
    "docs/operations.md": {"95%", "1000 ms", "100,000 pages", "50,000 pages"},  # interval level, drill timeout, runs' sizes
    "docs/performance.md": {"95%", "5%", "3%", "10 us", "200 us"},  # the interval's level; targets: eviction, slowdown, per page; index.wire.HOLD_NS
    "docs/testing.md": {"10x", "50-80%", "0.2-3 s"},  # a test's bound; the stress run's capacity cuts and Redis downtime
}


def unmarked(page: Path) -> list[str]:
    text = figures.MARK.sub("", FENCE.sub("", page.read_text()))
    allowed = CONSTANTS.get(str(page.relative_to(ROOT)), set())
    return [m.group(0) for m in MEASURE.finditer(text) if m.group(0) not in allowed]


@pytest.mark.parametrize("page", figures.PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_marked_figure_equals_its_result_file(page: Path) -> None:
    assert figures.stale(page) == []


@pytest.mark.parametrize("page", figures.PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_measured_figure_is_quoted_without_its_source(page: Path) -> None:
    assert unmarked(page) == []


def test_every_figure_is_quoted_somewhere() -> None:
    """A figure no page shows is dead code in figures.py."""
    used = {m.group(1) for page in figures.PAGES for m in figures.MARK.finditer(page.read_text())}
    assert sorted(set(figures.FIGURES) - used) == []


def test_the_checks_see_marked_and_unmarked_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both checks above could pass by finding nothing: a stale marked figure and a typed
    one are each caught."""
    name = next(iter(figures.FIGURES))
    page = tmp_path / "page.md"
    page.write_text(f"reads <!--f:{name}-->0.01x<!--/f--> and 1.37x by hand, {figures.compute(name)} quoted\n")
    monkeypatch.setattr(figures, "ROOT", tmp_path)
    assert len(figures.stale(page)) == 1
    found = MEASURE.findall(figures.MARK.sub("", page.read_text()))
    assert "1.37x" in found
    page.write_text(f"<!--f:{name}-->{figures.compute(name)}<!--/f-->\n")
    assert figures.stale(page) == []
