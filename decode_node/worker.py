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

With offload on, step 2 first loads the prompt's cached prefix from the host tier; a load
that does not end within ``prefix_load_timeout_s`` frees the row (``timeout``; the load's
pins keep its pages safe) and puts the request back at the head of the queue with reuse
off, so it receives its whole prompt in a new row. With overcommit, a running request may
be RETRACTED to the host tier (no device row) and resumed later (DECODING again).
"""

from __future__ import annotations

import logging
import time

from common.codec import unpack_ids
from common.metrics import watch_host
from common.node import Done, Load, Req, WorkerBase
from common.request import BadRequest, ReqState, SamplingParams
from decode_node.admission import WorkItem
from decode_node.batch import DecodeSeq
from decode_node.retraction import Retractor
from decode_node.scheduler import DecodeSide, side_readings
from transport import EventKind, KvReceiver, TransportConfig, transport_readings

logger = logging.getLogger(__name__)


class DecodeWorker(WorkerBase):
    """One decode process (one device)."""

    role = "decode"

    def __init__(self, name: str, router: str, device: str = "cpu",
                 log_dir: str | None = None, local_models: dict[str, str] | None = None
                 ) -> None:
        super().__init__(name, router, device, log_dir, local_models=local_models)
        cfg = self.config
        self.model, cache, self.runner = self.make_cache(cfg.decode_pages, cfg.shared_memory)
        self.side = DecodeSide(name, cfg, cache, self.runner, self.send, device=device,
                               log_dir=log_dir, log=logger, who=f"decode {name}",
                               instead="receiving", whole_life=not cfg.overcommit)
        self.retractor = Retractor(self.side.conn, self.side.batch, cfg.spec_k) \
            if cfg.overcommit else None
        self.rx = KvReceiver(cache, TransportConfig(
            node=name, model=cfg.model, model_digest=self.runner.fingerprint,
            heartbeat_s=cfg.heartbeat_s, lease_s=cfg.lease_s,
            shared_memory=cfg.shared_memory), ctx=self.ctx)
        self.groups: dict[str, int] = {}
        watch_host(self.metrics, self.side.off)
        self.report_ready()

    # -- control -------------------------------------------------------------------------
    def on_req(self, msg: Req) -> None:
        rid = msg.rid
        try:
            params = SamplingParams.from_dict(msg.params)
            prompt = unpack_ids(msg.prompt, "prompt").tolist()
            if not prompt or self.side.admission.find(rid) or rid in self.side.batch.running:
                raise BadRequest(f"{rid}: empty prompt or rid already in flight")
            if len(prompt) + params.max_new_tokens > self.config.pool_tokens("decode"):
                raise BadRequest(f"{rid}: needs {len(prompt) + params.max_new_tokens} "
                                 "tokens, more than this decode's pool")
        except (BadRequest, ValueError) as exc:
            self.send(Done(rid, "error", error=str(exc)))
            return
        self.side.admission.enqueue(WorkItem(rid, prompt, params, msg.prefill,
                                             msg.prefill_addr,
                                             extra={"t_recv": time.monotonic()}))

    # -- work ----------------------------------------------------------------------------
    def tick(self) -> bool:
        for ev in self.rx.poll(0):
            self._on_event(ev)
        self.side.reap()
        waiting = self._resume()
        admitted = False if waiting else self._admit()  # retracted requests go first
        if len(self.side.batch):
            self._relieve()
        if not len(self.side.batch):
            return admitted
        for item, seq in self.side.step():
            self._finish(item, seq)
        return True

    def _admit(self) -> bool:
        any_admitted = False
        while (item := self.side.admission.admit_next()) is not None:
            any_admitted = True
            cached = self.side.load_prefix(item, commit=False)  # committed with the rest
            if cached is None:  # requeued without reuse, or failed
                continue
            try:
                group = self._group(item.prefill, item.prefill_addr)
                self.rx.announce(item.rid, item.kv, len(item.prompt), cached, group)
            except Exception as exc:  # contained: this request fails, the worker serves on
                logger.error("%s: %s cannot reach prefill %s: %s", self.name, item.rid,
                             item.prefill, exc)
                self._end(item, "error", f"decode {self.name} cannot reach prefill "
                          f"{item.prefill} at {item.prefill_addr!r}: {exc}")
                continue
            item.state = ReqState.WAITING_KV
            logger.info("%s: %s admitted (%d prompt tokens, prefill %s)", self.name,
                        item.rid, len(item.prompt), item.prefill)
        return any_admitted

    # -- overcommit: retraction under pressure (decode_node/retraction.py) -----------------
    def _max_len(self, rid: str) -> int:
        return self.side.admission.admitted[rid].max_len

    def _relieve(self) -> None:
        """Retract the youngest running requests until the next step fits the pool."""
        if self.retractor is None:
            return
        for rid in self.retractor.relieve(self._max_len):
            item = self.side.admission.admitted[rid]
            item.kv, item.state = None, ReqState.RETRACTED  # row freed (offloaded)
            logger.info("%s: %s retracted to the host tier", self.name, rid)
            self.side.forget_step(rid)

    def _resume(self) -> bool:
        """Bring retracted requests back; True while any is still waiting (then new
        requests are not admitted)."""
        if self.retractor is None or self.retractor.admits_new():
            return False
        seqs, failed = self.retractor.resume(self.runner, self.config.prefix_load_timeout_s,
                                             self._max_len)
        for seq in seqs:
            item = self.side.admission.admitted[seq.rid]
            item.kv, item.state = seq.kv, ReqState.DECODING
            self.side.batch.add(seq)
            logger.info("%s: %s resumed", self.name, seq.rid)
        for rid, why in failed.items():
            item = self.side.admission.admitted[rid]
            self._end(item, "error", f"decode {self.name} could not "
                      f"reload this request from its host tier after retracting it under "
                      f"memory pressure ({why}); retry it, or give decodes more pages")
        return not self.retractor.admits_new()

    def _group(self, prefill: str, addr: str) -> int:
        group = self.groups.get(prefill)
        lost = group is not None and self.rx.group_lost(group)
        if group is None or lost:
            group = self.groups[prefill] = self.rx.connect(addr)
        return group

    def _on_event(self, ev) -> None:
        if ev.kind == EventKind.COMPLETED:
            item = self.side.admission.admitted.get(ev.rid)
            if item is not None:
                self._start_decoding(item, ev.first_token)
        elif ev.kind.is_final:
            item = self.side.admission.admitted.get(ev.rid)
            if item is not None:
                self._end(item, ev.reason or "error", ev.detail)
        elif ev.kind in (EventKind.PEER_LOST, EventKind.HANDSHAKE_FAILED):
            logger.error("%s: %s %s: %s", self.name, ev.kind.name, ev.peer, ev.detail)

    def _start_decoding(self, item: WorkItem, first_token: int) -> None:
        """The whole prompt arrived: commit it, stream the first token, join the batch."""
        self.cache.commit(item.kv, len(item.prompt))
        seq = self.side.start_decoding(item, first_token, t_kv_wall=time.time())
        if seq is not None:
            self._finish(item, seq)

    def _finish(self, item: WorkItem, seq: DecodeSeq) -> None:
        """Free the row (or hand it to the host connector while copies are in flight)."""
        item.state = ReqState.FINISHED
        reason = self.side.finish(item, seq)
        logger.info("%s: %s finished (%s, %d tokens)", self.name, item.rid, reason,
                    len(seq.output))

    def _end(self, item: WorkItem, reason: str, detail: str = "") -> None:
        """Abort or failure at any stage: stop the transfer, free what is held, tell the
        router."""
        if item.state == ReqState.WAITING_KV:
            self.rx.abort(item.rid, reason if reason != "aborted" else "aborted", detail)
        self.side.end(item, reason, detail)
        if self.retractor is not None:
            self.retractor.discard(item.rid)

    def on_abort(self, rid: str) -> None:
        item = self.side.admission.find(rid)
        if item is not None:
            self._end(item, "aborted")

    # -- reporting and shutdown ----------------------------------------------------------
    def sockets(self) -> list:
        return self.rx.sockets()

    def load(self) -> Load:
        return self.side.load()

    def stats(self) -> dict:
        return self.side.stats({"bytes_recv": int(self.rx.stats["bytes_recv"])})

    def metric_readings(self) -> list:
        retracted = len(self.retractor.waiting) if self.retractor is not None else 0
        return [*side_readings(self.side), *transport_readings(self.rx, "received"),
                ("pdkv_queue_requests", {"queue": "retracted"}, retracted)]

    def close(self) -> None:
        self.side.abort_all(self._end)
        self.rx.close()
        self.side.close()
        super().close()
