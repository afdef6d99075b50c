"""The decode worker: admit as memory allows, receive KV, decode in a continuous batch.

A request's eight steps on this worker:

1. ``req`` arrives from the router (prompt, sampling params, which prefill computes it);
   it is checked and queued (QUEUED).
2. When the pool can hold its whole life (``Admission``), its row is opened and extended
   over the prompt, and the prefill is told through ``KvReceiver.announce`` (WAITING_KV).
3. Pages arrive; the receiver pins them while writes are outstanding.
4. ``COMPLETED`` brings the first token: the prompt is committed, the first token is
   streamed to the router, the request joins the batch (DECODING).
5. Every ``tick`` runs one batched step; new tokens stream to the router.
6. At ``max_new_tokens`` or the stop token the row is freed (``finished``) and ``done``
   is sent.
7. A client abort or a failed transfer frees the row at any stage (``aborted``, or the
   transport's reason: ``timeout``, ``peer_lost``, ``error``); pins keep pages the prefill
   may still write out of reuse.
8. At shutdown everything still held is freed (``aborted``) and the free log is closed.

Conditional disaggregation: a request the router sends without a prefill (``prefill``
empty: this decode's host tier holds most of its prompt) is admitted the same way, then
its cached prefix is committed and the uncached rest computed here by a ``PrefillEngine``
(PREFILLING) instead of steps 2-4; its first token goes to the router as soon as it is
sampled, and it joins the batch.

With offload on, step 2 first loads the prompt's cached prefix from the host tier; a load
that does not end within ``prefix_load_timeout_s`` frees the row (``timeout``; the load's
pins keep its pages safe) and puts the request back at the head of the queue with reuse
off, so it receives its whole prompt in a new row. With overcommit, a running request may
be RETRACTED to the host tier (no device row) and resumed later (DECODING again).

This module only connects transport events and router messages to the
``DecodeScheduler``, which owns every request's state and its one end.
"""

from __future__ import annotations

import logging
import time

from common import trace
from common.control import Done, Load, Req, Tokens, unpack_ids
from common.metrics import watch_host
from common.node import PrefillEngine, WorkerBase
from common.node.tp import kv_config
from common.request import BadRequest, ReqState, Request, SamplingParams
from decode_node.scheduler import DecodeScheduler
from transport import EventKind, GroupReceiver, KvReceiver, transport_readings

logger = logging.getLogger(__name__)


