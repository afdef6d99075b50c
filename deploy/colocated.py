"""The colocated worker: prefill and decode in one process over one pool, no transfer.

It is the reference deployment that disaggregated runs are compared against, and it
reuses the same pieces: ``Admission`` (whole-life reservation, FIFO), ``PrefillEngine``
(chunked prefill) and ``DecodeBatch`` (continuous batching). Each tick runs one prefill
pass (when prompts wait) and one decode step (when sequences run).
"""

from __future__ import annotations

import logging

from decode_node.admission import Admission, WorkItem
from decode_node.batch import DecodeBatch, DecodeSeq, finish_ranges
from decode_node.host_connector import HostConnector
from deploy.host_setup import close_offloader, host_salt, make_offloader, make_step, spec_stats
from deploy.request import ReqState, SamplingParams
from deploy.wire import unpack_ids
from deploy.worker_base import WorkerBase
from prefill_node.engine import PrefillEngine, PrefillTask

logger = logging.getLogger(__name__)


class ColocatedWorker(WorkerBase):
    """One process that prefills and decodes."""

    role = "colocated"

    def __init__(self, name: str, router: str, device: str = "cpu",
                 log_dir: str | None = None) -> None:
        super().__init__(name, router, device, log_dir)
        cfg = self.config
        self.model, cache, self.runner = self.make_cache(cfg.decode_pages)
        self.admission = Admission(cache, cfg.max_running)
        self.engine = PrefillEngine(self.runner, cfg.chunk_size, cfg.max_prefill_tokens,
                                    with_draft=cfg.with_draft)
        self.off = make_offloader(cfg, cache, device, log_dir, name)
        self.conn = HostConnector(self.off, host_salt(cfg, cache)) if self.off else None
        self.step = make_step(cfg)
        self.batch = DecodeBatch(self.runner, self.step,
                                 on_commit=self.conn.on_commit if self.conn else None)
        self.counts = {"finished": 0, "aborted": 0, "failed": 0, "tokens": 0,
                       "prefix_load_timeouts": 0}
        self.report_ready()

    def handle(self, msg: dict) -> None:
        rid = msg["rid"]
        if msg["t"] == "abort":
            item = self.admission.find(rid)
            if item is not None:
                self._end(item, "aborted")
            return
        try:
            params = SamplingParams.from_dict(msg["params"])
            prompt = unpack_ids(msg["prompt"])
            if not prompt or self.admission.find(rid):
                raise ValueError(f"{rid}: empty prompt or rid already in flight")
        except (ValueError, KeyError) as exc:
            self.send({"t": "done", "rid": rid, "reason": "error", "error": str(exc)})
            return
        self.admission.enqueue(WorkItem(rid, prompt, params))

    def tick(self) -> bool:
        busy = False
        if self.conn is not None:
            self.conn.reap()
        while (item := self.admission.admit_next()) is not None:
            busy = True
            try:
                start = self._load_prefix(item)
            except TimeoutError as exc:  # free the row, admit again without reuse
                logger.warning("%s: %s; computing the whole prompt instead", self.name, exc)
                self.counts["prefix_load_timeouts"] += 1
                self.admission.release(item, [(0, item.kv.allocated_len)], "timeout")
                item.extra["no_reuse"] = True
                self.admission.requeue(item)
                continue
            except Exception as exc:  # contained: this request fails, the worker serves on
                logger.exception("%s: %s prefix load failed", self.name, item.rid)
                self._end(item, "error", f"{self.name}: loading the cached prefix failed "
                          f"({type(exc).__name__}: {exc}); retry the request")
                continue
            item.state = ReqState.PREFILLING
            self.engine.add(PrefillTask(item.rid, item.prompt, item.params, item.kv,
                                        done=start))
        if self.engine.has_work:
            _, finished = self.engine.step()
            for task in finished:
                self._start_decoding(self.admission.admitted[task.rid], task.first_token)
            busy = True
        if len(self.batch):
            emitted, finished = self.batch.step()
            for seq, toks in emitted:
                if toks:
                    self.send({"t": "tokens", "rid": seq.rid, "ids": toks})
            for seq in finished:
                self._finish(self.admission.admitted[seq.rid], seq)
            busy = True
        return busy

    def _load_prefix(self, item: WorkItem) -> int:
        """Load and commit the prompt's cached prefix (blocking); the prefill start (0 on
        a miss or a failed copy).

        Raises:
            TimeoutError: not done within ``prefix_load_timeout_s``; the caller frees the
                row (the load's pins keep its pages safe) and admits it again, no reuse.
        """
        if self.conn is None or item.extra.get("no_reuse"):
            return 0
        handle = self.conn.prepare_load(item.kv, item.prompt)
        if handle is None:
            return 0
        timeout = self.config.prefix_load_timeout_s
        try:
            if not self.conn.complete_load(handle, timeout):
                raise TimeoutError(f"{item.rid}: prefix load not done in {timeout} s")
        except RuntimeError as exc:  # the copy failed and ended: compute everything
            logger.warning("%s: %s prefix load failed (%s); computing it all", self.name,
                           item.rid, exc)
            return 0
        self.cache.commit(item.kv, handle.num_tokens)
        return handle.num_tokens

    def _start_decoding(self, item: WorkItem, first_token: int) -> None:
        item.state = ReqState.DECODING
        seq = DecodeSeq(item.rid, item.kv, item.params, len(item.prompt), [first_token])
        self.send({"t": "tokens", "rid": item.rid, "ids": [first_token], "first": True})
        if not self.batch.add(seq):
            self._finish(item, seq)
        elif self.conn is not None:
            self.conn.track(seq, item.prompt)

    def _finish(self, item: WorkItem, seq: DecodeSeq) -> None:
        output = seq.output
        stop = item.params.stop_token
        reason = "stop" if stop >= 0 and output and output[-1] == stop else "length"
        self.counts["finished"] += 1
        self.counts["tokens"] += len(output)
        ranges = finish_ranges(item.kv, self.cache.page_size)
        if self.conn is not None and self.conn.request_finished(seq, ranges):
            self.admission.forget(item)  # the connector frees it in reap()
        else:
            self.admission.release(item, ranges, "finished")
        self.send({"t": "done", "rid": item.rid, "reason": reason, "n": len(output)})

    def _end(self, item: WorkItem, reason: str, detail: str = "") -> None:
        logger.info("%s: %s %s in %s%s", self.name, item.rid, reason, item.state.name,
                    f" ({detail})" if detail else "")
        self.engine.remove(item.rid)
        self.batch.remove(item.rid)
        self.counts["aborted" if reason == "aborted" else "failed"] += 1
        item.state = ReqState.ABORTED if reason == "aborted" else ReqState.FAILED
        ranges = finish_ranges(item.kv, self.cache.page_size) if item.kv is not None else []
        self.admission.release(item, ranges, reason if reason == "aborted" else "error")
        if self.conn is not None:
            self.conn.request_aborted(item.rid)
        if hasattr(self.step, "forget"):
            self.step.forget(item.rid)
        msg = {"t": "done", "rid": item.rid, "reason": reason}
        if detail:
            msg["error"] = detail
        self.send(msg)

    def load(self) -> dict:
        return {"running": len(self.batch) + len(self.engine.tasks),
                "queued": len(self.admission.queue),
                "free_tokens": self.admission.num_free_tokens}

    def stats(self) -> dict:
        host = {} if self.conn is None else {
            "offloaded_pages": self.off.num_offloaded_pages,
            "prefix_hit_pages": self.conn.num_prefix_hit_pages,
            "retracted": self.conn.num_retracted}
        return {**self.counts, "steps": self.batch.num_steps,
                "tokens_computed": self.engine.num_tokens_computed,
                **spec_stats(self.step), **host}

    def close(self) -> None:
        for item in list(self.admission.admitted.values()) + list(
                self.admission.queue.values()):
            self._end(item, "aborted", "worker shutting down")
        if self.conn is not None:  # held rows are freed once every copy ended
            self.off.wait(None, self.config.lease_s)
            self.conn.reap()
        close_offloader(self.off, self.config.lease_s)
        self.cache.check_integrity()
        self.cache.close()
        super().close()
