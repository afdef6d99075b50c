"""The colocated worker: prefill and decode in one process over one pool, no transfer.

It is the reference deployment that disaggregated runs are compared against, and it
reuses the same pieces: ``DecodeSide`` (``Admission`` with whole-life reservation, FIFO;
``DecodeBatch``, continuous batching; the host connector) and ``PrefillEngine`` (chunked
prefill). Each tick runs one prefill pass (when prompts wait) and one decode step (when
sequences run).
"""

from __future__ import annotations

import logging

from common.codec import unpack_ids
from common.metrics import watch_host
from common.node import Done, Load, Req, WorkerBase
from common.request import ReqState, SamplingParams
from decode_node.admission import WorkItem
from decode_node.scheduler import DecodeSide, side_readings
from prefill_node.engine import PrefillEngine, PrefillTask

logger = logging.getLogger(__name__)


class ColocatedWorker(WorkerBase):
    """One process that prefills and decodes."""

    role = "colocated"

    def __init__(self, name: str, router: str, device: str = "cpu",
                 log_dir: str | None = None, local_models: dict[str, str] | None = None
                 ) -> None:
        super().__init__(name, router, device, log_dir, local_models=local_models)
        cfg = self.config
        self.model, cache, self.runner = self.make_cache(cfg.decode_pages)
        self.engine = PrefillEngine(self.runner, cfg.chunk_size, cfg.max_prefill_tokens,
                                    with_draft=cfg.with_draft)
        self.side = DecodeSide(name, cfg, cache, self.runner, self.send, device=device,
                               log_dir=log_dir, log=logger, who=name, instead="computing")
        watch_host(self.metrics, self.side.off)
        self.report_ready()

    def on_abort(self, rid: str) -> None:
        item = self.side.admission.find(rid)
        if item is not None:
            self._end(item, "aborted")

    def on_req(self, msg: Req) -> None:
        rid = msg.rid
        try:
            params = SamplingParams.from_dict(msg.params)
            prompt = unpack_ids(msg.prompt, "prompt").tolist()
            if not prompt or self.side.admission.find(rid):
                raise ValueError(f"{rid}: empty prompt or rid already in flight")
        except ValueError as exc:
            self.send(Done(rid, "error", error=str(exc)))
            return
        self.side.admission.enqueue(WorkItem(rid, prompt, params))

    def tick(self) -> bool:
        self.side.reap()
        busy = self._admit()
        if self.engine.has_work:
            _, finished = self.engine.step()
            for task in finished:
                self._start_decoding(self.side.admission.admitted[task.rid],
                                     task.first_token)
            busy = True
        if len(self.side.batch):
            for item, seq in self.side.step():
                self.side.finish(item, seq)
            busy = True
        return busy

    def _admit(self) -> bool:
        """Admit what fits, load each prompt's cached prefix (committed) and queue the
        rest of the prompt for prefill; True if any request was admitted."""
        any_admitted = False
        while (item := self.side.admission.admit_next()) is not None:
            any_admitted = True
            start = self.side.load_prefix(item, commit=True)
            if start is None:  # requeued without reuse, or failed
                continue
            item.state = ReqState.PREFILLING
            self.engine.add(PrefillTask(item.rid, item.prompt, item.params, item.kv,
                                        done=start))
        return any_admitted

    def _start_decoding(self, item: WorkItem, first_token: int) -> None:
        seq = self.side.start_decoding(item, first_token)
        if seq is not None:
            self.side.finish(item, seq)

    def _end(self, item: WorkItem, reason: str, detail: str = "") -> None:
        self.engine.remove(item.rid)
        self.side.end(item, reason, detail)

    def load(self) -> Load:
        return self.side.load(running=len(self.engine.tasks))

    def stats(self) -> dict:
        return self.side.stats({"tokens_computed": self.engine.num_tokens_computed})

    def metric_readings(self) -> list:
        return side_readings(self.side)

    def close(self) -> None:
        self.side.abort_all(self._end)
        self.side.close()
        super().close()
