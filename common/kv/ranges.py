"""Row-position ranges for ``free_kv_row``: merging and validation, no side effects.

A request's row splits into ranges like this (page_size 4, committed 10, allocated 28):

    positions  0 ........ 10 .. 12 .............. 28
               | committed  | pad | lookahead tail  |
    ranges     [(0, 12),          (12, 28)]   -> touching, merged to [(0, 28)]

Starts must fall on page boundaries; an end may fall mid-page, and then the caller owns
(and releases) the whole last page.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from common.kv.errors import RangeError


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def ceil_align(n: int, page_size: int) -> int:
    """The first page boundary at or after ``n``."""
    return ceil_div(n, page_size) * page_size


def merge_ranges(ranges: Iterable[Sequence[int]]) -> list[tuple[int, int]]:
    """Drop empty ranges, check order, and merge ranges that touch (``end == next start``).

    Raises:
        RangeError: a range is malformed, reversed, negative, out of order or overlapping.
    """
    merged: list[tuple[int, int]] = []
    for item in ranges:
        start, end = _as_pair(item)
        if end < start:
            raise RangeError(f"range ({start}, {end}) is reversed (end < start)")
        if start < 0:
            raise RangeError(f"range ({start}, {end}) is negative")
        if start == end:
            continue
        if merged and start < merged[-1][1]:
            prev = merged[-1]
            raise RangeError(f"range ({start}, {end}) overlaps or comes before the range "
                             f"ending at {prev[1]}; ranges must be ascending and disjoint")
        if merged and start == merged[-1][1]:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def check_ranges(merged: list[tuple[int, int]], page_size: int, allocated_len: int,
                 protected_len: int) -> None:
    """Validate merged ranges against a row; raises ``RangeError`` naming the culprit."""
    prev_last_page = -1
    for start, end in merged:
        if end > allocated_len:
            raise RangeError(f"range ({start}, {end}) runs past allocated_len={allocated_len}")
        if start % page_size:
            raise RangeError(f"range ({start}, {end}) starts mid-page "
                             f"(page_size={page_size}); starts must be page-aligned")
        if start < protected_len:
            raise RangeError(f"range ({start}, {end}) covers the protected prefix "
                             f"[0, {protected_len}) owned by a cache")
        if start // page_size <= prev_last_page:
            raise RangeError(f"range ({start}, {end}) shares page {start // page_size} with "
                             "the previous range, which does not touch it")
        prev_last_page = (end - 1) // page_size


def page_indices(merged: list[tuple[int, int]], page_size: int) -> np.ndarray:
    """Row page indices covered by the ranges, ascending (the whole last page included)."""
    if not merged:
        return np.empty(0, dtype=np.int64)
    parts = [np.arange(s // page_size, ceil_div(e, page_size)) for s, e in merged]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def range_of_index(merged: list[tuple[int, int]], page_size: int, index: int) -> tuple[int, int]:
    """The merged range that covers row page ``index`` (for error messages)."""
    for start, end in merged:
        if start // page_size <= index < ceil_div(end, page_size):
            return start, end
    raise AssertionError(f"page index {index} not in {merged}")


def _as_pair(item: Sequence[int]) -> tuple[int, int]:
    try:
        start, end = item
        return int(start), int(end)
    except (TypeError, ValueError):
        raise RangeError(f"range {item!r} is not a (start, end) pair of integers") from None
