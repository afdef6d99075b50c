"""deploy/grafana/pdkv.json: every expression names metrics and labels that pdkv exposes,
every metric of the catalogue is on some panel, and every expression parses as PromQL
(Prometheus' own ``promtool``, where it is installed: .ci/run installs it)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from common.metrics import METRICS, family_of, metric

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "pdkv.json"
GATHERED = {"worker", "role", "rank"}   # added by the router; rank by a TP worker's rank 0
_SERIES = re.compile(r"\b(pdkv_[a-z0-9_]+)\b(\{[^}]*\})?")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*\"")
_BY = re.compile(r"\bby\s*\(([^)]*)\)")
_FUNCTIONS = {"label_values"}


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(d: dict) -> list[dict]:
    return [p for p in d["panels"] if p["type"] != "row"]


def _exprs(d: dict) -> list[tuple[str, str]]:
    """(panel title, expression) of every target and of the template variables."""
    out = [(p["title"], t["expr"]) for p in _panels(d) for t in p["targets"]]
    for var in d["templating"]["list"]:
        if var["type"] == "query":
            out.append((f"variable {var['name']}", var["query"]["query"]))
    return out


def _labels_of(series: str) -> set[str]:
    family = family_of(series)
    labels = set(metric(family).labels) | GATHERED
    return labels | ({"le"} if series.endswith("_bucket") else set())


@pytest.mark.parametrize("title, expr", _exprs(_dashboard()))
def test_every_expression_names_existing_metrics_and_labels(title, expr):
    found = _SERIES.findall(expr)
    assert found, f"{title}: {expr!r} names no pdkv metric"
    allowed: set[str] = set()
    for series, selector in found:
        assert family_of(series), f"{title}: {series} is not a pdkv metric (catalogue)"
        if series.endswith("_bucket"):
            assert metric(family_of(series)).kind == "histogram", (title, series)
        labels = _labels_of(series)
        allowed |= labels
        for name, _ in _MATCHER.findall(selector or ""):
            assert name in labels, f"{title}: {series} has no label {name!r}"
    for group in _BY.findall(expr):
        for name in (n.strip() for n in group.split(",")):
            assert name in allowed, f"{title}: 'by ({group})' uses {name!r}, not a label here"


def test_every_metric_is_on_some_panel():
    shown = {family_of(s) for _, expr in _exprs(_dashboard())
             for s, _ in _SERIES.findall(expr)}
    missing = sorted(m.name for m in METRICS if m.name not in shown)
    assert not missing, f"metrics on no panel of the dashboard: {missing}"


def test_panels_are_well_formed():
    d = _dashboard()
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in _panels(d):
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, (p["title"], g)
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"] and p.get("description"), p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
    assert {v["name"] for v in d["templating"]["list"]} == {"datasource", "worker"}


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool (Debian package prometheus) not installed")
def test_every_expression_parses_as_promql(tmp_path):
    rules = [{"record": f"pdkv:panel_{i}", "expr": _concrete(expr)}
             for i, (_, expr) in enumerate(_exprs(_dashboard()))
             if not any(f + "(" in expr for f in _FUNCTIONS)]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def _concrete(expr: str) -> str:
    """The expression as Grafana sends it: variables replaced."""
    return expr.replace("$__rate_interval", "1m").replace("$worker", ".*")
