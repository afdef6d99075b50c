"""A Hypothesis state machine drives KvCache against a simple page-by-page model.

The model keeps, per page id, its owner and pin count, and per row which page indices it
still holds; it predicts every OutOfPages and RangeError. After each step the cache's
integrity check holds and its free counts match the model; at the end the recorded free
log replays clean.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from common import KvCache, OutOfPages, RangeError
from common.kv import ceil_div

NUM_PAGES, SWA_PAGES, MAX_ROWS, MAX_ROW_LEN = 24, 14, 4, 64


def _times4(i: int) -> int:
    return 4 * i  # page-aligned cuts for page sizes 1 and 4, so many frees succeed


class Model:
    """Reference: page owner and pins by page id, held page indices by row."""

    def __init__(self, pools: list[str]):
        self.owner = {pool: {} for pool in pools}  # page -> owner (absent: free/pending)
        self.held = {pool: {} for pool in pools}  # owner -> row page indices it holds
        self.pins = {pool: Counter() for pool in pools}
        self.pin_pages: dict[int, dict[str, list[int]]] = {}

    def num_free(self, pool: str, num_pages: int) -> int:
        busy = set(self.owner[pool]) | {p for p, n in self.pins[pool].items() if n}
        return num_pages - 1 - len(busy)


class KvCacheMachine(RuleBasedStateMachine):
    page_size = 4
    swa = False
    rows = Bundle("rows")
    pins = Bundle("pins")

    def __init__(self):
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory()
        self.log = Path(self.tmp.name) / "machine.pdkvlog"
        self.cache = KvCache(NUM_PAGES, self.page_size, swa_num_pages=SWA_PAGES if self.swa
                             else None, max_rows=MAX_ROWS, max_row_len=MAX_ROW_LEN,
                             log_path=self.log, node="machine")
        self.sizes = {"full": NUM_PAGES} | ({"swa": SWA_PAGES} if self.swa else {})
        self.model = Model(list(self.sizes))
        self.open: dict[str, object] = {}
        self.next_owner = 0

    # -- rules --------------------------------------------------------------------------
    @precondition(lambda self: len(self.open) < MAX_ROWS)
    @rule(target=rows)
    def open_row(self):
        owner = f"r{self.next_owner}"
        self.next_owner += 1
        self.open[owner] = self.cache.open_row(owner)
        for pool in self.sizes:
            self.model.held[pool][owner] = set()
        return owner

    @rule(owner=rows, n=st.integers(0, 40))
    def extend(self, owner, n):
        kv = self.open.get(owner)
        if kv is None:
            return
        old, new = kv.allocated_len, kv.allocated_len + n
        need = ceil_div(new, self.page_size) - ceil_div(old, self.page_size)
        short = any(need > self.model.num_free(p, s) for p, s in self.sizes.items())
        tail_freed = old % self.page_size and (old // self.page_size
                                               not in self.model.held["full"][owner])
        if new > MAX_ROW_LEN or (tail_freed and n):
            with _raises(ValueError):
                self.cache.extend(kv, n)
        elif short:
            with _raises(OutOfPages):
                self.cache.extend(kv, n)
        else:
            self.cache.extend(kv, n)
            first = ceil_div(old, self.page_size)
            for pool in self.sizes:
                for page in self.cache.pages(kv, 0, new, pool).tolist()[first:first + need]:
                    assert page not in self.model.owner[pool] and not self.model.pins[pool][page]
                    self.model.owner[pool][page] = owner
                self.model.held[pool][owner].update(range(first, first + need))
            return
        assert kv.allocated_len == old

    @rule(owner=rows, n=st.integers(0, 12))
    def commit(self, owner, n):
        kv = self.open.get(owner)
        if kv is None:
            return
        if kv.committed_len + n > kv.allocated_len:
            with _raises(ValueError):
                self.cache.commit(kv, n)
        else:
            self.cache.commit(kv, n)

    @rule(owner=rows, cuts=st.lists(st.one_of(st.integers(0, MAX_ROW_LEN // 4).map(_times4),
                                              st.integers(0, MAX_ROW_LEN)), max_size=5),
          keep=st.lists(st.booleans(), min_size=5, max_size=5),
          reason=st.sampled_from(["finished", "aborted", "spec_reject", "trimmed"]))
    def free_kv_row(self, owner, cuts, keep, reason):
        kv = self.open.get(owner)
        if kv is None:
            return
        points = sorted(cuts)
        ranges = [(a, b) for (a, b), k in zip(zip(points, points[1:]), keep) if k]
        plan = self._expected_free(kv, ranges)
        if plan is None:
            with _raises(RangeError):
                self.cache.free_kv_row(kv, ranges, reason=reason)
            return
        self.cache.free_kv_row(kv, ranges, reason=reason)
        self._apply_free(owner, plan)

    @rule(owner=rows, upto=st.integers(0, MAX_ROW_LEN))
    def evict_window(self, owner, upto):
        kv = self.open.get(owner)
        if kv is None or not self.swa or upto > kv.allocated_len:
            return
        floor = upto // self.page_size * self.page_size
        idx = range(kv.swa_evicted_seqlen // self.page_size, floor // self.page_size)
        row = self.cache.pages(kv, 0, kv.allocated_len, "swa").tolist()
        if any(i not in self.model.held["swa"][owner] for i in idx):
            with _raises(RangeError):
                self.cache.evict_window(kv, upto)
            return
        self.cache.evict_window(kv, upto)
        self._apply_free(owner, {"swa": [(i, row[i]) for i in idx]})
        assert kv.swa_evicted_seqlen == max(floor, kv.swa_evicted_seqlen)

    @rule(target=pins, owner=rows, a=st.integers(0, MAX_ROW_LEN), b=st.integers(0, MAX_ROW_LEN))
    def pin(self, owner, a, b):
        kv = self.open.get(owner)
        start, end = min(a, b), max(a, b)
        if kv is None or end > kv.allocated_len or start == end:
            return -1
        first, last = start // self.page_size, ceil_div(end, self.page_size)
        per_pool = {"full": self.cache.pages(kv, 0, kv.allocated_len).tolist()[first:last]}
        if self.swa:
            swa_first = max(first, kv.swa_evicted_seqlen // self.page_size)
            per_pool["swa"] = self.cache.pages(kv, 0, kv.allocated_len, "swa").tolist()[
                swa_first:last]
        pinnable = all(p in self.model.owner[pool] or self.model.pins[pool][p]
                       for pool, pages in per_pool.items() for p in pages)
        if not pinnable:
            with _raises(ValueError):
                self.cache.pin(kv, start, end, reason="send")
            return -1
        pin_id = self.cache.pin(kv, start, end, reason="send")
        for pool, pages in per_pool.items():
            self.model.pins[pool].update(pages)
        self.model.pin_pages[pin_id] = per_pool
        return pin_id

    @rule(pin_id=consumes(pins))
    def unpin(self, pin_id):
        if pin_id < 0:
            return
        self.cache.unpin(pin_id)
        for pool, pages in self.model.pin_pages.pop(pin_id).items():
            self.model.pins[pool].subtract(pages)

    @rule(owner=consumes(rows))
    def finish(self, owner):
        """Free whatever the row still holds, one range per held page run, then close it."""
        kv = self.open.pop(owner, None)
        if kv is None:
            return
        ranges = [(i * self.page_size, min((i + 1) * self.page_size, kv.allocated_len))
                  for i in sorted(self.model.held["full"][owner])]
        plan = self._expected_free(kv, ranges)
        assert plan is not None, (ranges, kv)
        self.cache.free_kv_row(kv, ranges)
        self._apply_free(owner, plan)
        assert not any(self.model.held[pool][owner] for pool in self.sizes)
        self.cache.close_row(kv)

    # -- checks -------------------------------------------------------------------------
    @invariant()
    def integrity_and_counts(self):
        self.cache.check_integrity()
        for pool, size in self.sizes.items():
            assert self.cache.num_free_pages(pool) == self.model.num_free(pool, size), pool

    def teardown(self):
        try:
            for owner in list(self.open):
                self.finish(owner)
            for pin_id in list(self.model.pin_pages):
                self.unpin(pin_id)
            for pool, size in self.sizes.items():
                assert self.cache.num_free_pages(pool) == size - 1
            self.cache.close()
            _assert_replays_clean(self.log)
        finally:
            self.tmp.cleanup()

    def _apply_free(self, owner, plan):
        for pool, entries in plan.items():
            for index, page in entries:
                self.model.held[pool][owner].remove(index)
                assert self.model.owner[pool].pop(page) == owner

    def _expected_free(self, kv, ranges):
        """(row page index, page) each pool gets back, or None if the contract rejects it."""
        ps, merged = self.page_size, []
        for start, end in ranges:
            if start == end:
                continue
            if merged and start == merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
            else:
                merged.append((start, end))
        for i, (start, end) in enumerate(merged):
            if start % ps or end > kv.allocated_len or start < kv.protected_len:
                return None
            if i and start // ps <= (merged[i - 1][1] - 1) // ps:
                return None
        idx = [i for s, e in merged for i in range(s // ps, ceil_div(e, ps))]
        row = self.cache.pages(kv, 0, kv.allocated_len).tolist()
        plan = {"full": [(i, row[i]) for i in idx]}
        if self.swa:
            floor = kv.swa_evicted_seqlen
            if merged and merged[0][0] < floor < merged[-1][1] and floor % ps:
                return None
            swa_row = self.cache.pages(kv, 0, kv.allocated_len, "swa").tolist()
            plan["swa"] = [(i, swa_row[i]) for i in idx if i >= floor // ps]
        for pool, entries in plan.items():
            if any(i not in self.model.held[pool][kv.owner] for i, _ in entries):
                return None
        return plan


class _raises:
    def __init__(self, kind):
        self.kind = kind

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        assert kind is not None, f"expected {self.kind.__name__}, nothing was raised"
        return issubclass(kind, self.kind)


def _assert_replays_clean(log: Path) -> None:
    from common.freelog import replay_file

    report = replay_file(log)
    assert report.ok, report.violations[:5]


class PageSize1Machine(KvCacheMachine):
    page_size = 1


class SlidingWindowMachine(KvCacheMachine):
    swa = True


_settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestKvCachePage4 = KvCacheMachine.TestCase
TestKvCachePage1 = PageSize1Machine.TestCase
TestKvCacheSlidingWindow = SlidingWindowMachine.TestCase
for _case in (TestKvCachePage4, TestKvCachePage1, TestKvCacheSlidingWindow):
    _case.settings = _settings
del _case
