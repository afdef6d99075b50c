"""The prefill worker: chunked prefill of many requests, KV streamed to their decodes.

A request's steps on this worker:

1. ``req`` arrives from the router (prompt, params, which decode serves it); the decode
   announces the same rid over the KV transport once it has preallocated the row (READY).
   Both may arrive in either order (QUEUED until both are in).
2. When this pool has room for the prompt, the row is opened and extended (PREFILLING).
3. Each engine step computes a chunk; ``KvSender.send`` pins and streams the full pages.
4. After the last chunk ``finish`` sends the tail page and the first token (TRANSFERRING).
5. ``COMPLETED`` (the decode acknowledged everything): the row is freed with ``sent`` and
   ``prefilled`` goes to the router with the transfer's timings.
6. An abort (client via router, or the decode via the transport) or a failure frees the
   row with its reason at any stage; the sender's pins keep pages in flight out of reuse.

A prefix load from the host tier that does not end within ``prefix_load_timeout_s``
costs only the cached prefix, never the worker: the row is freed (``timeout``; the load's
pins keep its pages out of reuse until the copy ends), the request goes back to QUEUED
with reuse off and is prefilled from position 0 in a new row. Any other exception while
admitting one request fails that request alone (``error``, reported to the router).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

from common.codec import unpack_ids
from common.host import close_offloader, host_salt, make_offloader
from common.kv import ceil_div
from common.metrics import host_readings, watch_host
from common.node import Load, Prefilled, Req, WorkerBase
from common.request import ReqState, SamplingParams
from prefill_node.engine import PrefillEngine, PrefillTask
from prefill_node.prefix_reuse import PrefixReuse
from transport import EventKind, KvSender, TransportConfig, transport_readings

logger = logging.getLogger(__name__)
_FORGET = 4096  # aborted-before-announce rids remembered


@dataclass
class PrefillReq:
    """A request on this worker; ``task`` is set once its row is open."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    state: ReqState = ReqState.QUEUED
    task: PrefillTask | None = None
    announced: bool = False
    eager: bool = False
    """Compute before the decode announced (the router saw room at the decode)."""
    reuse: bool = True
    """Load a cached prefix from the host tier (off after a prefix load timed out)."""
    t_first_send: float = 0.0
    t_finish: float = 0.0
    num_sent_pages: int = 0
    """Pages the transfer carried (the prompt's, less those the decode had cached)."""


