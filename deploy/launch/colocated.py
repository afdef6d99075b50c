"""The colocated worker: prefill and decode in one process over one pool, no transfer.

It is the reference deployment that disaggregated runs are compared against, and it
reuses the same pieces: the ``DecodeScheduler`` (``Admission``, on demand with
retraction to the host tier by default; ``DecodeBatch``, continuous batching; the host
connector; prefix reuse) and the ``PrefillEngine`` (chunked prefill), which is the
scheduler's prompt source.

Each tick is one step. While requests decode and prompts wait, and steps are plain (one
token per request: no speculation), the step is **mixed**: one forward pass carries every
running request's decode token and as many prompt chunks as the step's token budget
(``max_prefill_tokens``) has left, as vLLM's and sglang's chunked prefill do; a prompt
never waits for the batch to drain, and the batch never stops for a prompt. Otherwise a
tick runs a prefill pass (prompts wait) and a decode step (requests run) one after the
other. A step's new tokens, first tokens included, leave in one ``StepTokens`` message.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from common import trace
from common.control import Done, Load, Req, unpack_ids
from common.metrics import watch_host
from common.model import HostPlan, ModelRunner, draw, plan_draws
from common.node import PrefillEngine, WorkerBase
from common.request import Request, SamplingParams
from decode_node.scheduler import DecodeScheduler

logger = logging.getLogger(__name__)


class ColocatedWorker(WorkerBase):
    """One process that prefills and decodes."""

    role = "colocated"

    def build(self) -> None:
        cfg = self.config
        self.model, cache, self.runner = self.make_cache()
        self.engine = PrefillEngine(self.runner, cfg.chunk_size, cfg.max_prefill_tokens,
                                    with_draft=cfg.with_draft)
        self.scheduler = DecodeScheduler(
            self.name, cfg, cache, self.runner, self.send, self._stop_prefill,
            device=self.device, log_dir=self.log_dir, who=self.name, instead="computing",
            whole_life=not cfg.preempts)
        self.mixes = self.scheduler.plain_steps and not self.engine.with_draft
        """Steps fold prompt chunks into the decode forward (no speculation, no draft KV
        to compute for the prompts)."""
        self.num_mixed_steps = 0
        """Steps whose forward carried both decode tokens and prompt chunks."""
        self._computed: list[Request] = []
        watch_host(self.metrics, self.scheduler.offloader)

    def host_offloader(self):
        return self.scheduler.offloader

    def on_abort(self, rid: str, reason: str = "aborted") -> None:
        req = self.scheduler.find(rid)
        if req is not None:
            self.scheduler.end(req, reason)

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
        self.scheduler.enqueue(Request(rid, prompt, params, label=msg.label,
                                       num_prior=msg.prior))

    def tick(self) -> bool:
        self.scheduler.reap()
        self.scheduler.resume()  # retracted requests go before new ones
        busy = self._admit()
        if self.mixes and self.engine.has_work and len(self.scheduler.batch):
            self.scheduler.step(self._mixed_step)
            self._start_computed()
            return True
        if self.engine.has_work:
            busy = True
            self._prefill_pass()
        return self.scheduler.step() or busy

    # -- a prefill pass alone ------------------------------------------------------------
    def _prefill_pass(self) -> None:
        try:
            _, finished = self.engine.step(on_sampled=self._first_tokens)
        except Exception as exc:  # contained: the pass's requests fail
            logger.exception("%s: a prefill pass failed", self.name)
            self._fail_pass(exc)
            return
        self._computed = finished
        self._start_computed()

    def _first_tokens(self, finished: list[Request]) -> None:
        """The engine sampled these first tokens (the draft's pass is still to come): they
        go out now, as the prefill worker sends them, so the client's TTFT does not wait
        for the draft's KV."""
        for req in finished:
            trace.mark("colocated.sampled", req.rid)
            self.scheduler.emit_first(req)
        self.scheduler.flush()

    def _start_computed(self) -> None:
        """Requests whose prompt the last step finished join the batch (their first
        token already went out)."""
        for req in self._computed:
            trace.mark("colocated.computed", req.rid)
            self.scheduler.start_decoding(req, first_sent=True)
        self._computed = []

    # -- a mixed step --------------------------------------------------------------------
    def _mixed_step(self, runner: ModelRunner, seqs: list[Request]) -> list[list[int]]:
        """A ``StepFn``: one forward pass over every running request's newest token
        (``plain_step``'s work) and the prompt chunks that fit the step's token budget;
        one device draw for the decode rows and the prompts that ended (one plan up, one
        copy of the ids down, as ``plain_step``). Returns the decode rows' tokens; the
        prompts that ended wait in ``_computed``.

        | items | tokens | logits used |
        | --- | --- | --- |
        | ``seqs`` | 1 each, at ``next_position`` | all: next token |
        | prompt chunks | up to ``chunk_size`` each | a chunk that ends its prompt: first token |
        """
        chunks = self.engine.plan(self.config.max_prefill_tokens - len(seqs))
        try:
            return self._mixed_forward(runner, seqs, chunks)
        except Exception as exc:  # the scheduler fails the decode rows; the prompts here
            self._fail_pass(exc)
            raise

    @torch.inference_mode()
    def _mixed_forward(self, runner: ModelRunner, seqs: list[Request],
                       chunks: list[tuple[Request, int]]) -> list[list[int]]:
        cache = runner.cache
        for s in seqs:
            assert s.kv.allocated_len == s.next_position, (s.rid, s.kv)
            cache.extend(s.kv, 1)
        ended = self.engine.finishing(chunks)
        reqs = [*seqs, *(r for _, r in ended)]
        # one plan up (the pass and every draw), one copy of the ids down
        host = HostPlan(runner.device)
        pp = runner.plan(host, [*self.scheduler.batch.items(seqs), *self.engine.items(chunks)])
        draws = plan_draws(host, reqs, runner.model.config.vocab_size)
        rows = host.add(np.array([*range(len(seqs)), *(len(seqs) + i for i, _ in ended)],
                                 np.int64))
        dev = host.upload()
        logits = runner.logits(pp, dev, runner.run(pp, dev), padded=True)[dev[rows]]
        tokens = draw(logits, draws, dev)
        tokens = [int(t) for t in tokens]
        for s in seqs:
            cache.commit(s.kv, 1)
        for req, tok in zip(reqs[len(seqs):], tokens[len(seqs):]):
            req.output.append(tok)
            trace.mark("colocated.sampled", req.rid)
            self.scheduler.emit_first(req)   # leaves with this step's tokens
        self.engine.commit(chunks)
        self._computed = [r for _, r in ended]
        self.num_mixed_steps += bool(chunks)
        return [[t] for t in tokens[:len(seqs)]]

    def _fail_pass(self, exc: Exception) -> None:
        """A pass failed: its prompts fail (those still prefilling, and those it ended
        that have not joined the batch)."""
        computed, self._computed = self._computed, []
        for req in [*self.engine.batch, *computed]:
            if not req.state.is_finished:
                self.scheduler.end(req, "error", f"{self.name}: a prefill pass failed "
                                   f"({type(exc).__name__}: {exc}); retry it")

    # -- admission -----------------------------------------------------------------------
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

    def num_requests(self) -> int:
        admission = self.scheduler.admission
        return len(admission.admitted) + len(admission.queue)

    def stats(self) -> dict:
        return self.scheduler.stats({"tokens_computed": self.engine.num_tokens_computed,
                                     "mixed_steps": self.num_mixed_steps})

    def metric_readings(self) -> list:
        return [*self.scheduler.metric_readings(),
                ("pdkv_prefill_computed_tokens_total", {}, self.engine.num_tokens_computed)]

    def abandon(self, detail: str) -> None:
        self.scheduler.abort_all(detail)

    def shutdown(self) -> None:
        self.scheduler.abort_all()
        self.scheduler.close()
