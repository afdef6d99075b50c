"""A step of the lockstep on both sides: rank 0's runner announces each pass
(``LeaderRunner``), a follower's ``Mirror`` applies the step's ops to its own pools and
endpoint, then runs the same pass, answers an agreement or reports its health.

Pins: a rank's KV transport pins its own pages (its sends and receives are its own), so
pin ids differ between ranks; a pin that rank 0 recorded is kept under rank 0's id and
mapped to this rank's (``CacheMirror``, ``HostMirror``)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from common.control import DecodeError, unpack_ids
from common.freelog import log_problems
from common.kv import OutOfPages
from common.model import BatchItem, DevicePlan, HostPlan, ModelRunner, PassPlan, download
from common.node.tp.cache import CacheMirror, LeaderKvCache
from common.node.tp.host import HostMirror
from common.node.tp.lockstep import RankReport, TpKvOp, TpStep, encode_report, read_step
from common.parallel import GroupLost, TpGroup
from transport import RankReceiver, RankSender


class LeaderRunner(ModelRunner):
    """Rank 0's runner: each pass is announced to the followers, then run with them.

    A pass whose token ids come from the device (speculation's draft proposals) reads
    them back first: the followers get every pass's ids over the lockstep, so a
    tensor-parallel step waits for the device once per such pass (a single-device worker
    does not). Each logits computation (``head``) is announced too, with its rows: the
    head's logits are a gather over the ranks, so every rank must take the same rows of
    the same pass, whichever rows a step needs (a prefill's finished prompts, a
    verification's k + 1 positions)."""

    def __init__(self, model, cache: LeaderKvCache, draft=None) -> None:
        # no CUDA graphs: a replay would skip the announce each pass makes
        super().__init__(model, cache, draft, graphs=False)
        self.lockstep = cache.lockstep

    def run(self, pp: PassPlan, dev: DevicePlan, source: torch.Tensor | None = None
            ) -> torch.Tensor:
        ids = pp.host_ids(None if source is None else download(source))
        batch = [BatchItem(it.kv, t, it.start) for it, t in zip(pp.items, ids)]
        self.lockstep.send("forward", batch, pp.draft)
        return super().run(pp, dev, source)

    def head(self, pp: PassPlan, h: torch.Tensor, rows: torch.Tensor | None = None
             ) -> torch.Tensor:
        """The head's logits are gathered from every rank's vocabulary shard: the
        followers compute the same rows of their last pass (read back here, as the
        proposals are)."""
        picked = np.arange(h.shape[0]) if rows is None else download(rows).reshape(-1)
        self.lockstep.send_logits(picked)
        return super().head(pp, h, rows)


Reporter = Callable[[bool], RankReport]
"""Builds this rank's report for a ``health`` step (argument: the final one)."""


class Mirror:
    """A follower's pools, endpoint and runner, driven by the leader's steps.

    Args:
        runner: this rank's runner over its own cache.
        rank: this rank's index in the group.
        endpoint: a disaggregated rank's KV endpoint (``endpoints.py``); None colocated.
        group: the group (agreements and health reports are collectives on it).
        reporter: this rank's ``health`` report; default its free logs' problems only.
        host: this rank's host tier (``HostMirror``); None without offload.

    ``apply`` returns False after the ``stop`` step. A step that does not fit this rank's
    state (a page that is not free here, an unknown row) raises ``GroupLost``: the ranks
    diverged and computing on would write KV into slots still in use.
    """

    def __init__(self, runner: ModelRunner, rank: int,
                 endpoint: RankSender | RankReceiver | None = None,
                 group: TpGroup | None = None, reporter: Reporter | None = None,
                 host: HostMirror | None = None) -> None:
        self.runner, self.cache, self.rank = runner, runner.cache, rank
        self.kv = CacheMirror(runner.cache)
        self.endpoint, self.group, self.host = endpoint, group, host
        self.reporter = reporter or (lambda _final: RankReport(self.log_problems()))
        self._last: tuple[PassPlan, torch.Tensor] | None = None
        """The last pass's plan and hidden states (a "logits" step reads its rows)."""

    @property
    def closed(self) -> bool:
        """Rank 0 closed its pool, and this rank closed its own."""
        return self.kv.closed

    def apply(self, frame: bytes) -> bool:
        try:
            step, ops = read_step(frame)
            for op in ops:
                self._op(op)
        except (DecodeError, ValueError, KeyError, IndexError, AssertionError,
                OutOfPages) as exc:
            raise GroupLost(f"tp rank {self.rank}: step does not fit this rank ({exc})") \
                from exc
        if step.kind == "stop":
            return False
        if step.kind == "forward":
            self._forward(step)
        elif step.kind == "logits":  # rank 0's rows of the last pass (its head's gather)
            if self._last is None:
                raise GroupLost(f"tp rank {self.rank}: logits asked before any pass")
            rows = torch.from_numpy(unpack_ids(step.tokens, "rows").astype(np.int64))
            pp, h = self._last
            self.runner.head(pp, h, rows.to(h.device))
        elif step.kind == "agree":  # same count on every rank: rank 0 sent the rids
            self.group.all_min([self.endpoint.status(rid) if self.endpoint else 1
                                for rid in step.owners])
        elif step.kind == "health":
            self.group.gather_bytes(encode_report(self.reporter(step.final)))
        return True

    def log_problems(self, final: bool = False) -> str:
        """This rank's free logs that cannot write now ("" when they all can); ``final``:
        also those that lost events or never finished writing (what the worker's final
        stats say of its own, ``freelog_problem``)."""
        failing = [h.summary() for h in log_problems() if final or not h.ok]
        return f"tp rank {self.rank}: {'; '.join(failing)}" if failing else ""

    def _forward(self, step: TpStep) -> None:
        ids = unpack_ids(step.tokens, "tokens").tolist()
        items, at = [], 0
        for owner, start, n in zip(step.owners, step.starts, step.lengths):
            items.append(BatchItem(self.kv.rows[owner], ids[at:at + n], start))
            at += n
        host = HostPlan(self.runner.device)
        pp = self.runner.plan(host, items, draft=step.draft)
        dev = host.upload()
        self._last = (pp, self.runner.run(pp, dev))  # its logits: the "logits" steps

    def _op(self, op: TpKvOp) -> None:
        kv = self.kv.row(op)
        if op.op.startswith("x_"):
            if self.endpoint is None:
                raise ValueError(f"transfer op {op.op!r} on a rank without a KV endpoint")
            self.endpoint.apply(op, kv)
        elif op.op.startswith("h_"):
            if self.host is None:
                raise ValueError(f"host op {op.op!r} on a rank without a host tier")
            self.host.apply(op)
        else:
            if op.op == "close":
                self.close_endpoint()  # its pins go before the pool closes
            self.kv.apply(op, kv)
            if op.op == "close_row" and self.endpoint is not None:
                self.endpoint.forget(op.owner)

    def abandon(self) -> None:
        """Rank 0 is gone: stop this rank's transfers, drop its host copies' pins, give
        back every page it holds (reason ``peer_lost``) and close its logs, so they
        replay clean."""
        if self.closed:
            return
        self.close_endpoint()
        if self.host is not None:
            self.host.abandon()
        self.kv.abandon()

    def close_endpoint(self) -> None:
        """Close this rank's KV endpoint (once): Bye to its peers, its pins dropped."""
        endpoint, self.endpoint = self.endpoint, None
        if endpoint is not None:
            endpoint.close()
