"""docs/operations.md lists every metric with its type and labels, as the catalogue
defines them; the commands that expose or show metrics say so in their --help."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from common.metrics import METRICS
from deploy.cli.main import build_parser

DOC = Path(__file__).resolve().parents[1] / "docs" / "operations.md"
_ROW = re.compile(r"^\| `(pdkv_[a-z0-9_]+)` \| ([^|]+) \| ([^|]+) \|", re.M)


def test_every_metric_is_documented_with_its_type_and_labels():
    rows = {name: (kind.strip(), labels.strip()) for name, kind, labels in
            _ROW.findall(DOC.read_text())}
    for m in METRICS:
        assert m.name in rows, f"docs/operations.md does not list {m.name}"
        kind, labels = rows[m.name]
        assert kind.split()[0] == ("gauge" if m.kind == "info" else m.kind), m.name
        assert labels == (", ".join(f"`{x}`" for x in m.labels) or "-"), m.name
    stale = sorted(set(rows) - {m.name for m in METRICS})
    assert not stale, f"docs list metrics pdkv does not expose: {stale}"


@pytest.mark.parametrize("argv, words", [
    (["router", "--help"], "--metrics-port"), (["run", "--help"], "--metrics-port"),
    (["top", "--help"], "--router"), (["top", "--help"], "--url"),
])
def test_help_names_the_metrics_flags(capsys, argv, words):
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert words in capsys.readouterr().out
