"""Helpers for the transport tests: synthetic pools with deterministic patterns, and the
prefill/decode process bodies that the tests start with multiprocessing (spawn)."""

from __future__ import annotations

import numpy as np
import torch

from common import KvCache, KvLayout
from transport import TransportConfig


def layout(total_heads: int = 4, tp_size: int = 1, dtype: str = "float32") -> KvLayout:
    """A small layout with a draft layer; ``num_kv_heads`` is the heads of one rank."""
    return KvLayout(num_layers=2, num_draft_layers=1, num_kv_heads=total_heads // tp_size,
                    head_dim=8, dtype=dtype)


def make_cache(num_pages: int, page_size: int, lay: KvLayout, log_path=None,
               node: str = "node", shared: bool = False, device: str = "cpu") -> KvCache:
    """``shared``: the pool lives in shared memory (a decode offering the shm data path)."""
    return KvCache(num_pages, page_size, layout=lay, log_path=log_path, node=node,
                   max_rows=64, shared_memory=shared, device=device)


def pattern(seed: int, num_tokens: int, lay: KvLayout, head_start: int,
            num_heads: int) -> torch.Tensor:
    """Deterministic KV of positions ``[0, num_tokens)`` for global heads
    ``[head_start, head_start + num_heads)``: ``[tokens, layers, 2, heads, head_dim]``."""
    pos = np.arange(num_tokens).reshape(-1, 1, 1, 1, 1)
    layer = np.arange(lay.total_layers).reshape(1, -1, 1, 1, 1)
    kv = np.arange(2).reshape(1, 1, -1, 1, 1)
    head = (head_start + np.arange(num_heads)).reshape(1, 1, 1, -1, 1)
    dim = np.arange(lay.head_dim).reshape(1, 1, 1, 1, -1)
    val = (seed * 7919 + pos * 131 + layer * 17 + kv * 5 + head * 3 + dim * 7) % 65521
    return torch.from_numpy(val.astype(np.float64)).to(lay.torch_dtype)


