"""Tensor-parallel workers in lockstep: rank 0 decides, the other ranks repeat.

Rank 0 (the leader) is the whole worker: it registers with the router, schedules,
allocates, samples. Ranks 1.. (followers) hold their shard of the model (``TpModel``) and
a ``KvCache`` of their own (their KV heads, their own free log) and run no scheduler.
Before each forward pass the leader broadcasts one ``TpStep``: every change it made to
its pools since the last step (``TpKvOp``: rows opened, extended, committed, freed,
pinned, ...; ``cache.py``, ``host.py``), every call that starts or stops a transfer
(``x_*``, ``transport.group``) and the pass itself (which rows, from which position,
which tokens). A follower (``mirror.py``) applies the ops to its own pools, taking the
page ids rank 0 chose (a page that is not free on its rank raises ``GroupLost`` at once
instead of computing over slots still in use), then runs the same pass; the passes'
all-reduces pair up because every rank runs them in the same order.

Nothing exchanged is sized by a rank's own state: the step is one ``broadcast_bytes``
(a fixed header announcing the size, then the bytes), sent by rank 0 only. Sampling
happens on rank 0 alone; its tokens reach the followers as the next step's input.

An idle leader sends an empty step every quarter of the group's deadline
(``keepalive``), so a follower's wait is bounded both ways: a follower that hears nothing
for the deadline knows rank 0 is gone, and rank 0 learns of a dead follower at its next
broadcast or all-reduce.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import msgpack
import numpy as np
import torch

from common.control import Codec, DecodeError, pack_ids
from common.model import BatchItem
from common.parallel import GroupLost, TpGroup

logger = logging.getLogger(__name__)

TAG_CONFIG = 0x7C0F
TAG_STEP = 0x7C57


@dataclass(frozen=True)
class TpKvOp:
    """One change the leader made to its cache, in the order it made them."""

    op: str
    """open, extend, commit, close_row, free, evict, handoff, free_pages, pin, pin_pages,
    unpin or close; ``x_*`` a transfer op, ``h_*`` a host-tier op (``common.node.tp.host``)."""
    owner: str = ""
    counters: list[int] = field(default_factory=list)
    """The row's counters before the op (allocated, committed, swa floor, protected): the
    caller may have set them directly (free_kv_row leaves them to it)."""
    n: int = 0
    m: int = 0
    ranges: list[int] = field(default_factory=list)
    """free: flat [start0, end0, start1, end1, ...]."""
    pages: bytes = b""
    """extend: the new pages; pin/free_pages/pin_pages: the pages (int32 bytes); h_copy:
    the source pages, then the destination's."""
    text: str = ""
    """free/free_pages: reason; handoff: new owner; pin: reason."""
    pool: str = "full"
    retained: list[str] = field(default_factory=list)
    detail: str = ""
    """Transfer ops (``x_*``, see ``Lockstep.record_transfer``): an abort's detail, an
    announce's prefill addresses."""


@dataclass(frozen=True)
class TpStep:
    """What every follower does next: apply ``ops``, then run ``kind``."""

    kind: str
    """idle (ops only), forward (a pass: the followers run it and keep its hidden states),
    logits (``tokens``: rows of the last pass; the head's gather), agree (``owners``: the
    rids asked about), health (each rank's ``RankReport`` asked for) or stop."""
    ops: list[bytes] = field(default_factory=list)
    draft: bool = False
    owners: list[str] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    tokens: bytes = b""
    final: bool = False
    """health: the last one (the pools closed); the report carries the rank's stats."""


@dataclass(frozen=True)
class RankReport:
    """What a follower tells rank 0 at every heartbeat (the ``health`` step)."""

    problems: str = ""
    """Its free logs that cannot write now ("" when they all can)."""
    metrics: bytes = b""
    """Its metric families (``common.metrics.pack``): its pool, its KV transport."""
    stats: dict[str, float] = field(default_factory=dict)
    """Final step only: its final counters (the worker's ``Stats`` under ``tp<r>.``)."""


MAX_REPORT_BYTES = 1 << 20
"""A follower's report is at most this (its metrics are left out past it): the gather's
payload is bounded by the protocol, not by what a rank happens to hold."""

CODEC = Codec(TpKvOp, TpStep, max_bytes=256 << 20)
OP_CODEC = Codec(TpKvOp)
REPORT_CODEC = Codec(RankReport, max_bytes=MAX_REPORT_BYTES)
_OP_FIELDS = [(f.name, f.default_factory() if callable(f.default_factory) else f.default)
              for f in fields(TpKvOp)]


def encode_op(op: TpKvOp) -> bytes:
    """``OP_CODEC.encode`` without the fields left at their defaults (most of an op's),
    which ``OP_CODEC.decode`` fills in: a third less to decode on every follower, for
    every op of every step."""
    body = {"t": "TpKvOp", "op": op.op}
    for name, default in _OP_FIELDS[1:]:
        value = getattr(op, name)
        if value != default:
            body[name] = value
    return msgpack.packb(body, use_bin_type=True)


