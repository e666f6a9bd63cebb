"""The Grafana dashboard in deploy/ and the metrics its queries name (test_metrics.py,
test_e2e_server.py).

Each query is parsed as PromQL (Grafana's variables replaced by values of the right
kind first), and every vector selector in it is returned with the label names the
query uses on it: its matchers and the labels it aggregates or matches by.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import promql_parser

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana-tierstore.json"
SCRAPE_LABELS = {"instance", "job"}  # added by Prometheus to every series it scrapes
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


@dataclass(frozen=True)
class Ref:
    """One series a query selects: its name and the label names the query relies on."""

    name: str
    labels: frozenset[str]


def load() -> dict[str, Any]:
    with open(DASHBOARD) as f:
        return dict(json.load(f))


def grafana_to_promql(expr: str) -> str:
    """Grafana's interval variables become a duration; any other variable a regex value."""
    expr = re.sub(r"\$__(rate_interval|interval|range)\b", "5m", expr)
    return re.sub(r"\$\{?\w+\}?", ".*", expr)


def queries(dash: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    for p in dash["panels"]:
        for t in p.get("targets", []):
            yield f"panel {p['title']!r} target {t['refId']}", grafana_to_promql(t["expr"])
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", v["query"]["query"])
            assert m, f"variable {v['name']}: not label_values(selector, label)"
            yield f"variable {v['name']} (label {m.group(2)})", grafana_to_promql(m.group(1))


def refs(expr: str) -> list[Ref]:
    """The vector selectors of ``expr``, each with the labels used on it (matchers,
    and ``by``/``on`` labels of every aggregation or binary operation above it)."""
    out: list[Ref] = []

    def visit(node: Any, inherited: frozenset[str]) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            used = inherited | {m.name for m in node.matchers.matchers}
            out.append(Ref(str(node.name), frozenset(used)))
            return
        labels = inherited
        modifier = getattr(node, "modifier", None)
        if isinstance(node, promql_parser.AggregateExpr) and modifier is not None:
            labels = labels | set(modifier.labels)
        if isinstance(node, promql_parser.BinaryExpr) and modifier is not None and modifier.matching is not None:
            labels = labels | set(modifier.matching.labels)
        for child in _children(node):
            visit(child, labels)

    visit(promql_parser.parse(expr), frozenset())
    return out


def _children(node: Any) -> list[Any]:
    if isinstance(node, promql_parser.Call):
        return list(node.args)
    if isinstance(node, promql_parser.BinaryExpr):
        return [node.lhs, node.rhs]
    if isinstance(node, promql_parser.MatrixSelector):
        return [node.vector_selector]
    inner = getattr(node, "expr", None)  # AggregateExpr, ParenExpr, UnaryExpr, SubqueryExpr
    return [inner] if inner is not None else []


def family(name: str) -> str:
    """A histogram's family name for its _bucket/_sum/_count series; others unchanged."""
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name