def write_row(cache: KvCache, kv, values: torch.Tensor, start: int = 0) -> None:
    """Write ``values`` ([tokens, layers, 2, heads, dim]) at row positions start..."""
    data = cache.data()
    slots = torch.as_tensor(cache.slots(kv, start, start + values.shape[0]),
                            device=data.device)
    ps = cache.page_size
    data[slots // ps, :, :, slots % ps] = values.to(data.device)


def read_row(cache: KvCache, kv, start: int, end: int) -> torch.Tensor:
    """Row positions ``[start, end)`` as a CPU tensor ``[tokens, layers, 2, heads, dim]``."""
    data = cache.data()
    slots = torch.as_tensor(cache.slots(kv, start, end), device=data.device)
    ps = cache.page_size
    return data[slots // ps, :, :, slots % ps].cpu()


def config(node: str, rank: int = 0, size: int = 1, **kw) -> TransportConfig:
    """Short leases and deadlines so failure tests stay fast."""
    base = dict(heartbeat_s=0.1, lease_s=1.0, handshake_timeout_s=5.0,
                admission_timeout_s=5.0, chunk_timeout_s=5.0, done_timeout_s=20.0)
    base.update(kw)
    return TransportConfig(node=node, tp_rank=rank, tp_size=size, **base)


# -- scenario drivers: the same code runs in the test process or in a spawned child ------
# A plan is a plain dict (it crosses to the child through multiprocessing, never the wire):
#   {"total_heads": 4, "page_size": 4, "num_pages": 128, "prefill_tp": 1, "decode_tp": 1,
#    "requests": {rid: {"prompt_len": int, "seed": int, "chunks": [int, ...],
#                       "cached": int, "first_token": int}},
#    "prefill_abort_after": {rid: chunks}, "prefill_stall_after": {rid: chunks},
#    "decode_abort_after_frames": {rid: 1}, "chunk_delay_s": float,
#    "shm": bool (decode pools in shared memory, so a same-host prefill writes into them),
#    "prefill_device", "decode_device": where each side's pools live (default "cpu")}

def _pattern_for_rank(plan: dict, rid: str, lay: KvLayout, size: int, rank: int):
    req = plan["requests"][rid]
    per = plan["total_heads"] // size
    return pattern(req["seed"], req["prompt_len"], lay, rank * per, per)


class PrefillDriver:
    """Every prefill rank of one TP group, stepped from one loop."""

    def __init__(self, plan: dict, log_dir: str | None, addresses: list[str], **cfg_kw):
        from transport import KvSender
        self.plan, size = plan, plan["prefill_tp"]
        self.lay = layout(plan["total_heads"], size)
        self.caches, self.senders, self.rows = [], [], [{} for _ in range(size)]
        for rank in range(size):
            log = None if log_dir is None else f"{log_dir}/prefill{rank}.log"
            cache = make_cache(plan["num_pages"], plan["page_size"], self.lay, log,
                               f"prefill{rank}", device=plan.get("prefill_device", "cpu"))
            self.caches.append(cache)
            self.senders.append(KvSender(cache, addresses[rank],
                                         config(f"prefill{rank}", rank, size, **cfg_kw)))
        self.addresses = [s.address for s in self.senders]
        self.progress: dict[str, int] = {}   # rid -> chunks sent
        self.ready: set[str] = set()
        self.final: dict[str, list] = {}     # rid -> [(rank, kind, reason)]
        self.initial_free = [c.num_free_pages() for c in self.caches]

    def _start(self, rank: int, rid: str) -> None:
        cache, req = self.caches[rank], self.plan["requests"][rid]
        kv = cache.open_row(rid)
        cache.extend(kv, req["prompt_len"])
        write_row(cache, kv, _pattern_for_rank(self.plan, rid, self.lay,
                                               self.plan["prefill_tp"], rank))
        self.rows[rank][rid] = kv

    def step(self, timeout_s: float = 0.002) -> None:
        for rank, sender in enumerate(self.senders):
            for ev in sender.poll(timeout_s):
                self._on_event(rank, ev)
        for rid in sorted(self.ready):
            self._send_next(rid)

    def _on_event(self, rank: int, ev) -> None:
        from transport import EventKind
        if ev.kind == EventKind.READY:
            self._start(rank, ev.rid)
            if all(ev.rid in rows for rows in self.rows):
                self.ready.add(ev.rid)
                self.progress[ev.rid] = 0
        elif ev.kind.is_final:
            self.final.setdefault(ev.rid, []).append((rank, ev.kind.name, ev.reason))
            self._free(rank, ev.rid, ev.reason or "sent")
            self.ready.discard(ev.rid)

    def _free(self, rank: int, rid: str, reason: str) -> None:
        kv = self.rows[rank].pop(rid, None)
        if kv is not None:
            self.caches[rank].free_kv_row(kv, [(0, kv.allocated_len)], reason=reason)
            self.caches[rank].close_row(kv)

    def _send_next(self, rid: str) -> None:
        import time
        plan, req, k = self.plan, self.plan["requests"][rid], self.progress[rid]
        if k >= plan.get("prefill_stall_after", {}).get(rid, 1 << 30):
            return
        if k == plan.get("prefill_abort_after", {}).get(rid, -1):
            for rank, sender in enumerate(self.senders):
                sender.abort(rid, detail="test abort")
                self.final.setdefault(rid, []).append((rank, "LOCAL_ABORT", "aborted"))
                self._free(rank, rid, "aborted")
            self.ready.discard(rid)
            return
        chunks = req["chunks"]
        upto = min(sum(chunks[:k + 1]), req["prompt_len"])
        for rank, sender in enumerate(self.senders):
            if k + 1 >= len(chunks):
                sender.finish(rid, self.rows[rank][rid], req["first_token"])
            else:
                sender.send(rid, self.rows[rank][rid], upto)
        self.progress[rid] = k + 1
        if k + 1 >= len(chunks):
            self.ready.discard(rid)
        time.sleep(plan.get("chunk_delay_s", 0.0))

    def settled(self) -> bool:
        return all(not s.transfers for s in self.senders) and all(
            len(self.final.get(rid, [])) >= len(self.senders) for rid in self.plan["requests"])

    def close(self) -> dict:
        report = {"stats": [dict(s.stats) for s in self.senders], "final": self.final,
                  "leaked": [c.num_free_pages() - f for c, f in
                             zip(self.caches, self.initial_free)]}
        for sender in self.senders:
            sender.close()
        for cache in self.caches:
            cache.check_integrity()
            cache.close()
        return report


def prefill_child(plan: dict, log_dir: str | None, addresses: list[str], queue,
                  cfg_kw: dict, run_s: float = 30.0) -> None:
    """Body of a spawned prefill process: report addresses, serve, report the outcome."""
    import time
    drv = PrefillDriver(plan, log_dir, addresses, **cfg_kw)
    queue.put(drv.addresses)
    deadline = time.monotonic() + run_s
    while not drv.settled() and time.monotonic() < deadline:
        drv.step()
    queue.put(drv.close())


class DecodeDriver:
    """Every decode rank of one TP group, stepped from one loop."""

    def __init__(self, plan: dict, log_dir: str | None, addresses: list[str], **cfg_kw):
        from transport import KvReceiver
        self.plan, size = plan, plan["decode_tp"]
        self.lay = layout(plan["total_heads"], size)
        self.caches, self.receivers, self.rows = [], [], [{} for _ in range(size)]
        for rank in range(size):
            log = None if log_dir is None else f"{log_dir}/decode{rank}.log"
            self.caches.append(make_cache(plan["num_pages"], plan["page_size"], self.lay,
                                          log, f"decode{rank}", plan.get("shm", False),
                                          plan.get("decode_device", "cpu")))
            rx = KvReceiver(self.caches[rank], config(f"decode{rank}", rank, size, **cfg_kw))
            rx.connect(addresses)
            self.receivers.append(rx)
        self.initial_free = [c.num_free_pages() for c in self.caches]
        self.final: dict[str, list] = {}
        self.correct: dict[str, bool] = {}
        self.aborted: set[str] = set()

    def announce_all(self) -> None:
        for rank, rx in enumerate(self.receivers):
            cache = self.caches[rank]
            for rid, req in self.plan["requests"].items():
                kv = cache.open_row(rid)
                cache.extend(kv, req["prompt_len"])
                self.rows[rank][rid] = kv
                rx.announce(rid, kv, req["prompt_len"], req.get("cached", 0))

    def step(self, timeout_s: float = 0.002) -> None:
        for rank, rx in enumerate(self.receivers):
            for ev in rx.poll(timeout_s):
                self._on_event(rank, ev)
            self._maybe_abort(rank, rx)

    def _maybe_abort(self, rank: int, rx) -> None:
        for rid, frames in self.plan.get("decode_abort_after_frames", {}).items():
            inc = rx.transfers.get(rid)
            if inc is None or (rank, rid) in self.aborted:
                continue
            if sum(leg.blocks_received > 0 for leg in inc.legs.values()) >= frames:
                rx.abort(rid, detail="test abort")
                self.aborted.add((rank, rid))
                self.final.setdefault(rid, []).append((rank, "LOCAL_ABORT", "aborted"))
                self._free(rank, rid, "aborted")

    def _on_event(self, rank: int, ev) -> None:
        from transport import EventKind
        if not ev.kind.is_final:
            return
        self.final.setdefault(ev.rid, []).append((rank, ev.kind.name, ev.reason,
                                                  ev.first_token))
        if ev.kind == EventKind.COMPLETED:
            self._verify(rank, ev.rid)
            self._free(rank, ev.rid, "finished")
        else:
            self._free(rank, ev.rid, ev.reason)

    def _verify(self, rank: int, rid: str) -> None:
        req = self.plan["requests"][rid]
        cached = req.get("cached", 0)
        want = _pattern_for_rank(self.plan, rid, self.lay, self.plan["decode_tp"], rank)
        got = read_row(self.caches[rank], self.rows[rank][rid], cached, req["prompt_len"])
        ok = torch.equal(got, want[cached:])
        if cached:  # the transport must not have written the cached prefix
            head = read_row(self.caches[rank], self.rows[rank][rid], 0, cached)
            ok = ok and not head.any()
        self.correct[f"{rid}@{rank}"] = bool(ok)

    def _free(self, rank: int, rid: str, reason: str) -> None:
        kv = self.rows[rank].pop(rid, None)
        if kv is not None:
            self.caches[rank].free_kv_row(kv, [(0, kv.allocated_len)], reason=reason)
            self.caches[rank].close_row(kv)

    def settled(self) -> bool:
        return all(not rx.transfers for rx in self.receivers) and all(
            len(self.final.get(rid, [])) >= len(self.receivers)
            for rid in self.plan["requests"])

    def run(self, seconds: float) -> None:
        import time
        deadline = time.monotonic() + seconds
        while not self.settled() and time.monotonic() < deadline:
            self.step()

    def close(self) -> dict:
        report = {"stats": [dict(rx.stats) for rx in self.receivers], "final": self.final,
                  "correct": self.correct,
                  "leaked": [c.num_free_pages() - f for c, f in
                             zip(self.caches, self.initial_free)]}
        for rx in self.receivers:
            rx.close()
        for cache in self.caches:
            cache.check_integrity()
            cache.close()
        return report


def decode_child(plan: dict, log_dir: str | None, addresses: list[str], queue,
                 cfg_kw: dict, run_s: float = 30.0) -> None:
    """Body of a spawned decode process."""
    drv = DecodeDriver(plan, log_dir, addresses, **cfg_kw)
    drv.announce_all()
    queue.put("announced")
    drv.run(run_s)
    queue.put(drv.close())
