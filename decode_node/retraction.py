"""Retraction under device memory pressure (overcommitted admission on a decode worker).

With ``ServeConfig.overcommit`` a decode admits a request on its prompt's pages alone, so
running requests may outgrow the pool. Before each batch step ``relieve`` checks that
every running sequence can grow by its next step (the newest token's slot and up to
``spec_k`` lookahead slots, never past its ``max_len``); while the pool is short it
retracts the youngest running sequence to the host tier (``HostConnector.retract``).
``resume`` brings retracted sequences back oldest first, as soon as a row for their
committed tokens plus one step fits; until then new admissions wait (``admits_new``; no
starvation). Age is arrival order in the batch, kept across retraction: a resumed
sequence is as old as it was, so it is not the next victim.

Who frees what: ``retract`` frees the device row at once (reason ``offloaded``; the pins of
copies in flight protect the pages); a resumed sequence has a new row that the worker
frees as usual; ``discard`` (abort while retracted) drops the host reference only.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

from common.kv import OutOfPages, ceil_div
from common.model import ModelRunner
from decode_node.batch import DecodeBatch, DecodeSeq, finish_ranges
from decode_node.host_connector import HostConnector, Retracted

logger = logging.getLogger(__name__)


class Retractor:
    """The retract-youngest / resume-oldest policy of one decode worker.

    Args:
        conn: the worker's host connector (it offloads and reloads the rows).
        batch: the worker's running batch.
        spec_k: lookahead slots a step may take (0 without speculation).
    """

    def __init__(self, conn: HostConnector, batch: DecodeBatch, spec_k: int) -> None:
        self.conn, self.batch, self.spec_k = conn, batch, spec_k
        self.cache = batch.cache
        self.waiting: OrderedDict[str, Retracted] = OrderedDict()
        """Retracted sequences, oldest first."""
        self._age: dict[str, int] = {}
        self._num_seen = 0

    def admits_new(self) -> bool:
        """New requests may be admitted only while nothing waits to resume."""
        return not self.waiting

    def _update_ages(self) -> None:
        """Number sequences in the order they joined the batch; forget those gone."""
        for rid in self.batch.running:
            if rid not in self._age:
                self._age[rid], self._num_seen = self._num_seen, self._num_seen + 1
        for rid in [r for r in self._age if r not in self.batch.running
                    and r not in self.waiting]:
            del self._age[rid]

    def _step_pages(self, seq: DecodeSeq, max_len: int) -> int:
        """Pages ``seq``'s next step may allocate."""
        ps = self.cache.page_size
        want = min(seq.next_position + self.spec_k + 1, max_len)
        return max(0, ceil_div(want, ps) - ceil_div(seq.kv.allocated_len, ps))

    def pages_short(self, max_len: Callable[[str], int]) -> int:
        """Pages the next step may need beyond the free ones (<= 0: it fits)."""
        need = sum(self._step_pages(s, max_len(s.rid)) for s in self.batch.running.values())
        return need - self.cache.num_free_pages()

    def relieve(self, max_len: Callable[[str], int]) -> list[str]:
        """Retract youngest-first until the next step fits; returns the retracted rids."""
        out = []
        self._update_ages()
        while len(self.batch) and self.pages_short(max_len) > 0:
            rid = max(self.batch.running, key=self._age.__getitem__)
            seq = self.batch.remove(rid)
            self.waiting[rid] = self.conn.retract(seq, finish_ranges(seq.kv,
                                                                     self.cache.page_size))
            out.append(rid)
        if out:
            order = sorted(self.waiting, key=self._age.__getitem__)
            self.waiting = OrderedDict((rid, self.waiting[rid]) for rid in order)
        return out

    def resume(self, runner: ModelRunner, timeout_s: float, max_len: Callable[[str], int]
               ) -> tuple[list[DecodeSeq], dict[str, str]]:
        """Resume retracted sequences, oldest first, while their rows fit.

        Returns:
            (sequences back in new rows: the caller adds them to the batch, {rid: why}
            of those whose reload failed: they hold nothing and the caller fails them).
        """
        out, failed, reserved = [], {}, 0
        ps = self.cache.page_size
        while self.waiting:
            r = next(iter(self.waiting.values()))
            need = ceil_div(r.committed_len + self.spec_k + 1, ps)
            # resumed rows join the batch after this call: keep their next step's pages
            if self.cache.num_free_pages() - self._running_need(max_len) - reserved < need:
                break
            try:
                seq = self.conn.resume(runner, r, timeout_s)
            except OutOfPages:
                break
            except RuntimeError as exc:  # the row was freed (error); nothing held
                logger.error("%s: resume failed: %s", r.rid, exc)
                self.discard(r.rid)
                failed[r.rid] = str(exc)
                continue
            del self.waiting[r.rid]
            reserved += need - ceil_div(seq.kv.allocated_len, ps)
            out.append(seq)
            logger.info("%s resumed from the host tier", r.rid)
        return out, failed

    def _running_need(self, max_len: Callable[[str], int]) -> int:
        return sum(self._step_pages(s, max_len(s.rid)) for s in self.batch.running.values())

    def discard(self, rid: str) -> bool:
        """Abort of a retracted sequence: drop it (no device row). True if it was one."""
        r = self.waiting.pop(rid, None)
        self._age.pop(rid, None)
        if r is not None:
            self.conn.discard(r)
        return r is not None
