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

from decode_node.admission import Admission, WorkItem
from decode_node.batch import DecodeBatch, DecodeSeq, finish_ranges
from decode_node.host_connector import HostConnector
from decode_node.pressure import Retractor
from deploy.host_setup import close_offloader, host_salt, make_offloader, make_step, spec_stats
from deploy.request import BadRequest, ReqState, SamplingParams
from deploy.wire import unpack_ids
from deploy.worker_base import WorkerBase
from transport import EventKind, KvReceiver, TransportConfig

logger = logging.getLogger(__name__)


class DecodeWorker(WorkerBase):
    """One decode process (one device)."""

    role = "decode"

    def __init__(self, name: str, router: str, device: str = "cpu",
                 log_dir: str | None = None) -> None:
        super().__init__(name, router, device, log_dir)
        cfg = self.config
        self.model, cache, self.runner = self.make_cache(cfg.decode_pages, cfg.shared_memory)
        self.admission = Admission(cache, cfg.max_running, whole_life=not cfg.overcommit)
        self.off = make_offloader(cfg, cache, device, log_dir, name)
        self.conn = HostConnector(self.off, host_salt(cfg, cache)) if self.off else None
        self.step = make_step(cfg)
        self.batch = DecodeBatch(self.runner, self.step,
                                 on_commit=self.conn.on_commit if self.conn else None)
        self.retractor = Retractor(self.conn, self.batch, cfg.spec_k) \
            if cfg.overcommit else None
        self.rx = KvReceiver(cache, TransportConfig(
            node=name, model=cfg.model, heartbeat_s=cfg.heartbeat_s, lease_s=cfg.lease_s,
            shared_memory=cfg.shared_memory), ctx=self.ctx)
        self.groups: dict[str, int] = {}
        self.counts = {"finished": 0, "aborted": 0, "failed": 0, "tokens": 0,
                       "prefix_load_timeouts": 0}
        self.report_ready()

    # -- control -------------------------------------------------------------------------
    def handle(self, msg: dict) -> None:
        if msg["t"] == "req":
            self._on_req(msg)
        elif msg["t"] == "abort":
            self._abort(msg["rid"], "aborted")

    def _on_req(self, msg: dict) -> None:
        rid = msg["rid"]
        try:
            params = SamplingParams.from_dict(msg["params"])
            prompt = unpack_ids(msg["prompt"])
            if not prompt or self.admission.find(rid) or rid in self.batch.running:
                raise BadRequest(f"{rid}: empty prompt or rid already in flight")
            if len(prompt) + params.max_new_tokens > self.config.pool_tokens("decode"):
                raise BadRequest(f"{rid}: needs {len(prompt) + params.max_new_tokens} "
                                 "tokens, more than this decode's pool")
        except (BadRequest, KeyError, ValueError) as exc:
            self.send({"t": "done", "rid": rid, "reason": "error", "error": str(exc)})
            return
        self.admission.enqueue(WorkItem(rid, prompt, params, msg.get("prefill", ""),
                                        msg.get("prefill_addr", ""),
                                        extra={"t_recv": time.monotonic()}))

    # -- work ----------------------------------------------------------------------------
    def tick(self) -> bool:
        for ev in self.rx.poll(0):
            self._on_event(ev)
        if self.conn is not None:
            self.conn.reap()
        waiting = self._resume()
        admitted = False if waiting else self._admit()  # retracted requests go first
        if len(self.batch):
            self._relieve()
        if not len(self.batch):
            return admitted
        emitted, finished = self.batch.step()
        for seq, toks in emitted:
            if toks:
                self.send({"t": "tokens", "rid": seq.rid, "ids": toks})
        for seq in finished:
            self._finish(self.admission.admitted[seq.rid], seq)
        return True

    def _admit(self) -> bool:
        any_admitted = False
        while (item := self.admission.admit_next()) is not None:
            any_admitted = True
            try:
                cached = self.load_cached_prefix(item)
            except TimeoutError as exc:
                self._requeue_without_prefix(item, exc)
                continue
            except Exception as exc:  # contained: this request fails, the worker serves on
                logger.exception("%s: %s prefix load failed", self.name, item.rid)
                self._end(item, "error", f"decode {self.name}: loading the cached prefix "
                          f"failed ({type(exc).__name__}: {exc}); retry the request")
                continue
            try:
                group = self._group(item.prefill, item.prefill_addr)
                self.rx.announce(item.rid, item.kv, len(item.prompt), cached, group)
            except Exception as exc:  # contained, as above
                logger.error("%s: %s cannot reach prefill %s: %s", self.name, item.rid,
                             item.prefill, exc)
                self._end(item, "error", f"decode {self.name} cannot reach prefill "
                          f"{item.prefill} at {item.prefill_addr!r}: {exc}")
                continue
            item.state = ReqState.WAITING_KV
            logger.info("%s: %s admitted (%d prompt tokens, prefill %s)", self.name,
                        item.rid, len(item.prompt), item.prefill)
        return any_admitted

    # -- overcommit: retraction under pressure (decode_node/pressure.py) -----------------
    def _max_len(self, rid: str) -> int:
        return self.admission.admitted[rid].max_len

    def _relieve(self) -> None:
        """Retract the youngest running requests until the next step fits the pool."""
        if self.retractor is None:
            return
        for rid in self.retractor.relieve(self._max_len):
            item = self.admission.admitted[rid]
            item.kv, item.state = None, ReqState.RETRACTED  # row freed (offloaded)
            logger.info("%s: %s retracted to the host tier", self.name, rid)
            if hasattr(self.step, "forget"):
                self.step.forget(rid)

    def _resume(self) -> bool:
        """Bring retracted requests back; True while any is still waiting (then new
        requests are not admitted)."""
        if self.retractor is None or self.retractor.admits_new():
            return False
        seqs, failed = self.retractor.resume(self.runner, self.config.prefix_load_timeout_s,
                                             self._max_len)
        for seq in seqs:
            item = self.admission.admitted[seq.rid]
            item.kv, item.state = seq.kv, ReqState.DECODING
            self.batch.add(seq)
            logger.info("%s: %s resumed", self.name, seq.rid)
        for rid, why in failed.items():
            self._end(self.admission.admitted[rid], "error", f"decode {self.name} could not "
                      f"reload this request from its host tier after retracting it under "
                      f"memory pressure ({why}); retry it, or give decodes more pages")
        return not self.retractor.admits_new()

    def _requeue_without_prefix(self, item: WorkItem, exc: Exception) -> None:
        """A prefix load timed out: free the row (``timeout``; the load's pins keep its
        pages out of reuse until the copy ends) and queue the request again at the head,
        reuse off, so it receives its whole prompt in a new row."""
        logger.warning("%s: %s; receiving the whole prompt instead", self.name, exc)
        self.counts["prefix_load_timeouts"] += 1
        self.admission.release(item, [(0, item.kv.allocated_len)], "timeout")
        item.state, item.extra["no_reuse"] = ReqState.QUEUED, True
        self.admission.requeue(item)

    def load_cached_prefix(self, item: WorkItem) -> int:
        """Fill the row's first pages from the host tier's prefix cache (blocking) and
        return how many prompt tokens they hold (page-aligned; 0 on a miss or a failed
        copy); the transfer carries only the rest.

        Raises:
            TimeoutError: the copy did not end within ``prefix_load_timeout_s``; the
                caller frees the row
                (the load's pins keep the pages out of reuse until the copy ends).
        """
        if self.conn is None or item.extra.get("no_reuse"):
            return 0
        handle = self.conn.prepare_load(item.kv, item.prompt)
        if handle is None:
            return 0
        try:
            timeout = self.config.prefix_load_timeout_s
            if not self.conn.complete_load(handle, timeout):
                raise TimeoutError(f"{item.rid}: prefix load not done in {timeout} s")
        except RuntimeError as exc:  # the copy failed and ended: receive everything
            logger.warning("%s: %s prefix load failed (%s); receiving it all", self.name,
                           item.rid, exc)
            return 0
        return handle.num_tokens

    def _group(self, prefill: str, addr: str) -> int:
        group = self.groups.get(prefill)
        lost = group is not None and any(self.rx.peers[k].lost for k in self.rx.groups[group])
        if group is None or lost:
            group = self.groups[prefill] = self.rx.connect(addr)
        return group

    def _on_event(self, ev) -> None:
        if ev.kind == EventKind.COMPLETED:
            item = self.admission.admitted.get(ev.rid)
            if item is not None:
                self._start_decoding(item, ev.first_token)
        elif ev.kind.is_final:
            item = self.admission.admitted.get(ev.rid)
            if item is not None:
                self._end(item, ev.reason or "error", ev.detail)
        elif ev.kind in (EventKind.PEER_LOST, EventKind.HANDSHAKE_FAILED):
            logger.error("%s: %s %s: %s", self.name, ev.kind.name, ev.peer, ev.detail)

    def _start_decoding(self, item: WorkItem, first_token: int) -> None:
        self.cache.commit(item.kv, len(item.prompt))
        item.state = ReqState.DECODING
        seq = DecodeSeq(item.rid, item.kv, item.params, len(item.prompt), [first_token])
        self.send({"t": "tokens", "rid": item.rid, "ids": [first_token], "first": True,
                   "t_kv_wall": time.time()})
        if not self.batch.add(seq):
            self._finish(item, seq)
        elif self.conn is not None:
            self.conn.track(seq, item.prompt)

    def _finish(self, item: WorkItem, seq: DecodeSeq) -> None:
        """Free the row (or hand it to the host connector while copies are in flight)."""
        output = seq.output
        stop = item.params.stop_token
        reason = "stop" if stop >= 0 and output and output[-1] == stop else "length"
        self.counts["finished"] += 1
        self.counts["tokens"] += len(output)
        item.state = ReqState.FINISHED
        ranges = finish_ranges(item.kv, self.cache.page_size)
        if self.conn is not None and self.conn.request_finished(seq, ranges):
            self.admission.forget(item)  # the connector frees it in reap()
        else:
            self.admission.release(item, ranges, "finished")
        self.send({"t": "done", "rid": item.rid, "reason": reason, "n": len(output)})
        logger.info("%s: %s finished (%s, %d tokens)", self.name, item.rid, reason,
                    len(output))

    def _end(self, item: WorkItem, reason: str, detail: str = "") -> None:
        """Abort or failure at any stage: free what is held, tell the router."""
        logger.info("%s: %s %s in %s%s", self.name, item.rid, reason, item.state.name,
                    f" ({detail})" if detail else "")
        self.batch.remove(item.rid)
        if item.state == ReqState.WAITING_KV:
            self.rx.abort(item.rid, reason if reason != "aborted" else "aborted", detail)
        item.state = ReqState.ABORTED if reason == "aborted" else ReqState.FAILED
        self.counts["aborted" if reason == "aborted" else "failed"] += 1
        if item.kv is not None:
            self.admission.release(item, finish_ranges(item.kv, self.cache.page_size),
                                   _free_reason(reason))
        else:
            self.admission.release(item, [], reason)
        if self.conn is not None:
            self.conn.request_aborted(item.rid)
        if self.retractor is not None:
            self.retractor.discard(item.rid)
        if hasattr(self.step, "forget"):
            self.step.forget(item.rid)
        msg = {"t": "done", "rid": item.rid, "reason": reason}
        if detail:
            msg["error"] = detail
        self.send(msg)

    def _abort(self, rid: str, reason: str) -> None:
        item = self.admission.find(rid)
        if item is not None:
            self._end(item, reason)

    # -- reporting and shutdown ----------------------------------------------------------
    def sockets(self) -> list:
        return [s.sock for s in self.rx.sockets.values()]

    def load(self) -> dict:
        return {"running": len(self.batch), "queued": len(self.admission.queue),
                "free_tokens": self.admission.num_free_tokens}

    def stats(self) -> dict:
        host = {} if self.conn is None else {
            "offloaded_pages": self.off.num_offloaded_pages,
            "prefix_hit_pages": self.conn.num_prefix_hit_pages,
            "retracted": self.conn.num_retracted}
        return {**self.counts, "steps": self.batch.num_steps,
                "bytes_recv": int(self.rx.stats["bytes_recv"]), **spec_stats(self.step), **host}

    def close(self) -> None:
        for item in list(self.admission.admitted.values()) + list(
                self.admission.queue.values()):
            self._end(item, "aborted", "worker shutting down")
        self.rx.close()
        if self.conn is not None:  # held rows are freed once every copy ended
            self.off.wait(None, self.config.lease_s)
            self.conn.reap()
        close_offloader(self.off, self.config.lease_s)
        self.cache.check_integrity()
        self.cache.close()
        super().close()


def _free_reason(reason: str) -> str:
    """Free-log reasons are a closed set (DESIGN.md section 4)."""
    allowed = {"finished", "aborted", "timeout", "peer_lost", "error"}
    return reason if reason in allowed else "error"