class PrefillWorker(WorkerBase):
    """One prefill process (one device), bound at ``kv_bind`` for decode peers.

    Args:
        kv_bind: address the KV sender binds (``tcp://0.0.0.0:5600``, ``ipc://...``).
        kv_advertise: address decodes should connect to (default: the bound one).
    """

    role = "prefill"

    def __init__(self, name: str, router: str, kv_bind: str, kv_advertise: str = "",
                 device: str = "cpu", log_dir: str | None = None,
                 local_models: dict[str, str] | None = None) -> None:
        super().__init__(name, router, device, log_dir, local_models=local_models)
        cfg = self.config
        self.model, cache, self.runner = self.make_cache(cfg.prefill_pages)
        self.engine = PrefillEngine(self.runner, cfg.chunk_size, cfg.max_prefill_tokens,
                                    with_draft=cfg.with_draft)
        self.off = make_offloader(cfg, cache, device, log_dir, name)
        self.reuse = PrefixReuse(self.off, host_salt(cfg, cache)) if self.off else None
        self.sender = KvSender(cache, kv_bind, TransportConfig(
            node=name, model=cfg.model, model_digest=self.runner.fingerprint,
            heartbeat_s=cfg.heartbeat_s, lease_s=cfg.lease_s,
            shared_memory=cfg.shared_memory), ctx=self.ctx)
        self.reqs: OrderedDict[str, PrefillReq] = OrderedDict()
        self.early_ready: set[str] = set()
        self.dropped: deque[str] = deque(maxlen=_FORGET)
        self.windows: list[tuple[float, float]] = []
        self.counts = {"sent": 0, "aborted": 0, "failed": 0, "prompt_tokens": 0,
                       "prefix_load_timeouts": 0}
        watch_host(self.metrics, self.off)
        self.report_ready(kv_advertise or self.sender.address)

    # -- control -------------------------------------------------------------------------
    def on_req(self, msg: Req) -> None:
        rid = msg.rid
        req = PrefillReq(rid, unpack_ids(msg.prompt).tolist(),
                         SamplingParams.from_dict(msg.params))
        req.announced = rid in self.early_ready
        req.eager = msg.eager
        self.early_ready.discard(rid)
        self.reqs[rid] = req

    def on_abort(self, rid: str) -> None:
        req = self.reqs.get(rid)
        if req is None:
            self.dropped.append(rid)
            if rid in self.early_ready:
                self.early_ready.discard(rid)
                self.sender.abort(rid, detail="client abort")
            return
        # an eager transfer exists before the announcement; abort is a no-op when unknown
        self.sender.abort(rid, detail="client abort")
        self._end(req, "aborted")

    # -- work ----------------------------------------------------------------------------
    def tick(self) -> bool:
        for ev in self.sender.poll(0):
            self._on_event(ev)
        if self.reuse is not None:
            self.reuse.poll()
        admitted = self._admit()
        if not self.engine.has_work:
            return admitted
        advanced, finished = self.engine.step()
        now = time.monotonic()
        for task in advanced:
            req = self.reqs[task.rid]
            req.t_first_send = req.t_first_send or now
            if task.first_token is None:
                self.sender.send(task.rid, task.kv, task.done)
        for task in finished:
            req = self.reqs[task.rid]
            req.state, req.t_finish = ReqState.TRANSFERRING, now
            self.sender.finish(task.rid, task.kv, task.first_token)
        return True

    def _admit(self) -> bool:
        """Open rows for announced requests, in arrival order, while the pool has room."""
        any_admitted = False
        for req in list(self.reqs.values()):
            if req.state != ReqState.QUEUED or not (req.announced or req.eager):
                continue
            need = ceil_div(len(req.prompt), self.cache.page_size)
            if self.cache.num_free_pages() < need or len(self.engine.tasks) >= \
                    self.config.max_rows - 1:
                break
            try:
                any_admitted |= self._admit_one(req)
            except Exception as exc:  # contained: this request fails, the worker serves on
                logger.exception("%s: %s failed at admission", self.name, req.rid)
                self.sender.abort(req.rid, "error", f"prefill failed: {exc}")
                self._end(req, "error", f"prefill {self.name} failed to start this request "
                          f"({type(exc).__name__}: {exc}); retry it")
        return any_admitted

    def _admit_one(self, req: PrefillReq) -> bool:
        """Open the row, load the cached prefix, hand the rest to the engine; False when
        the prefix load timed out (the row is freed, the request queued again)."""
        kv = self.cache.open_row(req.rid)
        req.task = PrefillTask(req.rid, req.prompt, req.params, kv)
        self.cache.extend(kv, len(req.prompt))
        start = self.load_cached_prefix(req, kv)
        if start is None:
            return False
        req.task.done = start
        req.state = ReqState.PREFILLING
        self.engine.add(req.task)
        logger.info("%s: %s prefilling (%d tokens, %d cached)", self.name, req.rid,
                    len(req.prompt), start)
        return True

    def load_cached_prefix(self, req: PrefillReq, kv) -> int | None:
        """Load KV of the prompt's cached prefix (target and draft layers) from the host
        tier into ``kv``, committing it, and return its length (0 on a miss or a failed
        copy); the engine computes only the rest.

        Returns None when the load did not end within ``prefix_load_timeout_s``: the row
        is freed (``timeout``; the load's pins keep its pages safe) and the request stays
        QUEUED with reuse off, so the next admission computes the whole prompt.
        """
        if self.reuse is None or not req.reuse:
            return 0
        try:
            return self.reuse.load(kv, req.prompt, self.config.prefix_load_timeout_s)
        except TimeoutError as exc:
            logger.warning("%s: %s: %s; computing the whole prompt instead", self.name,
                           req.rid, exc)
            self.counts["prefix_load_timeouts"] += 1
            self.cache.free_kv_row(kv, [(0, kv.allocated_len)], reason="timeout")
            self.cache.close_row(kv)
            req.task, req.reuse = None, False
            return None

    def _on_event(self, ev) -> None:
        if ev.kind == EventKind.READY:
            self._on_ready(ev.rid)
            return
        req = self.reqs.get(ev.rid)
        if ev.kind == EventKind.COMPLETED and req is not None:
            req.num_sent_pages = ceil_div(ev.prompt_len, self.cache.page_size) - \
                ev.cached_tokens // self.cache.page_size
            self._end(req, "sent")
        elif ev.kind.is_final and req is not None:
            self._end(req, ev.reason or "error", ev.detail)
        elif ev.kind in (EventKind.PEER_LOST, EventKind.HANDSHAKE_FAILED):
            logger.error("%s: %s %s: %s", self.name, ev.kind.name, ev.peer, ev.detail)

    def _on_ready(self, rid: str) -> None:
        req = self.reqs.get(rid)
        if req is not None:
            req.announced = True
        elif rid in self.dropped:
            self.sender.abort(rid, detail="client abort")
        else:
            self.early_ready.add(rid)

    def _end(self, req: PrefillReq, reason: str, detail: str = "") -> None:
        """Free the row (``sent`` after a complete transfer), report to the router."""
        logger.info("%s: %s %s in %s%s", self.name, req.rid, reason, req.state.name,
                    f" ({detail})" if detail else "")
        now = time.monotonic()
        self.reqs.pop(req.rid, None)
        self.dropped.append(req.rid)
        self.engine.remove(req.rid)
        if req.task is not None:
            kv = req.task.kv
            if reason == "sent" and self.reuse is not None:
                self._offload_sent(req)  # pins what it copies: free follows
            self.cache.free_kv_row(kv, [(0, kv.allocated_len)], reason=_free_reason(reason))
            self.cache.close_row(kv)
        kind = "sent" if reason == "sent" else ("aborted" if reason == "aborted" else "failed")
        self.counts[kind] += 1
        msg = Prefilled(req.rid, reason, error=detail)
        if reason == "sent":
            self.counts["prompt_tokens"] += len(req.prompt)
            self.windows.append((req.t_first_send, now))
            # t_finish_wall lets the router measure last chunk -> first token at the decode
            # (same host or synchronised clocks); xfer_s (-> acknowledgement) is the fallback
            msg = Prefilled(req.rid, reason, error=detail, xfer_s=now - req.t_finish,
                            kv_bytes=self._kv_bytes(req.num_sent_pages),
                            t_finish_wall=time.time() - (now - req.t_finish))
        req.state = ReqState.FINISHED if reason == "sent" else ReqState.ABORTED
        self.send(msg)

    def _kv_bytes(self, num_pages: int) -> int:
        """Bytes of ``num_pages`` pages (target and draft layers), as the transfer moves
        them; a prefix the decode loaded from its host tier is not counted."""
        return num_pages * self.cache.layout.page_bytes(self.cache.page_size)

    def _offload_sent(self, req: PrefillReq) -> None:
        """Offer the sent prompt to the host tier; a failure costs the cache entry only."""
        try:
            self.reuse.offload_sent(req.task.kv, req.prompt)
        except Exception:  # the row is freed by the caller either way
            logger.exception("%s: %s: offload to the host tier failed", self.name, req.rid)

    # -- reporting and shutdown ----------------------------------------------------------
    def sockets(self) -> list:
        return self.sender.sockets()

    def load(self) -> Load:
        queued = sum(len(r.prompt) for r in self.reqs.values() if r.state == ReqState.QUEUED)
        return Load(self.name, running=len(self.engine.tasks), queued=len(self.reqs),
                    free_tokens=self.cache.num_free_pages() * self.cache.page_size,
                    queued_tokens=queued)

    def stats(self) -> dict:
        return {**self.counts, "bytes_sent": int(self.sender.stats["bytes_sent"]),
                "stream_busy_s": _union_length(self.windows),
                "tokens_computed": self.engine.num_tokens_computed,
                **({} if self.reuse is None else {
                    "prefix_hit_pages": self.reuse.num_hit_pages,
                    "offloaded_pages": self.off.num_offloaded_pages})}

    def metric_readings(self) -> list:
        page_bytes = self.cache.layout.page_bytes(self.cache.page_size)
        out = [*transport_readings(self.sender, "sent"), *host_readings(self.off, page_bytes)]
        if self.reuse is not None:
            out.append(("pdkv_prefix_hit_pages_total", {}, self.reuse.num_hit_pages))
        return out

    def close(self) -> None:
        for req in list(self.reqs.values()):
            self.sender.abort(req.rid, detail="worker shutting down")
            self._end(req, "aborted", "worker shutting down")
        self.sender.close()
        close_offloader(self.off, self.config.lease_s)
        self.cache.check_integrity()
        self.cache.close()
        super().close()


def _free_reason(reason: str) -> str:
    allowed = {"sent", "aborted", "timeout", "peer_lost", "error"}
    return reason if reason in allowed else "error"


def _union_length(windows: list[tuple[float, float]]) -> float:
    """Total time covered by the union of ``[start, end)`` windows."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(windows):
        if e > end:
            total += e - max(s, end)
            end = e
    return total
