"""Draining a worker: no new requests, its own end, then it exits; no request lost.

``pdkv drain WORKER`` (an operator's ``Drain``) or SIGTERM to the worker (it sends
``Drain`` for itself) start it:

1. the router routes nothing new to the worker (``WorkerInfo.draining``);
2. the worker serves on what it holds, for up to ``drain_timeout_s``;
3. what it still holds then moves to other workers (``deploy.router.migration``, cause
   ``drained``): the worker frees it ``migrated``;
4. once it holds nothing, the router tells it to shut down (``Shutdown``): it frees
   everything, closes its free log, sends its final figures and exits 0. The router
   forgets it (a new process may register under its name: a rolling restart).
"""

from __future__ import annotations

import logging
import time

from common.control import Drain, Shutdown
from deploy.router.placement import WorkerInfo
from deploy.router.roles import is_operator
from deploy.router.routes import Route

logger = logging.getLogger(__name__)


class Draining:
    """The router's part that drains workers (mixed into ``Router``)."""

    def _on_drain(self, peer: bytes, msg: Drain) -> None:
        """An operator drains any worker, a worker itself (SIGTERM)."""
        w = self.workers.get(msg.name)
        itself = self.by_peer.get(peer) == msg.name
        if not itself and not is_operator(self.identities.get(peer, "")) and \
                self.identities.get(peer, ""):
            self._forbid(peer, msg, f"only an operator or {msg.name!r} itself may drain it")
            return
        if w is None or w.lost:
            self._refuse(peer, "", "unknown_worker", f"drain: no live worker {msg.name!r}; "
                         f"workers: {sorted(n for n, x in self.workers.items() if not x.lost)}")
            return
        if not w.draining:
            w.draining = time.monotonic()
            logger.warning("router: draining %s (asked by %s): no new requests; what it "
                           "holds after %gs moves elsewhere", w.name, "itself" if itself
                           else "an operator", self.config.drain_timeout_s)
        if not itself:
            self._on_status(peer, msg)   # the operator sees the worker draining

    def _tick_drains(self, now: float) -> None:
        """Each draining worker: moves what it holds past ``drain_timeout_s``; shut it
        down once it holds nothing."""
        for w in list(self.workers.values()):
            if not w.draining or w.lost:
                continue
            held = [r for r in self.routes if _holds(w, r)]
            if held and now - w.draining > self.config.drain_timeout_s:
                for route in held:
                    self._move(route, "drained", f"worker {w.name} drained")
                held = [r for r in self.routes if _holds(w, r)]
            if not held:
                self._drained(w)

    def _drained(self, w: WorkerInfo) -> None:
        w.lost = True   # gone for routing; a new process may take its name
        self.hub.send(w.peer, Shutdown())
        self.metrics.lost(w.name, w.role)
        logger.warning("router: %s drained (holds no request): told to shut down", w.name)


def _holds(w: WorkerInfo, route: Route) -> bool:
    """``w`` still holds something of ``route`` (a decode its row, a prefill its part)."""
    if route.decode_done is not None:
        return False
    return w.name == route.decode or (w.name == route.prefill and route.prefill_info is None)

