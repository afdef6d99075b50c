"""Retraction under device memory pressure (overcommitted admission on a decode worker).

With ``ServeConfig.overcommit`` a decode admits a request on its prompt's pages alone, so
running requests may outgrow the pool. Before each batch step ``relieve`` checks that
every running request can grow by its next step (the newest token's slot and up to
``spec_k`` lookahead slots, never past its ``max_len``); while the pool is short it
retracts the youngest running request to the host tier (``HostConnector.retract``).
``resume`` brings retracted requests back oldest first, as soon as a row for their
committed tokens plus one step fits; until then new admissions wait (``admits_new``; no
starvation). Age (``Request.age``) is the order in which requests joined the batch, kept
across retraction: a resumed request is as old as it was, so it is not the next victim.

Who frees what: ``retract`` frees the device row at once (reason ``offloaded``; the pins of
copies in flight protect the pages); a resumed request has a new row that the scheduler
frees as usual; ``discard`` (abort while retracted) drops the host reference only.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from common.kv import OutOfPages, ceil_div
from common.model import ModelRunner
from common.request import Request
from decode_node.batch import DecodeBatch, finish_ranges
from decode_node.host_connector import HostConnector

logger = logging.getLogger(__name__)


class Retractor:
    """The retract-youngest / resume-oldest policy of one decode worker.

    Args:
        host_connector: the worker's host connector (it offloads and reloads rows).
        batch: the worker's running batch.
        spec_k: lookahead slots a step may take (0 without speculation).
    """

    def __init__(self, host_connector: HostConnector, batch: DecodeBatch, spec_k: int) -> None:
        self.host_connector, self.batch, self.spec_k = host_connector, batch, spec_k
        self.cache = batch.cache
        self.waiting: OrderedDict[str, Request] = OrderedDict()
        """Retracted requests, oldest first."""
        self._num_seen = 0

    def admits_new(self) -> bool:
        """New requests may be admitted only while nothing waits to resume."""
        return not self.waiting

    def _update_ages(self) -> None:
        """Number requests in the order they joined the batch."""
        for req in self.batch.running.values():
            if req.age < 0:
                req.age, self._num_seen = self._num_seen, self._num_seen + 1

    def _step_pages(self, req: Request) -> int:
        """Pages ``req``'s next step may allocate."""
        ps = self.cache.page_size
        want = min(req.next_position + self.spec_k + 1, req.max_len)
        return max(0, ceil_div(want, ps) - ceil_div(req.kv.allocated_len, ps))

    def pages_short(self) -> int:
        """Pages the next step may need beyond the free ones (<= 0: it fits)."""
        return self.running_need() - self.cache.num_free_pages()

    def relieve(self) -> list[Request]:
        """Retract youngest-first until the next step fits; returns the retracted ones."""
        out = []
        self._update_ages()
        while len(self.batch) and self.pages_short() > 0:
            req = self.batch.remove(max(self.batch.running.values(),
                                        key=lambda r: r.age).rid)
            self.host_connector.retract(req, finish_ranges(req.kv, self.cache.page_size))
            self.waiting[req.rid] = req
            out.append(req)
        if out:
            order = sorted(self.waiting.values(), key=lambda r: r.age)
            self.waiting = OrderedDict((r.rid, r) for r in order)
        return out

    def resume(self, runner: ModelRunner, timeout_s: float
               ) -> tuple[list[Request], dict[str, str]]:
        """Resume retracted requests, oldest first, while their rows fit.

        Returns:
            (requests back in new rows: the caller adds them to the batch, {rid: why}
            of those whose reload failed: they hold nothing and the caller fails them).
        """
        out, failed, reserved = [], {}, 0
        ps = self.cache.page_size
        while self.waiting:
            r = next(iter(self.waiting.values()))
            need = ceil_div(len(r.committed_tokens) + self.spec_k + 1, ps)
            # resumed rows join the batch after this call: keep their next step's pages
            if self.cache.num_free_pages() - self.running_need() - reserved < need:
                break
            try:
                self.host_connector.resume(runner, r, timeout_s)
            except OutOfPages:
                break
            except RuntimeError as exc:  # the row was freed (error); nothing held
                logger.error("%s: resume failed: %s", r.rid, exc)
                self.discard(r)
                failed[r.rid] = str(exc)
                continue
            del self.waiting[r.rid]
            reserved += need - ceil_div(r.kv.allocated_len, ps)
            out.append(r)
            logger.info("%s resumed from the host tier", r.rid)
        return out, failed

    def running_need(self) -> int:
        """Pages the running requests' next step may allocate (admission leaves them)."""
        return sum(self._step_pages(r) for r in self.batch.running.values())

    def discard(self, req: Request) -> bool:
        """A retracted request that will not resume (abort): drop it and its host
        reference (it has no device row). True if it was waiting."""
        if self.waiting.pop(req.rid, None) is None:
            return False
        self.host_connector.discard(req)
        return True
