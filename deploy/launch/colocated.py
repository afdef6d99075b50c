"""The colocated worker: prefill and decode in one process over one pool, no transfer.

It is the reference deployment that disaggregated runs are compared against, and it
reuses the same pieces: the ``DecodeScheduler`` (``Admission`` with whole-life
reservation, FIFO; ``DecodeBatch``, continuous batching; the host connector; prefix
reuse) and the ``PrefillEngine`` (chunked prefill), which is the scheduler's prompt
source. Each tick runs one prefill pass (when prompts wait) and one decode step (when
requests run).
"""

from __future__ import annotations

import logging

from common import trace
from common.control import Done, Load, Req, Tokens, unpack_ids
from common.metrics import watch_host
from common.node import WorkerBase
from common.request import Request, SamplingParams
from decode_node.scheduler import DecodeScheduler
from prefill_node.engine import PrefillEngine

logger = logging.getLogger(__name__)


class ColocatedWorker(WorkerBase):
    """One process that prefills and decodes."""

    role = "colocated"

    def build(self) -> None:
        cfg = self.config
        self.model, cache, self.runner = self.make_cache(cfg.decode_pages)
        self.engine = PrefillEngine(self.runner, cfg.chunk_size, cfg.max_prefill_tokens,
                                    with_draft=cfg.with_draft)
        self.scheduler = DecodeScheduler(
            self.name, cfg, cache, self.runner, self.send, self._stop_prefill,
            device=self.device, log_dir=self.log_dir, who=self.name, instead="computing")
        watch_host(self.metrics, self.scheduler.offloader)

    def on_abort(self, rid: str) -> None:
        req = self.scheduler.find(rid)
        if req is not None:
            self.scheduler.end(req, "aborted")

    def on_stop(self, rid: str) -> None:
        req = self.scheduler.find(rid)
        if req is not None:
            self.scheduler.stop(req)

    def on_req(self, msg: Req) -> None:
        rid = msg.rid
        try:
            params = SamplingParams.from_dict(msg.params)
            prompt = unpack_ids(msg.prompt, "prompt").tolist()
            if not prompt or self.scheduler.find(rid) is not None:
                raise ValueError(f"{rid}: empty prompt or rid already in flight")
        except ValueError as exc:
            self.send(Done(rid, "error", error=str(exc)))
            return
        self.scheduler.enqueue(Request(rid, prompt, params, label=msg.label))

    def tick(self) -> bool:
        self.scheduler.reap()
        busy = self._admit()
        if self.engine.has_work:
            busy = True
            try:
                _, finished = self.engine.step(on_sampled=self._first_tokens)
            except Exception as exc:  # contained: the pass's requests fail
                logger.exception("%s: a prefill pass failed", self.name)
                for req in self.engine.batch:
                    self.scheduler.end(req, "error", f"{self.name}: a prefill pass failed "
                                       f"({type(exc).__name__}: {exc}); retry it")
                finished = []
            for req in finished:
                trace.mark("colocated.computed", req.rid)
                self.scheduler.start_decoding(req, first_sent=True)
        return self.scheduler.step() or busy

    def _first_tokens(self, finished: list[Request]) -> None:
        """The engine sampled these first tokens (the draft's pass is still to come): they
        go out now, as the prefill worker sends them, so the client's TTFT does not wait
        for the draft's KV."""
        for req in finished:
            trace.mark("colocated.sampled", req.rid)
            self.send(Tokens(req.rid, [req.output[0]], first=True))

    def _admit(self) -> bool:
        """Admit what fits (its cached prefix loaded and committed) and queue the rest of
        each prompt for prefill; True if any request was admitted."""
        any_admitted = False
        while (req := self.scheduler.admit_next(commit_prefix=True)) is not None:
            any_admitted = True
            self.scheduler.prefilling(req)
            self.engine.add(req)
            trace.mark("colocated.start", req.rid)
        return any_admitted

    def _stop_prefill(self, req: Request, reason: str, detail: str) -> None:
        """The scheduler ends a request that is still prefilling."""
        self.engine.remove(req.rid)

    def load(self) -> Load:
        return self.scheduler.load(running=len(self.engine.tasks))

    def stats(self) -> dict:
        return self.scheduler.stats({"tokens_computed": self.engine.num_tokens_computed})

    def metric_readings(self) -> list:
        return self.scheduler.metric_readings()

    def abandon(self, detail: str) -> None:
        self.scheduler.abort_all(detail)

    def shutdown(self) -> None:
        self.scheduler.abort_all()
        self.scheduler.close()