class Lockstep:
    """The leader's side: collects ops, broadcasts steps, keeps followers alive.

    After the first failed collective the group is lost for good: every later call raises
    ``GroupLost`` at once (the worker ends its requests and exits; it never waits twice).
    """

    def __init__(self, group: TpGroup) -> None:
        self.group = group
        self.lost: GroupLost | None = None
        self._ops: list[bytes] = []
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._urgent = False  # transfer ops wait: send them even when idle

    def record(self, op: TpKvOp) -> None:
        if self.lost is None:
            self._ops.append(encode_op(op))

    def send(self, step_kind: str, batch: Sequence[BatchItem] = (), draft: bool = False
             ) -> None:
        """Broadcast the ops so far and the next pass (``batch``) to every follower."""
        self._exchange(lambda ops: TpStep(
            step_kind, ops, draft, [b.kv.owner for b in batch], [b.start for b in batch],
            [b.num_tokens for b in batch],
            pack_ids(np.concatenate([_ids(b.token_ids) for b in batch])) if batch else b""))

    def send_logits(self, rows: np.ndarray) -> None:
        """Every follower computes its head's shard of logits of ``rows`` of its last
        pass's hidden states (rank 0 gathers them: ``TpModel.logits``)."""
        self._exchange(lambda ops: TpStep("logits", ops, tokens=pack_ids(rows)))

    def record_transfer(self, op: str, rid: str, **fields) -> None:
        """A transfer op (``x_expect``, ``x_send``, ``x_finish``, ``x_announce``,
        ``x_abort``): each follower repeats it on its own KV endpoint (``RankSender``,
        ``RankReceiver``), after the cache ops recorded before it."""
        self.record(TpKvOp(op, rid, **fields))
        self._urgent = True

    def agree(self, rids: Sequence[str], mine: Sequence[int]) -> list[int]:
        """Ask every rank for its status of each of ``rids`` (rank 0's is ``mine``); returns
        the minimum over the ranks, rid by rid. The count travels in the step first, so
        every rank's all-reduce has the same shape (a follower's endpoint gives its own
        ``status``)."""
        return self._exchange(lambda ops: TpStep("agree", ops, owners=list(rids)),
                              lambda: self.group.all_min(list(mine)))

    def health(self, final: bool = False) -> list[RankReport]:
        """Each follower's ``RankReport`` (free-log problems, metrics; ``final``: stats
        too), in rank order: the step says what is asked, then one gather (sizes first:
        every rank knows the shape; each payload at most ``MAX_REPORT_BYTES``). Rank 0
        pauses admission on the problems as on its own and reports the metrics labelled
        by rank (``WorkerBase``). A report that does not decode counts as a problem."""
        got = self._exchange(lambda ops: TpStep("health", ops, final=final),
                             lambda: self.group.gather_bytes(b""))
        return [_report(rank, raw) for rank, raw in enumerate(got[1:], 1)]

    def _exchange(self, step: Callable[[list[bytes]], TpStep],
                  answer: Callable[[], Any] | None = None) -> Any:
        """Broadcast the step ``step`` builds around the ops so far, then the collective
        every rank answers it with (``answer``); its result. The first failure loses the
        group for good."""
        if self.lost is not None:
            raise GroupLost(f"tp group already lost: {self.lost}")
        with self._lock:
            ops, self._ops, self._urgent = self._ops, [], False
        try:
            self.group.broadcast_bytes(TAG_STEP, CODEC.encode(step(ops)))
            got = answer() if answer is not None else None
        except GroupLost as exc:
            self.lost = exc
            raise
        self._last = time.monotonic()
        return got

    def keepalive(self) -> None:
        """Called after every tick: the ops recorded since the last step go out at once
        (a follower's transfer must not wait for rank 0's next pass), and an idle leader
        sends an empty step once a quarter of the deadline passed."""
        if self._urgent or time.monotonic() - self._last > self.group.timeout_s / 4:
            self.send("idle")

    def stop(self) -> None:
        """Last step (after the cache's close): followers close their caches and exit."""
        if self.lost is None:
            try:
                self.send("stop")
            except GroupLost:
                logger.warning("tp: a follower was gone at shutdown")
        self.group.close()


def read_step(frame: bytes) -> tuple[TpStep, list[TpKvOp]]:
    """A step as a follower receives it, and its ops in order.

    Raises:
        DecodeError: the frame or an op does not decode.
    """
    step = CODEC.decode(frame)
    return step, [OP_CODEC.decode(raw) for raw in step.ops]


def _report(rank: int, raw: bytes) -> RankReport:
    try:
        return REPORT_CODEC.decode(raw)
    except DecodeError as exc:
        return RankReport(problems=f"tp rank {rank}: its report does not decode ({exc})")


def encode_report(report: RankReport) -> bytes:
    """A follower's report as it travels; its metrics are dropped when they would make
    it larger than ``MAX_REPORT_BYTES`` (said in ``problems``, never a failed gather)."""
    raw = REPORT_CODEC.encode(report)
    if len(raw) <= MAX_REPORT_BYTES:
        return raw
    logger.warning("tp: a rank's metrics are %d bytes, more than %d: not reported",
                   len(report.metrics), MAX_REPORT_BYTES)
    return REPORT_CODEC.encode(RankReport(report.problems, b"", report.stats))


def _ids(token_ids) -> np.ndarray:
    if isinstance(token_ids, torch.Tensor):
        return token_ids.cpu().numpy().astype(np.int32)
    return np.asarray(token_ids, dtype=np.int32)
