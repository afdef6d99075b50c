"""Admission as memory allows: a FIFO queue, and either on-demand allocation or a page
reservation ledger.

On demand (``whole_life=False``, the default with a host tier): a request is admitted
when the pool holds its prompt and first decode slot beyond what the running requests'
next step needs (``headroom``); its row then grows a step at a time, and the decode
scheduler retracts running requests to the host tier when they outgrow the pool
(``decode_node.retraction``). So a pool admits as many requests as it holds now, not as
many as it could hold at their longest.

Whole life (``whole_life=True``): a request is admitted only when the pool can hold its
whole life, the prompt now and one slot per generated token later. The ledger remembers
what each admitted request may still allocate, so a full pool queues new requests instead
of running an admitted one out of pages mid-decode.

Admission opens and extends rows; it never frees one (the scheduler does, once).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from common.kv import KvCache, ceil_div
from common.request import Request


class AdmissionFailed(RuntimeError):
    """Opening ``req``'s row failed (it left the queue, holds nothing): the scheduler
    fails that request alone."""

    def __init__(self, req: Request, cause: Exception) -> None:
        super().__init__(f"{req.rid}: opening its row failed ({type(cause).__name__}: "
                         f"{cause})")
        self.req = req


class Admission:
    """FIFO queue plus reservations over one ``KvCache``.

    Args:
        cache: the worker's pool.
        max_running: requests admitted at once (rows held).
        whole_life: reserve each request's whole life (default); False reserves only its
            prompt and first decode slot (on demand: the worker retracts under pressure).
        headroom: on demand, pages the running requests' next step may take; admission
            leaves them free (None: none).
    """

    def __init__(self, cache: KvCache, max_running: int, whole_life: bool = True,
                 headroom: Callable[[], int] | None = None) -> None:
        self.cache, self.max_running, self.whole_life = cache, max_running, whole_life
        self.headroom = headroom
        self.queue: OrderedDict[str, Request] = OrderedDict()
        self.admitted: dict[str, Request] = {}

    def enqueue(self, req: Request) -> None:
        self.queue[req.rid] = req

    def _outstanding(self) -> int:
        """Pages admitted requests may still allocate (whole life), or their next step
        may (on demand)."""
        if not self.whole_life:
            return self.headroom() if self.headroom is not None else 0
        ps = self.cache.page_size
        return sum(ceil_div(it.max_len, ps) - ceil_div(it.kv.allocated_len, ps)
                   for it in self.admitted.values() if it.kv is not None)

    def can_admit(self, req: Request) -> bool:
        if len(self.admitted) >= self.max_running:
            return False
        # on demand: the prompt and the first decode slot; growth may retract later
        life = req.max_len if self.whole_life else min(req.max_len, len(req.prompt) + 1)
        need = ceil_div(life, self.cache.page_size)
        return self.cache.num_free_pages() - self._outstanding() >= need

    def admit_next(self) -> Request | None:
        """Open and extend the head-of-queue's row over its prompt, or None (not now).

        Strict FIFO: a large request at the head is never starved by small ones.
        """
        if not self.queue:
            return None
        req = next(iter(self.queue.values()))
        if not self.can_admit(req) or self.cache.has_row(req.rid):
            # a reused id waits while its earlier request's row is still open (its host
            # copies end soon; the row is freed then): served as a new row after that
            return None
        del self.queue[req.rid]
        kv = None
        try:
            kv = self.cache.open_row(req.rid)
            self.cache.extend(kv, len(req.prompt))
        except Exception as exc:
            if kv is not None:
                self.cache.close_row(kv)  # extend changed nothing: the row is empty
            raise AdmissionFailed(req, exc) from exc
        req.kv = kv
        self.admitted[req.rid] = req
        return req

    def requeue(self, req: Request) -> None:
        """Put an admitted request whose row was freed back at the head of the queue (it
        keeps its place: it was the head when admitted)."""
        assert req.kv is None, req.rid
        self.admitted.pop(req.rid, None)
        self.queue[req.rid] = req
        self.queue.move_to_end(req.rid, last=False)

    def forget(self, req: Request) -> None:
        """Drop ``req`` from the queue or the admitted set (it ended; its row is the
        scheduler's to free)."""
        self.admitted.pop(req.rid, None)
        self.queue.pop(req.rid, None)

    def find(self, rid: str) -> Request | None:
        return self.admitted.get(rid) or self.queue.get(rid)

    @property
    def num_free_tokens(self) -> int:
        return max(0, self.cache.num_free_pages() - self._outstanding()) * self.cache.page_size
