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
                                    with_draft=cfg.draft_kv)
        self.batch = DecodeBatch(self.runner)
        self.counts = {"finished": 0, "aborted": 0, "failed": 0, "tokens": 0}
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
        while (item := self.admission.admit_next()) is not None:
            item.state = ReqState.PREFILLING
            self.engine.add(PrefillTask(item.rid, item.prompt, item.params, item.kv))
            busy = True
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
                self._finish(self.admission.admitted[seq.rid], seq.output)
            busy = True
        return busy

    def _start_decoding(self, item: WorkItem, first_token: int) -> None:
        item.state = ReqState.DECODING
        seq = DecodeSeq(item.rid, item.kv, item.params, len(item.prompt), [first_token])
        self.send({"t": "tokens", "rid": item.rid, "ids": [first_token], "first": True})
        if not self.batch.add(seq):
            self._finish(item, seq.output)

    def _finish(self, item: WorkItem, output: list[int]) -> None:
        stop = item.params.stop_token
        reason = "stop" if stop >= 0 and output and output[-1] == stop else "length"
        self.counts["finished"] += 1
        self.counts["tokens"] += len(output)
        self.admission.release(item, finish_ranges(item.kv, self.cache.page_size), "finished")
        self.send({"t": "done", "rid": item.rid, "reason": reason, "n": len(output)})

    def _end(self, item: WorkItem, reason: str, detail: str = "") -> None:
        logger.info("%s: %s %s in %s%s", self.name, item.rid, reason, item.state.name,
                    f" ({detail})" if detail else "")
        self.engine.remove(item.rid)
        self.batch.remove(item.rid)
        self.counts["aborted"] += 1
        ranges = finish_ranges(item.kv, self.cache.page_size) if item.kv is not None else []
        self.admission.release(item, ranges, "aborted")
        msg = {"t": "done", "rid": item.rid, "reason": reason}
        if detail:
            msg["error"] = detail
        self.send(msg)

    def load(self) -> dict:
        return {"running": len(self.batch) + len(self.engine.tasks),
                "queued": len(self.admission.queue),
                "free_tokens": self.admission.num_free_tokens}

    def stats(self) -> dict:
        return {**self.counts, "steps": self.batch.num_steps,
                "tokens_computed": self.engine.num_tokens_computed}

    def close(self) -> None:
        for item in list(self.admission.admitted.values()) + list(
                self.admission.queue.values()):
            self._end(item, "aborted", "worker shutting down")
        self.cache.check_integrity()
        self.cache.close()
        super().close()
