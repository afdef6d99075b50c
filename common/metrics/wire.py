"""Metric families as plain msgpack-safe lists, and merging them labelled by worker.

A worker reports its families to the router over the control plane; the router keeps the
last report of each worker and exposes the union once, each sample labelled with the
worker's registered ``worker`` name and ``role`` (the router's own words: a worker cannot
speak for another). Wire form of one family::

    [name, type, help, [[sample_name, {label: value}, value], ...]]

Everything a peer sends is checked before use (``from_wire``), and a report is bounded
in size so that one bad worker cannot swell the router.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

import msgpack
from prometheus_client.core import Metric

MAX_FAMILIES = 256
MAX_SAMPLES = 50_000
_NAME = re.compile(r"^pdkv_[a-zA-Z0-9_]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_TYPES = ("counter", "gauge", "histogram", "summary", "info", "stateset", "unknown")


class WireError(ValueError):
    """A metrics report that breaks the wire form; the message names the first problem."""


def to_wire(families: Iterable[Metric]) -> list:
    return [[f.name, f.type, f.documentation,
             [[s.name, dict(s.labels), float(s.value)] for s in f.samples]]
            for f in families]


def pack(families: Iterable[Metric]) -> bytes:
    """Families as the bytes a control message carries (msgpack of the wire form)."""
    return msgpack.packb(to_wire(families), use_bin_type=True)


def loads(data: bytes) -> object:
    """The wire form from ``pack``'s bytes (unchecked: ``from_wire`` checks it).

    Raises:
        WireError: the bytes are not msgpack.
    """
    try:
        return msgpack.unpackb(data, raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise WireError(f"metrics report is not msgpack: {exc}") from None


def from_wire(data: object) -> list[Metric]:
    """Families from a report, checked.

    Raises:
        WireError: not a list of families, a bad name, type, label or value, too large.
    """
    if not isinstance(data, list) or len(data) > MAX_FAMILIES:
        raise WireError(f"metrics report must be a list of at most {MAX_FAMILIES} families")
    out, total = [], 0
    for item in data:
        if not (isinstance(item, list) and len(item) == 4):
            raise WireError(f"family {str(item)[:60]!r}: need [name, type, help, samples]")
        name, typ, doc, samples = item
        if not (isinstance(name, str) and _NAME.match(name)):
            raise WireError(f"family name {str(name)[:60]!r} must match {_NAME.pattern}")
        if typ not in _TYPES or not isinstance(doc, str) or not isinstance(samples, list):
            raise WireError(f"family {name}: bad type {str(typ)[:20]!r}, help or samples")
        total += len(samples)
        if total > MAX_SAMPLES:
            raise WireError(f"metrics report has more than {MAX_SAMPLES} samples")
        family = Metric(name, doc, typ)
        for sample in samples:
            family.add_sample(*_check_sample(name, sample))
        out.append(family)
    return out


def _check_sample(family: str, sample: object) -> tuple[str, dict[str, str], float]:
    if not (isinstance(sample, list) and len(sample) == 3):
        raise WireError(f"{family}: sample {str(sample)[:60]!r} is not [name, labels, value]")
    name, labels, value = sample
    if not (isinstance(name, str) and name.startswith(family) and _NAME.match(name)):
        raise WireError(f"{family}: sample name {str(name)[:60]!r} outside the family")
    if not isinstance(labels, dict) or not all(
            isinstance(k, str) and _LABEL.match(k) and isinstance(v, str)
            for k, v in labels.items()):
        raise WireError(f"{name}: labels must map label names to strings")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise WireError(f"{name}: value {value!r} is not a number")
    value = float(value)
    if math.isnan(value):
        raise WireError(f"{name}: value is NaN")
    return name, labels, value


def merge(groups: Iterable[tuple[dict[str, str], Iterable[Metric]]]) -> list[Metric]:
    """One family per name over several processes, each sample with its group's labels.

    ``groups`` is ``(labels, families)`` per process; the group's labels replace any of
    the same name on its samples. Families of one name must agree on their type; a
    group that disagrees is left out of that family (the first type seen wins).
    """
    merged: dict[str, Metric] = {}
    for labels, families in groups:
        for f in families:
            into = merged.get(f.name)
            if into is None:
                into = merged[f.name] = Metric(f.name, f.documentation, f.type)
            elif into.type != f.type:
                continue
            for s in f.samples:
                into.add_sample(s.name, {**s.labels, **labels}, s.value)
    return list(merged.values())
