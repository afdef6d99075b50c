"""The decode scheduler: admission, the continuous batch, the host tier, retraction.

Shared by the decode worker (a request's prompt KV arrives from a prefill) and the
colocated worker (its prefill engine computes it). The worker turns its inputs (router
messages, transport events or prefill steps) into calls here; the scheduler

- is the only writer of ``Request.state`` on its worker (``_move``, checked), and
- ends every request in one place, ``_free_request(req, reason)``, which asks each part
  in turn what it still holds for the request (the prompt source: the transport or the
  prefill engine; the batch; the host connector; retraction) and frees the row once.

Who frees what: a finished row is freed with ``finished`` now, or by the host connector
once its copies to the host tier end (``reap``); an abort or failure frees at once with
its reason (pins keep pages in flight out of reuse); a prefix load past its deadline
frees the row with ``timeout`` and queues the request again (``PrefixReuse``);
retraction frees with ``offloaded``. Speculation keeps its per-request state on the
record (``num_draft_valid``), so the step holds nothing to free. ``close`` waits for host
copies, reaps and closes both pools after the worker ended every request.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from common.config import ServeConfig
from common.control import Done, Load, Message, StepTokens, Tokens
from common.kv import FreeReason, KvCache
from common.metrics import abort_readings, host_readings, spec_readings
from common.model import ModelRunner
from common.node import PrefixReuse, close_offloader, host_salt, make_offloader
from common.request import ReqState, Request, check_transition
from decode_node.admission import Admission, AdmissionFailed
from decode_node.batch import DecodeBatch, StepFn, finish_ranges, greedy_step
from decode_node.host_connector import HostConnector
from decode_node.retraction import Retractor
from decode_node.speculative import make_step, spec_stats

logger = logging.getLogger(__name__)

Send = Callable[[Message], None]
"""Sends one message to the router."""

StopPrompt = Callable[[Request, str, str], None]
"""Stops whatever still brings a request's prompt KV (the transport's receive, the
prefill engine) when the request ends before its prompt is in: ``(req, reason, detail)``."""


class DecodeScheduler:
    """Admission, batch, host connector and retraction of one worker, and the decode-side
    steps of a request's life.

    Args:
        name: the worker's name (logs).
        cfg: the serving config.
        cache: the worker's device pool; ``runner`` runs the model over it.
        send: sends a message to the router.
        stop_prompt: the prompt source's part of ``_free_request`` (see ``StopPrompt``).
        device, log_dir: where the host tier lives and logs (``make_offloader``).
        who: how error messages to the client name the worker (``"decode d0"``).
        instead: what the worker does with the prompt when no prefix was loaded
            (``"receiving"`` or ``"computing"``; logs only).
        whole_life: reserve each request's whole life (False: allocate on demand and
            retract under pressure; needs the host tier).
    """

    def __init__(self, name: str, cfg: ServeConfig, cache: KvCache, runner: ModelRunner,
                 send: Send, stop_prompt: StopPrompt, *, device: str, log_dir: str | None,
                 who: str, instead: str, whole_life: bool = True) -> None:
        self.name, self.cfg, self.cache, self.runner = name, cfg, cache, runner
        self.send, self.stop_prompt, self.who, self.instead = send, stop_prompt, who, instead
        self.admission = Admission(cache, cfg.batch_limit(cache.num_pages),
                                   whole_life=whole_life)
        self.offloader = make_offloader(cfg, cache, device, log_dir, name)
        off, salt = self.offloader, host_salt(cfg, cache)
        self.host_connector = HostConnector(off, salt) if off else None
        self.prefix_reuse = PrefixReuse(off, salt, cfg.prefix_load_timeout_s) if off else None
        self.step_fn = make_step(cfg)
        self.batch = DecodeBatch(runner, self.step_fn, on_commit=self.host_connector.on_commit
                                 if self.host_connector else None)
        self.retraction = Retractor(self.host_connector, self.batch, cfg.spec_k) \
            if not whole_life else None
        if self.retraction is not None:
            self.admission.headroom = self.retraction.running_need
        self.outbox: list[tuple[str, list[int], bool]] = []
        """This step's new tokens (rid, ids, first): one ``StepTokens`` per step."""
        self.counts = {"finished": 0, "aborted": 0, "failed": 0, "migrated": 0, "tokens": 0}
        self.aborted_in: Counter[str] = Counter()
        """Aborted requests by the stage (``ReqState``, lower case) they were in."""

    @property
    def plain_steps(self) -> bool:
        """Each step is one forward pass with one token per request (no speculation): a
        colocated worker may fold prefill chunks into it."""
        return self.step_fn is greedy_step

    def find(self, rid: str) -> Request | None:
        """The live request ``rid`` (queued, admitted, decoding or retracted)."""
        return self.admission.find(rid)

    # -- admission -------------------------------------------------------------------------
    def enqueue(self, req: Request) -> None:
        self.admission.enqueue(req)

    def admit_next(self, *, commit_prefix: bool) -> Request | None:
        """The next request that fits, with its row open over the prompt and its cached
        prefix loaded (``num_computed``); ``commit_prefix`` commits that prefix now.

        None when nothing fits now, or while retracted requests wait to resume. A prefix
        load past its deadline frees the row and requeues the request (it comes back
        here without reuse); a failing load fails that request alone.
        """
        if self.retraction is not None and not self.retraction.admits_new():
            return None
        while (req := self._admit_head()) is not None:
            try:
                if self.prefix_reuse is None or self.prefix_reuse.load_request(
                        req, commit=commit_prefix) is not None:
                    return req
                self.admission.requeue(req)  # timed out: row freed, reuse now off
            except Exception as exc:  # contained: this request fails, the worker serves on
                logger.exception("%s: %s prefix load failed", self.name, req.rid)
                self.end(req, "error", f"{self.who}: loading the cached prefix failed "
                         f"({type(exc).__name__}: {exc}); retry the request")
        return None

    def _admit_head(self) -> Request | None:
        """The head of the queue with its row open, or None; a head whose row cannot
        open fails alone (the worker serves on) and the next is tried."""
        while True:
            try:
                return self.admission.admit_next()
            except AdmissionFailed as exc:
                logger.exception("%s: %s", self.name, exc)
                self.end(exc.req, "error", f"{self.who}: {exc}; retry the request")

    def waiting_kv(self, req: Request) -> None:
        """Decode: the prefill was told where the prompt's KV goes."""
        self._move(req, ReqState.WAITING_KV)

    def prefilling(self, req: Request) -> None:
        """Colocated: the prefill engine computes the rest of the prompt."""
        self._move(req, ReqState.PREFILLING)

    # -- decoding --------------------------------------------------------------------------
    def start_decoding(self, req: Request, t_kv_wall: float = 0.0,
                       first_sent: bool = False) -> None:
        """The prompt's KV is committed and ``req.output`` holds the first token: stream
        it (``t_kv_wall``: when the decode held all KV; not when ``first_sent``, the
        colocated worker sent it as soon as it was sampled) and join the batch, or finish
        at once (one token wanted, or the stop token came first)."""
        assert len(req.output) == 1 and req.kv.committed_len == req.prompt_len, req.rid
        self._move(req, ReqState.DECODING)
        if not first_sent:
            self.send(Tokens(req.rid, list(req.output), first=True, t_kv_wall=t_kv_wall))
        if not self.batch.add(req):
            self._finish(req)
        elif self.host_connector is not None:
            self.host_connector.track(req)

    def step(self, step_fn: StepFn | None = None) -> bool:
        """Retract under pressure, then one batch step (by ``step_fn``, default the
        batch's): stream new tokens, finish who is done. True when there was work."""
        if self.retraction is not None and len(self.batch):
            self._relieve()
        if not len(self.batch):
            return False
        try:
            emitted, finished = self.batch.step(step_fn)
        except Exception as exc:  # contained: the batch's requests fail, the worker lives
            logger.exception("%s: a decode step failed", self.name)
            for req in list(self.batch.running.values()):
                self.end(req, "error", f"{self.who}: a decode step failed "
                         f"({type(exc).__name__}: {exc}); retry the request")
            return True
        for req, toks in emitted:
            if toks:
                self.outbox.append((req.rid, toks, False))
        self.flush()
        for req in finished:
            self._finish(req)
        return True

    def emit_first(self, req: Request) -> None:
        """``req``'s first token goes out with this step's tokens (``flush``)."""
        self.outbox.append((req.rid, [req.output[0]], True))

    def flush(self) -> None:
        """Send the step's tokens, every request's in one message."""
        if self.outbox:
            self.send(StepTokens.of(self.outbox))
            self.outbox = []

    def _finish(self, req: Request) -> None:
        reason = req.finish_reason
        self.counts["finished"] += 1
        self.counts["tokens"] += len(req.output)
        self._free_request(req, reason)
        logger.info("%s: %s finished (%s, %d tokens)", self.name, req.rid, reason,
                    len(req.output))

    def stop(self, req: Request) -> None:
        """The router cut the output at a stop string: a decoding request finishes now
        (``stop``, its row freed ``finished``); one whose prompt's KV is still on the way
        (or that is retracted) finishes as soon as it would decode (``start_decoding``,
        ``resume``), so its prefill ends its part as always."""
        req.stopped = True
        if req.state == ReqState.DECODING:
            self._finish(req)

    def end(self, req: Request, reason: str, detail: str = "") -> None:
        """Abort (``aborted``) or failure (any other reason) at any stage."""
        logger.info("%s: %s %s in %s%s", self.name, req.rid, reason, req.state.name,
                    f" ({detail})" if detail else "")
        self.counts[reason if reason in ("aborted", "migrated") else "failed"] += 1
        if reason == "aborted":
            self.aborted_in[req.state.name.lower()] += 1
        self._free_request(req, reason, detail)

    # -- overcommit: retraction under pressure (decode_node/retraction.py) -----------------
    def _relieve(self) -> None:
        """Retract the youngest running requests until the next step fits the pool."""
        for req in self.retraction.relieve():
            self._move(req, ReqState.RETRACTED)  # row freed (offloaded)
            logger.info("%s: %s retracted to the host tier", self.name, req.rid)

    def resume(self) -> None:
        """Bring retracted requests back, oldest first, while their rows fit (call before
        admitting: new requests wait while any is still retracted)."""
        if self.retraction is None or self.retraction.admits_new():
            return
        reqs, failed = self.retraction.resume(self.runner, self.cfg.prefix_load_timeout_s)
        for req in reqs:
            self._move(req, ReqState.DECODING)
            if not self.batch.add(req):   # stopped by the router while retracted
                self._finish(req)
                continue
            logger.info("%s: %s resumed", self.name, req.rid)
        for rid, why in failed.items():
            self.end(self.admission.admitted[rid], "error", f"{self.who} could not reload "
                     f"this request from its host tier after retracting it under memory "
                     f"pressure ({why}); retry it, or give decodes more pages")

    # -- the one writer of states, the one end ---------------------------------------------
    def _move(self, req: Request, state: ReqState) -> None:
        check_transition(req.state, state)
        req.state = state

    def _free_request(self, req: Request, reason: str, detail: str = "") -> None:
        """End ``req`` (``stop``/``length`` finished it, anything else aborted or failed
        it): each part lets go of it, the row is freed once, the router hears ``Done``."""
        ok = reason in ("stop", "length")
        if req.state in (ReqState.WAITING_KV, ReqState.PREFILLING):
            self.stop_prompt(req, reason, detail)                 # transport / prefill
        self.batch.remove(req.rid)                                # batch
        held = False
        if req.kv is not None:
            ranges = finish_ranges(req.kv, self.cache.page_size)
            if self.host_connector is not None:                   # host connector
                held = ok and self.host_connector.request_finished(req, ranges)
                if not ok:
                    self.host_connector.request_aborted(req)
            if not held:                                          # the row, once
                self.cache.free_kv_row(req.kv, ranges, reason=FreeReason.of_end(reason))
                self.cache.close_row(req.kv)
            req.kv = None                                         # held: reap() frees it
        elif self.retraction is not None:
            self.retraction.discard(req)                          # retraction
        self.admission.forget(req)
        self._move(req, ReqState.FINISHED if ok else ReqState.ABORTED
                   if reason == "aborted" else ReqState.FAILED)
        self.flush()  # its last tokens before its Done
        self.send(Done(req.rid, reason, n=len(req.output) if ok else 0, error=detail,
                       cached_tokens=req.num_cached))

    # -- reporting and shutdown ----------------------------------------------------------
    def reap(self) -> None:
        """Free held rows whose host copies completed (every loop)."""
        if self.host_connector is not None:
            self.host_connector.reap()

    def load(self, running: int = 0) -> Load:
        """Load report; ``running`` counts requests the worker runs elsewhere."""
        return Load(self.name, running=len(self.batch) + running,
                    queued=len(self.admission.queue),
                    free_tokens=self.admission.num_free_tokens)

    def stats(self, extra: dict) -> dict:
        """Counters, steps, the worker's ``extra``, speculation and host-tier counters."""
        host = {} if self.host_connector is None else {
            "offloaded_pages": self.offloader.num_offloaded_pages,
            "prefix_hit_pages": self.prefix_reuse.num_hit_pages,
            "prefix_load_timeouts": self.prefix_reuse.num_timeouts,
            "retracted": self.host_connector.num_retracted}
        return {**self.counts, "steps": self.batch.num_steps, **extra,
                **spec_stats(self.step_fn), **host}

    def metric_readings(self) -> list:
        """Speculation, prefix-hit and host-copy counters (metrics)."""
        out = [*spec_readings(getattr(self.step_fn, "stats", None)),
               *abort_readings(self.aborted_in),
               *host_readings(self.offloader, self.cache.layout.page_bytes(
                   self.cache.page_size))]
        if self.prefix_reuse is not None:
            out.append(("pdkv_prefix_hit_pages_total", {}, self.prefix_reuse.num_hit_pages))
        return out

    def abort_all(self, detail: str = "worker shutting down") -> None:
        """End every admitted, then every queued request (``aborted``)."""
        for req in list(self.admission.admitted.values()) + list(
                self.admission.queue.values()):
            self.end(req, "aborted", detail)

    def close(self) -> None:
        """After ``abort_all``: wait for host copies (held rows are freed once every copy
        ended), close the host tier, check and close the device pool."""
        if self.host_connector is not None:
            self.offloader.wait(None, self.cfg.lease_s)
            self.host_connector.reap()
        close_offloader(self.offloader, self.cfg.lease_s)
        self.cache.check_integrity()
        self.cache.close()
