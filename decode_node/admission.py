"""Admission as memory allows: a FIFO queue and a page reservation ledger.

A request is admitted only when the pool can hold its whole life: the prompt now and one
slot per generated token later. The ledger remembers what each admitted request may still
allocate, so a full pool queues new requests instead of running an admitted one out of
pages mid-decode (retracting to a host tier is a later feature).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from common.kv import KvCache, KvRecord, ceil_div
from common.request import ReqState, SamplingParams


@dataclass
class WorkItem:
    """One request on a decode or colocated worker."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    prefill: str = ""
    prefill_addr: str = ""
    state: ReqState = ReqState.QUEUED
    kv: KvRecord | None = None
    extra: dict = field(default_factory=dict)

    @property
    def max_len(self) -> int:
        """Row positions the request may need: prompt + generated tokens but the last."""
        return len(self.prompt) + self.params.max_new_tokens - 1


class Admission:
    """FIFO queue plus reservations over one ``KvCache``.

    Args:
        cache: the worker's pool.
        max_running: requests admitted at once (rows held).
        whole_life: reserve each request's whole life (default); False reserves only its
            prompt and first decode slot (overcommit: the worker retracts under pressure).
    """

    def __init__(self, cache: KvCache, max_running: int, whole_life: bool = True) -> None:
        self.cache, self.max_running, self.whole_life = cache, max_running, whole_life
        self.queue: OrderedDict[str, WorkItem] = OrderedDict()
        self.admitted: dict[str, WorkItem] = {}

    def enqueue(self, item: WorkItem) -> None:
        self.queue[item.rid] = item

    def _outstanding(self) -> int:
        """Pages admitted requests may still allocate (0 when overcommitting)."""
        if not self.whole_life:
            return 0
        ps = self.cache.page_size
        return sum(ceil_div(it.max_len, ps) - ceil_div(it.kv.allocated_len, ps)
                   for it in self.admitted.values() if it.kv is not None)

    def can_admit(self, item: WorkItem) -> bool:
        if len(self.admitted) >= self.max_running:
            return False
        # overcommit: the prompt and the first decode slot; growth may retract later
        life = item.max_len if self.whole_life else min(item.max_len, len(item.prompt) + 1)
        need = ceil_div(life, self.cache.page_size)
        return self.cache.num_free_pages() - self._outstanding() >= need

    def admit_next(self) -> WorkItem | None:
        """Open and extend the head-of-queue's row over its prompt, or None (not now).

        Strict FIFO: a large request at the head is never starved by small ones.
        """
        if not self.queue:
            return None
        item = next(iter(self.queue.values()))
        if not self.can_admit(item):
            return None
        kv = self.cache.open_row(item.rid)
        self.cache.extend(kv, len(item.prompt))
        del self.queue[item.rid]
        item.kv = kv
        self.admitted[item.rid] = item
        return item

    def requeue(self, item: WorkItem) -> None:
        """Put an item that holds no row back at the head of the queue (it keeps its
        place: it was the head when admitted)."""
        assert item.kv is None and item.rid not in self.admitted, item.rid
        self.queue[item.rid] = item
        self.queue.move_to_end(item.rid, last=False)

    def release(self, item: WorkItem, ranges: list[tuple[int, int]], reason: str) -> None:
        """Free the item's row with ``reason`` and forget it (no-op without a row)."""
        self.admitted.pop(item.rid, None)
        self.queue.pop(item.rid, None)
        if item.kv is None:
            return
        self.cache.free_kv_row(item.kv, ranges, reason=reason)
        self.cache.close_row(item.kv)
        item.kv = None

    def forget(self, item: WorkItem) -> None:
        """Drop the item without freeing: its row's free was handed over (the host
        connector frees it once its copies to the host tier complete)."""
        self.admitted.pop(item.rid, None)
        self.queue.pop(item.rid, None)
        item.kv = None

    def find(self, rid: str) -> WorkItem | None:
        return self.admitted.get(rid) or self.queue.get(rid)

    @property
    def num_free_tokens(self) -> int:
        return max(0, self.cache.num_free_pages() - self._outstanding()) * self.cache.page_size
