"""The prefill worker: chunked prefill of many requests, KV streamed to their decodes.

A request's steps on this worker:

1. ``req`` arrives from the router (prompt, params, which decode serves it); the decode
   announces the same rid over the KV transport once it has preallocated the row (READY).
   Both may arrive in either order (QUEUED until both are in).
2. When this pool has room for the prompt, the row is opened and extended (PREFILLING).
3. Each engine step computes a chunk; ``KvSender.send`` pins and streams the full pages.
4. The last chunk's pass samples the first token from the target's logits and it goes to
   the router at once (the client's first token), before the draft model's pass; after
   that pass ``finish`` sends the tail page and the first token to the decode
   (TRANSFERRING).
5. ``COMPLETED`` (the decode acknowledged everything): the row is freed with ``sent`` and
   ``prefilled`` goes to the router with the transfer's timings.
6. An abort (client via router, or the decode via the transport) or a failure frees the
   row with its reason at any stage; the sender's pins keep pages in flight out of reuse.

A prefix load from the host tier that does not end within ``prefix_load_timeout_s``
costs only the cached prefix, never the worker (``common.host.PrefixReuse``): the row
is freed (``timeout``), the request stays QUEUED with reuse off and is prefilled from
position 0 in a new row. Any other exception while admitting one request fails that
request alone (FAILED, ``error``, reported to the router).

``_move`` is the only writer of a request's state on this worker; ``_free_request`` is
its one end (the row freed once, with the reason, and ``Prefilled`` to the router).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict, deque

from common import trace
from common.auth import Keys
from common.control import ControlLink, Load, Prefilled, Req, StepTokens, unpack_ids
from common.kv import FreeReason, ceil_div
from common.metrics import abort_readings, host_readings, watch_host
from common.node import (
    EventsSpec,
    PrefillEngine,
    PrefixReuse,
    WorkerBase,
    close_offloader,
    host_salt,
    make_offloader,
)
from common.node.tp import TpSpec, kv_config
from common.request import BadRequest, ReqState, Request, SamplingParams, check_transition
from prefill_node.busy import BusyTime
from transport import EventKind, GroupSender, KvSender, transport_readings

logger = logging.getLogger(__name__)
_FORGET = 4096  # aborted-before-announce rids remembered


class PrefillWorker(WorkerBase):
    """One prefill process (one device), bound at ``kv_bind`` for decode peers.

    Args:
        kv_bind: address the KV sender binds (``tcp://0.0.0.0:5600``, ``ipc://...``).
        kv_advertise: address decodes should connect to (default: the bound one).
    """

    role = "prefill"

    def __init__(self, name: str, router: str | ControlLink, kv_bind: str,
                 kv_advertise: str = "", device: str = "cpu", log_dir: str | None = None,
                 register_timeout_s: float = 60.0, *,
                 local_models: dict[str, str] | None = None, keys: Keys | None = None,
                 identity: str = "worker", tp: TpSpec | None = None,
                 events: EventsSpec | None = None) -> None:
        super().__init__(name, router, device, log_dir, register_timeout_s,
                         local_models=local_models, keys=keys, identity=identity, tp=tp,
                         events=events)
        self.kv_bind, self.kv_advertise = kv_bind, kv_advertise
        self.reqs: OrderedDict[str, Request] = OrderedDict()
        self.early_ready: set[str] = set()
        self.dropped: deque[str] = deque(maxlen=_FORGET)
        self.busy = BusyTime()
        """Time some transfer was streaming (the union of each request's send window)."""
        self.counts = {"sent": 0, "aborted": 0, "failed": 0, "migrated": 0,
                       "prompt_tokens": 0}
        self.aborted_in: Counter[str] = Counter()
        """Aborted requests by the stage (``ReqState``, lower case) they were in."""

    def build(self) -> None:
        cfg, name = self.config, self.name
        self.model, cache, self.runner = self.make_cache()
        self.engine = PrefillEngine(self.runner, cfg.chunk_size, cfg.max_prefill_tokens,
                                    with_draft=cfg.with_draft)
        self.offloader = make_offloader(cfg, cache, self.device, self.log_dir, name)
        self.prefix_reuse = PrefixReuse(self.offloader, host_salt(cfg, cache),
                                        cfg.prefix_load_timeout_s) if self.offloader else None
        self.sender = KvSender(self.transport_cache(), self.kv_bind, kv_config(
            cfg, self.role, name, self.runner.fingerprint, *self.tp_rank_size()), ctx=self.ctx,
            auth=self.kv_auth)
        if self.lockstep is not None:  # every rank sends its heads (transport/group.py)
            self.sender = GroupSender(self.sender, self.lockstep,
                                      self.kv_advertise or self.sender.address)
        watch_host(self.metrics, self.offloader)

    def host_offloader(self):
        return self.offloader

    def kv_address(self) -> str:
        """Where decodes connect; a tensor-parallel group's ranks, comma-separated in
        rank order (each decode rank connects to all, streams from those with its heads)."""
        if self.lockstep is not None:
            return ",".join(self.sender.rank_addresses)
        return self.kv_advertise or self.sender.address

    # -- control -------------------------------------------------------------------------
    def on_req(self, msg: Req) -> None:
        rid = msg.rid
        if rid in self.reqs:
            # the one in flight keeps its row and its transfer; this one is refused alone
            raise BadRequest(f"rid {rid!r} is already in flight on this prefill")
        req = Request(rid, unpack_ids(msg.prompt).tolist(), SamplingParams.from_dict(msg.params),
                      label=msg.label, eager=msg.eager, announced=rid in self.early_ready,
                      num_prior=msg.prior)
        self.early_ready.discard(rid)
        self.reqs[rid] = req
        # KV only to the decode the router assigned: it alone holds this capability
        self.sender.expect(rid, msg.cap)

    def on_abort(self, rid: str, reason: str = "aborted") -> None:
        why = "moved to another worker" if reason == "migrated" else "client abort"
        req = self.reqs.get(rid)
        if req is None:
            self.dropped.append(rid)
            if rid in self.early_ready:
                self.early_ready.discard(rid)
                self.sender.abort(rid, reason, detail=why)
            return
        # an eager transfer exists before the announcement; abort is a no-op when unknown
        self.sender.abort(rid, reason, detail=why)
        self._free_request(req, reason)

    def idle_wait_s(self) -> float:
        return min(0.02, self.sender.poll_within() or 0.02)

    # -- work ----------------------------------------------------------------------------
    def tick(self) -> bool:
        for ev in self.sender.poll(0):
            self._on_event(ev)
        if self.prefix_reuse is not None:
            self.prefix_reuse.poll()
        admitted = self._admit()
        if not self.engine.has_work:
            return admitted
        try:
            advanced, finished = self.engine.step(on_sampled=self._first_tokens)
        except Exception as exc:  # contained: the pass's requests fail, the worker lives
            logger.exception("%s: a prefill pass failed", self.name)
            for req in self.engine.batch:
                self.sender.abort(req.rid, "error", f"prefill failed: {exc}")
                self._free_request(req, "error", f"prefill {self.name}: a prefill pass "
                                   f"failed ({type(exc).__name__}: {exc}); retry it")
            return True
        now = time.monotonic()
        for req in advanced:
            req.t_first_send = req.t_first_send or now
            if not req.output:
                self.sender.send(req.rid, req.kv, req.num_computed)
        for req in finished:
            req.t_prefilled = now
            trace.mark("prefill.computed", req.rid)
            self._move(req, ReqState.TRANSFERRING)
            self.sender.finish(req.rid, req.kv, req.output[0])
            trace.mark("prefill.finish_out", req.rid)
        return True

    def _first_tokens(self, finished: list[Request]) -> None:
        """The engine sampled these first tokens (the draft's pass is still to come):
        they go to the router now, so the client's TTFT waits neither for the draft's
        KV nor for the transfer nor for the decode (which sends the token again with the
        KV; the router relays whichever comes first)."""
        for req in finished:
            trace.mark("prefill.sampled", req.rid)
        self.send(StepTokens.of([(r.rid, [r.output[0]], True) for r in finished]))

    def _admit(self) -> bool:
        """Open rows for announced requests, in arrival order, while the pool has room."""
        any_admitted = False
        for req in list(self.reqs.values()):
            if req.state != ReqState.QUEUED or not (req.announced or req.eager):
                continue
            need = ceil_div(req.prompt_len, self.cache.page_size)
            if self.cache.num_free_pages() < need or len(self.engine.tasks) >= \
                    self.config.max_rows - 1:
                break
            try:
                any_admitted |= self._admit_one(req)
            except Exception as exc:  # contained: this request fails, the worker serves on
                logger.exception("%s: %s failed at admission", self.name, req.rid)
                self.sender.abort(req.rid, "error", f"prefill failed: {exc}")
                self._free_request(req, "error", f"prefill {self.name} failed to start this "
                                   f"request ({type(exc).__name__}: {exc}); retry it")
        return any_admitted

    def _admit_one(self, req: Request) -> bool:
        """Open the row, load the cached prefix, hand the rest to the engine; False when
        the prefix load timed out (the row is freed, the request stays QUEUED)."""
        req.kv = self.cache.open_row(req.rid)
        self.cache.extend(req.kv, req.prompt_len)
        if self.prefix_reuse is not None and self.prefix_reuse.load_request(req) is None:
            return False
        self._move(req, ReqState.PREFILLING)
        self.engine.add(req)
        trace.mark("prefill.start", req.rid)
        logger.info("%s: %s prefilling (%d tokens, %d cached)", self.name, req.rid,
                    req.prompt_len, req.num_computed)
        return True

    def _on_event(self, ev) -> None:
        if ev.kind == EventKind.READY:
            self._on_ready(ev.rid)
            return
        req = self.reqs.get(ev.rid)
        if ev.kind == EventKind.COMPLETED and req is not None:
            req.num_sent_pages = ceil_div(ev.prompt_len, self.cache.page_size) - \
                ev.cached_tokens // self.cache.page_size
            self.counting.on_transfer("sent", req.num_sent_pages,
                                      self._kv_bytes(req.num_sent_pages),
                                      time.monotonic() - req.t_prefilled, ev.path)
            self._free_request(req, "sent")
        elif ev.kind.is_final and req is not None:
            self._free_request(req, ev.reason or "error", ev.detail)
        elif ev.kind in (EventKind.PEER_LOST, EventKind.HANDSHAKE_FAILED):
            logger.error("%s: %s %s: %s", self.name, ev.kind.name, ev.peer, ev.detail)
            if ev.kind == EventKind.PEER_LOST:   # a decode's pool it may have left behind
                self.reclaim_segments()

    def _on_ready(self, rid: str) -> None:
        req = self.reqs.get(rid)
        trace.mark("prefill.announce_in", rid)
        if req is not None:
            req.announced = True
        elif rid in self.dropped:
            self.sender.abort(rid, detail="client abort")
        else:
            self.early_ready.add(rid)

    # -- the one writer of states, the one end ---------------------------------------------
    def _move(self, req: Request, state: ReqState) -> None:
        check_transition(req.state, state)
        req.state = state

    def _free_request(self, req: Request, reason: str, detail: str = "") -> None:
        """End ``req``: free its row once (``sent`` after a complete transfer, after
        offering the prompt to the host tier), report ``Prefilled`` to the router."""
        logger.info("%s: %s %s in %s%s", self.name, req.rid, reason, req.state.name,
                    f" ({detail})" if detail else "")
        self.reqs.pop(req.rid, None)
        self.dropped.append(req.rid)
        self.engine.remove(req.rid)
        if req.kv is not None:
            if reason == "sent" and self.prefix_reuse is not None:
                self._offload_sent(req)  # pins what it copies: the free follows at once
            self.cache.free_kv_row(req.kv, [(0, req.kv.allocated_len)],
                                   reason=FreeReason.of_end(reason))
            self.cache.close_row(req.kv)
            req.kv = None
        now = time.monotonic()
        if reason == "sent":
            self._move(req, ReqState.FINISHED)
            self.counts["sent"] += 1
            self.counts["prompt_tokens"] += req.prompt_len
            oldest = min((r.t_first_send for r in self.reqs.values() if r.t_first_send),
                         default=now)
            self.busy.add(req.t_first_send, now, horizon=oldest)
            # t_finish_wall lets the router measure last chunk -> first token at the decode
            # (same host or synchronised clocks); xfer_s (-> acknowledgement) is the fallback
            self.send(Prefilled(req.rid, reason, error=detail, xfer_s=now - req.t_prefilled,
                                kv_bytes=self._kv_bytes(req.num_sent_pages),
                                t_finish_wall=time.time() - (now - req.t_prefilled),
                                cached_tokens=req.num_cached))
            return
        aborted = reason == "aborted"
        if aborted:
            self.aborted_in[req.state.name.lower()] += 1
        self._move(req, ReqState.ABORTED if aborted else ReqState.FAILED)
        self.counts[reason if reason in ("aborted", "migrated") else "failed"] += 1
        self.send(Prefilled(req.rid, reason, error=detail))

    def _kv_bytes(self, num_pages: int) -> int:
        """Bytes of ``num_pages`` pages (target and draft layers), as the transfer moves
        them; a prefix the decode loaded from its host tier is not counted."""
        return num_pages * self.cache.layout.page_bytes(self.cache.page_size)

    def _offload_sent(self, req: Request) -> None:
        """Offer the sent prompt to the host tier; a failure costs the cache entry only."""
        try:
            self.prefix_reuse.offload_sent(req.kv, req.prompt)
        except Exception:  # the row is freed by the caller either way
            logger.exception("%s: %s: offload to the host tier failed", self.name, req.rid)

    # -- reporting and shutdown ----------------------------------------------------------
    def sockets(self) -> list:
        return self.sender.sockets()

    def kv_endpoint(self):
        return getattr(self, "sender", None)  # None until built

    def load(self) -> Load:
        queued = sum(r.prompt_len for r in self.reqs.values() if r.state == ReqState.QUEUED)
        return Load(self.name, running=len(self.engine.tasks), queued=len(self.reqs),
                    free_tokens=self.cache.num_free_pages() * self.cache.page_size,
                    queued_tokens=queued)

    def num_requests(self) -> int:
        return len(self.reqs)

    def stats(self) -> dict:
        reuse = self.prefix_reuse
        return {**self.counts, "bytes_sent": int(self.sender.stats["bytes_sent"]),
                "stream_busy_s": self.busy.seconds,
                "tokens_computed": self.engine.num_tokens_computed,
                # KV plane refusals (docs/security.md): announces without the request's
                # capability, protocol errors of peers, connections with bad credentials
                "refused_announces": int(self.sender.stats["refused.announce"]),
                "kv_errors": int(self.sender.stats["errors"]),
                # runs this worker could not post (each failed its request alone)
                "kv_post_failed": int(self.sender.stats["post_failed"]),
                "kv_unauthenticated": self.sender.link.router.refused,
                **({} if reuse is None else {
                    "prefix_hit_pages": reuse.num_hit_pages,
                    "prefix_load_timeouts": reuse.num_timeouts,
                    "offloaded_pages": self.offloader.num_offloaded_pages})}

    def metric_readings(self) -> list:
        page_bytes = self.cache.layout.page_bytes(self.cache.page_size)
        out = [*transport_readings(self.sender, "sent"), *abort_readings(self.aborted_in),
               *host_readings(self.offloader, page_bytes),
               ("pdkv_prefill_computed_tokens_total", {}, self.engine.num_tokens_computed)]
        if self.prefix_reuse is not None:
            out.append(("pdkv_prefix_hit_pages_total", {}, self.prefix_reuse.num_hit_pages))
        return out

    def abandon(self, detail: str) -> None:
        for req in list(self.reqs.values()):
            self.sender.abort(req.rid, detail=detail)
            self._free_request(req, "aborted", detail)
        self.early_ready.clear()

    def shutdown(self) -> None:
        self.abandon("worker shutting down")
        self.sender.close()
        close_offloader(self.offloader, self.config.lease_s)
        self.cache.check_integrity()
        self.cache.close()
