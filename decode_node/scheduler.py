"""The decode side of a worker: admission, the continuous batch and the host tier.

Shared by the decode worker (prompt KV arrives from a prefill) and the colocated worker
(prompt KV is prefilled in-process). Both admit through ``Admission``, decode in a
``DecodeBatch`` with the configured ``StepFn`` and, with offload on, cache prefixes on
the host tier through a ``HostConnector``. The worker keeps what differs (receiving KV
and retraction, or the prefill engine) and calls in here for the rest of a request's life.

Who frees what: ``finish`` frees a finished row (``finished``) or hands it to the host
connector, which frees it in ``reap`` once its copies end; ``end`` frees at once with the
failure's reason; ``close`` waits for host copies, reaps and closes both pools after the
worker ended every request (``abort_all``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from common.config import ServeConfig
from common.host import close_offloader, host_salt, make_offloader
from common.kv import KvCache
from common.metrics import host_readings, spec_readings
from common.model import ModelRunner
from common.node import Done, Load, Message, Tokens
from common.request import ReqState
from decode_node.admission import Admission, WorkItem
from decode_node.batch import DecodeBatch, DecodeSeq, finish_ranges
from decode_node.host_connector import HostConnector
from decode_node.speculative import make_step, spec_stats

Send = Callable[[Message], None]
"""Sends one message to the router."""

EndFn = Callable[[WorkItem, str, str], None]
"""A worker's ``_end(item, reason, detail)``."""


