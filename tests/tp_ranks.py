"""Bodies of the tensor-parallel model tests, one call per rank (see tests/tp_helpers.py)."""

from __future__ import annotations

import os
import signal
import time

import torch

from common.kv import KvCache
from common.model import (
    BatchItem,
    Model,
    ModelRunner,
    TpModel,
    generate_greedy,
    load_config,
)
from common.parallel import GroupLost, TpGroup
from tests.model_helpers import F64, prompt


def model_checks(rank: int, size: int, address: str, cases: list[tuple[dict, str]]
                 ) -> list[dict]:
    """``_model_check`` of each case, in one group (starting ranks is the slow part)."""
    group = TpGroup.join(rank, size, address, timeout_s=60)
    try:
        return [_model_check(group, *case) for case in cases]
    finally:
        group.close()


def _model_check(group: TpGroup, cfg_overrides: dict, checkpoint: str) -> dict:
    """Dense logits (target and draft), paged greedy tokens, this rank's KV heads and the
    fingerprint, compared on the rank against the single-device model of the same config
    (built-in with ``cfg_overrides``, or the checkpoint directory ``checkpoint``)."""
    cfg = load_config(checkpoint, "float64").with_overrides(num_draft_layers=1) \
        if checkpoint else F64.with_overrides(**cfg_overrides)
    rank, size = group.rank, group.size
    tp, whole = TpModel(cfg, group), Model(cfg)
    ids = [t % cfg.vocab_size for t in prompt(21, seed=3)]
    out = {"rank": rank, "same_fingerprint": tp.fingerprint == whole.fingerprint}
    for draft in (False, True):
        logits = tp.forward_dense(ids, draft=draft)
        if group.is_leader:
            ref = whole.forward_dense(ids, draft=draft)
            out[f"dense_err_{draft}"] = float((logits - ref).abs().max())
        else:
            out[f"dense_shape_{draft}"] = list(logits.shape)
    prompts = [[t % cfg.vocab_size for t in prompt(n, seed=s)]
               for n, s in ((5, 1), (19, 2), (33, 4))]
    out["tokens"] = generate_greedy(tp, prompts, 12, page_size=4)
    out["reference"] = generate_greedy(whole, prompts, 12, page_size=4)
    out["kv_err"] = _kv_heads_error(tp, whole, ids, rank, size)
    return out


def _kv_heads_error(tp: TpModel, whole: Model, ids: list[int], rank: int, size: int) -> float:
    """Prefill ``ids`` on both; this rank's pool must hold exactly the whole model's KV
    heads [rank * KV / size, (rank + 1) * KV / size) (the transport's head split)."""
    pools = []
    for model in (tp, whole):
        cache = KvCache(16, 4, layout=model.config.kv_layout(), max_rows=1)
        kv = cache.open_row("r")
        cache.extend(kv, len(ids))
        ModelRunner(model, cache).forward([BatchItem(kv, ids, 0)])
        pools.append(cache.data()[cache.pages(kv, 0, len(ids))])
    heads = tp.config.num_kv_heads
    mine = pools[1][..., rank * heads:(rank + 1) * heads, :]
    return float((pools[0] - mine).abs().max())


def payloads(rank: int, size: int, address: str) -> dict:
    """broadcast_bytes / gather_bytes / broadcast_ids with sizes that differ by rank."""
    group = TpGroup.join(rank, size, address, timeout_s=60)
    try:
        got = group.broadcast_bytes(7, b"from rank 0" * 100 if rank == 0 else None)
        empty = group.broadcast_bytes(8, b"" if rank == 0 else None)
        gathered = group.gather_bytes(b"x" * (rank * 3))
        ids = group.broadcast_ids([5, 6, 7] if rank == 0 else None, 3)
        return {"got": got.decode(), "empty": empty.decode(), "ids": ids,
                "gathered": None if gathered is None else [g.decode() for g in gathered]}
    finally:
        group.close()


def rank_dies(rank: int, size: int, address: str, how: str) -> str:
    """Rank 1 dies (SIGKILL) or stops answering (``stall``) before an all-reduce; rank 0
    must raise ``GroupLost`` by the group's deadline, never hang."""
    group = TpGroup.join(rank, size, address, timeout_s=3)
    if rank == 1:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(8)  # past rank 0's deadline, then leave without joining the collective
        return "stalled"
    try:
        group.all_reduce(torch.ones(4))
    except GroupLost as exc:
        return f"lost: {exc}"
    finally:
        group.close()
    return "all_reduce returned"


def lonely(rank: int, size: int, address: str) -> str:
    """Rank 0 of a group of 2 whose rank 1 never comes: the rendezvous times out."""
    try:
        TpGroup.join(0, 2, address, timeout_s=2)
    except GroupLost as exc:
        return f"lost: {exc}"
    return "joined"


def late_rank(rank: int, size: int, address: str) -> str:
    """Rank 1 starts 3 s late (a loaded host): the rendezvous (20 s) waits for it although
    the collectives' deadline is 1.5 s; then rank 1 stalls, and rank 0's all-reduce fails
    by the collectives' deadline, not the rendezvous's."""
    if rank == 1:
        time.sleep(3)
    group = TpGroup.join(rank, size, address, timeout_s=1.5, rendezvous_s=20)
    try:
        if rank == 1:
            time.sleep(12)  # past rank 0's deadline, then leave without the collective
            return "stalled"
        t0 = time.monotonic()
        try:
            group.all_reduce(torch.ones(4))
        except GroupLost:
            return f"lost after {time.monotonic() - t0:.1f} s"
        return "all_reduce returned"
    finally:
        group.close()