class DecodeWorker(WorkerBase):
    """One decode process (one device)."""

    role = "decode"

    def build(self) -> None:
        cfg, name = self.config, self.name
        self.model, cache, self.runner = self.make_cache(cfg.shared_memory)
        self.scheduler = DecodeScheduler(
            name, cfg, cache, self.runner, self.send, self._stop_receiving,
            device=self.device, log_dir=self.log_dir, who=f"decode {name}",
            instead="receiving", whole_life=not cfg.preempts)
        # A handshake with a new prefill never holds up this loop (begin_connect): its
        # requests wait, rows held, until it answers. One silent for a lease is dead.
        self.receiver = KvReceiver(self.transport_cache(), kv_config(
            cfg, self.role, name, self.runner.fingerprint, *self.tp_rank_size()), ctx=self.ctx,
            auth=self.kv_auth)
        if self.lockstep is not None:  # every rank receives its heads (transport/group.py)
            self.receiver = GroupReceiver(self.receiver, self.lockstep)
        # prompts the router sends without a prefill (conditional disaggregation)
        self.engine = PrefillEngine(self.runner, cfg.chunk_size, cfg.max_prefill_tokens,
                                    with_draft=cfg.with_draft)
        self.groups: dict[str, int] = {}
        watch_host(self.metrics, self.scheduler.offloader)

    def host_offloader(self):
        return self.scheduler.offloader

    # -- control -------------------------------------------------------------------------
    def on_req(self, msg: Req) -> None:
        rid = msg.rid
        try:
            params = SamplingParams.from_dict(msg.params)
            prompt = unpack_ids(msg.prompt, "prompt").tolist()
            if not prompt or self.scheduler.find(rid) is not None:
                raise BadRequest(f"{rid}: empty prompt or rid already in flight")
            if len(prompt) + params.max_new_tokens > (self.cache.num_pages - 1) * \
                    self.cache.page_size:
                raise BadRequest(f"{rid}: needs {len(prompt) + params.max_new_tokens} "
                                 "tokens, more than this decode's pool")
        except (BadRequest, ValueError) as exc:
            self.send(Done(rid, "error", error=str(exc)))
            return
        self.scheduler.enqueue(Request(rid, prompt, params, label=msg.label,
                                       prefill=msg.prefill, prefill_addr=msg.prefill_addr,
                                       cap=msg.cap, num_prior=msg.prior))

    def on_abort(self, rid: str, reason: str = "aborted") -> None:
        req = self.scheduler.find(rid)
        if req is not None:
            self.scheduler.end(req, reason)

    def on_stop(self, rid: str) -> None:
        req = self.scheduler.find(rid)
        if req is not None:
            self.scheduler.stop(req)

    # -- work ----------------------------------------------------------------------------
    def tick(self) -> bool:
        for ev in self.receiver.poll(0):
            self._on_event(ev)
        self.scheduler.reap()
        self.scheduler.resume()  # retracted requests go before new ones
        admitted = self._admit()
        prefilled = self._prefill_here()
        return self.scheduler.step() or admitted or prefilled

    def _admit(self) -> bool:
        """Admit what fits and tell each request's prefill where its KV goes."""
        any_admitted = False
        while (req := self.scheduler.admit_next(commit_prefix=False)) is not None:
            any_admitted = True
            if not req.prefill:  # conditional disaggregation: the rest is computed here
                self._start_prefill_here(req)
                continue
            try:
                group = self._group(req.prefill, req.prefill_addr)
                self.receiver.announce(req.rid, req.kv, req.prompt_len, req.num_computed,
                                       group, cap=req.cap)
            except Exception as exc:  # contained: this request fails, the worker serves on
                logger.error("%s: %s cannot reach prefill %s: %s", self.name, req.rid,
                             req.prefill, exc)
                self.scheduler.end(req, "error", f"decode {self.name} cannot reach prefill "
                                   f"{req.prefill} at {req.prefill_addr!r}: {exc}")
                continue
            self.scheduler.waiting_kv(req)
            trace.mark("decode.announce_out", req.rid)
            logger.info("%s: %s admitted (%d prompt tokens, prefill %s)", self.name,
                        req.rid, req.prompt_len, req.prefill)
        return any_admitted

    def _start_prefill_here(self, req: Request) -> None:
        if req.num_computed:  # the host tier's prefix, loaded at admission
            self.cache.commit(req.kv, req.num_computed)
        self.scheduler.prefilling(req)
        self.engine.add(req)
        logger.info("%s: %s prefills here (%d prompt tokens, %d cached)", self.name, req.rid,
                    req.prompt_len, req.num_computed)

    def _prefill_here(self) -> bool:
        """One pass over the prompts this decode computes itself; True when it ran."""
        if not self.engine.has_work:
            return False
        try:
            _, finished = self.engine.step(on_sampled=self._first_tokens)
        except Exception as exc:  # contained: the pass's requests fail, the worker lives
            logger.exception("%s: a prefill pass failed", self.name)
            for req in list(self.engine.batch):
                self.scheduler.end(req, "error", f"decode {self.name}: a prefill pass "
                                   f"failed ({type(exc).__name__}: {exc}); retry it")
            return True
        for req in finished:
            self.scheduler.start_decoding(req, first_sent=True)
        return True

    def _first_tokens(self, finished: list[Request]) -> None:
        """Sampled first tokens go out at once (the draft's pass is still to come)."""
        for req in finished:
            self.send(Tokens(req.rid, [req.output[0]], first=True))

    def _group(self, prefill: str, addr: str) -> int:
        group = self.groups.get(prefill)
        if group is None or self.receiver.group_lost(group):
            # a tensor-parallel prefill advertises its ranks' addresses, comma-separated
            group = self.groups[prefill] = self.receiver.begin_connect(addr.split(","))
        return group

    def _on_event(self, ev) -> None:
        if ev.kind in (EventKind.PEER_LOST, EventKind.HANDSHAKE_FAILED):
            logger.error("%s: %s %s: %s", self.name, ev.kind.name, ev.peer, ev.detail)
            if ev.kind == EventKind.PEER_LOST:
                self.reclaim_segments()
            return
        req = self.scheduler.find(ev.rid) if ev.rid else None
        if req is None or req.kv is None:
            return
        if ev.kind == EventKind.COMPLETED:
            trace.mark("decode.kv_in", req.rid)
            # the whole prompt arrived: commit it, stream the first token, join the batch
            self.cache.commit(req.kv, req.prompt_len)
            req.num_computed = req.prompt_len
            req.output.append(ev.first_token)
            self.counting.on_transfer("received", ev.kv_pages, ev.kv_bytes, ev.xfer_s,
                                      ev.path)
            self.scheduler.start_decoding(req, t_kv_wall=time.time())
        elif ev.kind.is_final:
            self.scheduler.end(req, ev.reason or "error", ev.detail)

    def _stop_receiving(self, req: Request, reason: str, detail: str) -> None:
        """The scheduler ends a request whose KV is still arriving: stop the transfer
        (the receiver's pins keep pages the prefill may still write out of reuse), or
        the prefill pass of one computed here."""
        if req.state == ReqState.PREFILLING:
            self.engine.remove(req.rid)
        else:
            self.receiver.abort(req.rid, reason, detail)

    # -- reporting and shutdown ----------------------------------------------------------
    def sockets(self) -> list:
        return self.receiver.sockets()

    def kv_endpoint(self):
        return getattr(self, "receiver", None)  # None until built

    def idle_wait_s(self) -> float:
        return min(0.02, self.receiver.poll_within() or 0.02)

    def load(self) -> Load:
        return self.scheduler.load()

    def num_requests(self) -> int:
        admission = self.scheduler.admission
        return len(admission.admitted) + len(admission.queue)

    def stats(self) -> dict:
        rx = self.receiver.stats
        # KV that landed refused (docs/protocol.md, "Page epochs", "Integrity"): each
        # failed its own request; a non-zero count is worth a look at the free log
        return self.scheduler.stats({"bytes_recv": int(rx["bytes_recv"]),
                                     "kv_refused_stale": int(rx["refused.stale"]),
                                     "kv_refused_corrupt": int(rx["refused.corrupt"]),
                                     "tokens_computed": self.engine.num_tokens_computed})

    def metric_readings(self) -> list:
        retraction = self.scheduler.retraction
        retracted = len(retraction.waiting) if retraction is not None else 0
        return [*self.scheduler.metric_readings(),
                *transport_readings(self.receiver, "received"),
                ("pdkv_prefill_computed_tokens_total", {}, self.engine.num_tokens_computed),
                ("pdkv_queue_requests", {"queue": "retracted"}, retracted)]

    def abandon(self, detail: str) -> None:
        self.scheduler.abort_all(detail)

    def shutdown(self) -> None:
        self.scheduler.abort_all()
        self.receiver.close()
        self.scheduler.close()