class DecodeSide:
    """Admission, batch and host connector of one worker, and the decode-side steps of a
    request's life (prefix load, start decoding, finish, end).

    Args:
        name: the worker's name (logs).
        cfg: the serving config.
        cache: the worker's device pool; ``runner`` runs the model over it.
        send: sends a message to the router.
        device, log_dir: where the host tier lives and logs (``make_offloader``).
        log: the worker's logger (its records keep the worker's logger name).
        who: how error messages to the client name the worker (``"decode d0"``).
        instead: what the worker does with the prompt when no prefix was loaded
            (``"receiving"`` or ``"computing"``; logs only).
        whole_life: reserve each request's whole life (False: overcommit).
    """

    def __init__(self, name: str, cfg: ServeConfig, cache: KvCache, runner: ModelRunner,
                 send: Send, *, device: str, log_dir: str | None, log: logging.Logger,
                 who: str, instead: str, whole_life: bool = True) -> None:
        self.name, self.cfg, self.cache, self.send, self.log = name, cfg, cache, send, log
        self.who, self.instead = who, instead
        self.admission = Admission(cache, cfg.max_running, whole_life=whole_life)
        self.off = make_offloader(cfg, cache, device, log_dir, name)
        self.conn = HostConnector(self.off, host_salt(cfg, cache)) if self.off else None
        self.step_fn = make_step(cfg)
        self.batch = DecodeBatch(runner, self.step_fn,
                                 on_commit=self.conn.on_commit if self.conn else None)
        self.counts = {"finished": 0, "aborted": 0, "failed": 0, "tokens": 0,
                       "prefix_load_timeouts": 0}

    # -- admission: the cached prefix ----------------------------------------------------
    def load_prefix(self, item: WorkItem, commit: bool) -> int | None:
        """Fill the admitted row's first pages from the host tier's prefix cache
        (blocking); ``commit`` commits them too.

        Returns:
            Prompt tokens loaded (page-aligned; 0 on a miss, a failed copy or no host
            tier), or None when the item left: a load past ``prefix_load_timeout_s``
            freed the row (``timeout``; the load's pins keep its pages out of reuse until
            the copy ends) and requeued it at the head without reuse, or an unexpected
            error ended it (``error``; contained, the worker serves on).
        """
        try:
            return self._load(item, commit)
        except TimeoutError as exc:
            self._requeue_without_prefix(item, exc)
        except Exception as exc:  # contained: this request fails, the worker serves on
            self.log.exception("%s: %s prefix load failed", self.name, item.rid)
            self.end(item, "error", f"{self.who}: loading the cached prefix failed "
                     f"({type(exc).__name__}: {exc}); retry the request")
        return None

    def _load(self, item: WorkItem, commit: bool) -> int:
        """``load_prefix`` without containment; raises TimeoutError past the timeout."""
        if self.conn is None or item.extra.get("no_reuse"):
            return 0
        handle = self.conn.prepare_load(item.kv, item.prompt)
        if handle is None:
            return 0
        timeout = self.cfg.prefix_load_timeout_s
        try:
            if not self.conn.complete_load(handle, timeout):
                raise TimeoutError(f"{item.rid}: prefix load not done in {timeout} s")
        except RuntimeError as exc:  # the copy failed and ended: do the whole prompt
            self.log.warning("%s: %s prefix load failed (%s); %s it all", self.name,
                             item.rid, exc, self.instead)
            return 0
        if commit:
            self.cache.commit(item.kv, handle.num_tokens)
        return handle.num_tokens

    def _requeue_without_prefix(self, item: WorkItem, exc: Exception) -> None:
        """Free the row (``timeout``) and queue the request again at the head, reuse off,
        so it gets its whole prompt in a new row."""
        self.log.warning("%s: %s; %s the whole prompt instead", self.name, exc, self.instead)
        self.counts["prefix_load_timeouts"] += 1
        self.admission.release(item, [(0, item.kv.allocated_len)], "timeout")
        item.state, item.extra["no_reuse"] = ReqState.QUEUED, True
        self.admission.requeue(item)

    # -- decoding ------------------------------------------------------------------------
    def start_decoding(self, item: WorkItem, first_token: int, t_kv_wall: float = 0.0
                       ) -> DecodeSeq | None:
        """Stream the first token (``t_kv_wall``: when the decode held all KV) and join
        the batch; the prompt's KV must be committed.

        Returns:
            The sequence when it is already done (one token wanted, or the stop token
            came first): the caller finishes it. None when it joined the batch.
        """
        item.state = ReqState.DECODING
        seq = DecodeSeq(item.rid, item.kv, item.params, len(item.prompt), [first_token],
                        item.prompt)
        self.send(Tokens(item.rid, [first_token], first=True, t_kv_wall=t_kv_wall))
        if not self.batch.add(seq):
            return seq
        if self.conn is not None:
            self.conn.track(seq, item.prompt)
        return None

    def step(self) -> list[tuple[WorkItem, DecodeSeq]]:
        """One batch step: stream new tokens; returns the finished requests (the caller
        finishes each)."""
        emitted, finished = self.batch.step()
        for seq, toks in emitted:
            if toks:
                self.send(Tokens(seq.rid, toks))
        return [(self.admission.admitted[seq.rid], seq) for seq in finished]

    def finish(self, item: WorkItem, seq: DecodeSeq) -> str:
        """Free the row (or hand it to the host connector while copies are in flight),
        send ``done``; returns the finish reason (``stop`` or ``length``)."""
        output = seq.output
        reason = "stop" if output and item.params.is_stop(output[-1]) else "length"
        self.counts["finished"] += 1
        self.counts["tokens"] += len(output)
        ranges = finish_ranges(item.kv, self.cache.page_size)
        if self.conn is not None and self.conn.request_finished(seq, ranges):
            self.admission.forget(item)  # the connector frees it in reap()
        else:
            self.admission.release(item, ranges, "finished")
        self.send(Done(item.rid, reason, n=len(output)))
        return reason

    def end(self, item: WorkItem, reason: str, detail: str = "") -> None:
        """Abort or failure at any stage: free what is held (reason for the free log:
        ``_free_reason``), forget the request, tell the router."""
        self.log.info("%s: %s %s in %s%s", self.name, item.rid, reason, item.state.name,
                      f" ({detail})" if detail else "")
        self.batch.remove(item.rid)
        item.state = ReqState.ABORTED if reason == "aborted" else ReqState.FAILED
        self.counts["aborted" if reason == "aborted" else "failed"] += 1
        if item.kv is not None:
            self.admission.release(item, finish_ranges(item.kv, self.cache.page_size),
                                   _free_reason(reason))
        else:
            self.admission.release(item, [], reason)
        if self.conn is not None:
            self.conn.request_aborted(item.rid)
        self.forget_step(item.rid)
        self.send(Done(item.rid, reason, error=detail))

    def forget_step(self, rid: str) -> None:
        """Drop the step's per-request state (speculation), if it keeps any."""
        if hasattr(self.step_fn, "forget"):
            self.step_fn.forget(rid)

    # -- reporting and shutdown ----------------------------------------------------------
    def reap(self) -> None:
        """Free held rows whose host copies completed (every loop)."""
        if self.conn is not None:
            self.conn.reap()

    def load(self, running: int = 0) -> Load:
        """Load report; ``running`` counts requests the worker runs elsewhere."""
        return Load(self.name, running=len(self.batch) + running,
                    queued=len(self.admission.queue),
                    free_tokens=self.admission.num_free_tokens)

    def stats(self, extra: dict) -> dict:
        """Counters, steps, the worker's ``extra``, speculation and host-tier counters."""
        host = {} if self.conn is None else {
            "offloaded_pages": self.off.num_offloaded_pages,
            "prefix_hit_pages": self.conn.num_prefix_hit_pages,
            "retracted": self.conn.num_retracted}
        return {**self.counts, "steps": self.batch.num_steps, **extra,
                **spec_stats(self.step_fn), **host}

    def abort_all(self, end: EndFn) -> None:
        """Shutdown: ``end`` every admitted, then every queued request (``aborted``)."""
        for item in list(self.admission.admitted.values()) + list(
                self.admission.queue.values()):
            end(item, "aborted", "worker shutting down")

    def close(self) -> None:
        """After ``abort_all``: wait for host copies (held rows are freed once every copy
        ended), close the host tier, check and close the device pool."""
        if self.conn is not None:
            self.off.wait(None, self.cfg.lease_s)
            self.conn.reap()
        close_offloader(self.off, self.cfg.lease_s)
        self.cache.check_integrity()
        self.cache.close()


def side_readings(side: DecodeSide) -> list:
    """Speculation, prefix-hit and host-copy counters of a decode side (metrics)."""
    out = [*spec_readings(getattr(side.step_fn, "stats", None)),
           *host_readings(side.off, side.cache.layout.page_bytes(side.cache.page_size))]
    if side.conn is not None:
        out.append(("pdkv_prefix_hit_pages_total", {}, side.conn.num_prefix_hit_pages))
    return out


def _free_reason(reason: str) -> str:
    """Free-log reasons are a closed set (DESIGN.md section 4)."""
    allowed = {"finished", "aborted", "timeout", "peer_lost", "error"}
    return reason if reason in allowed else "error"
