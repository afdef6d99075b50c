"""What the transfer benches share: the KV layout they move, pools, the receiving loop,
the memcpy ceiling, and the sender's pump (``benchmarks.transfer`` measures ZMQ frames and
shared memory with it, ``benchmarks.nixl_transfer`` NIXL)."""

from __future__ import annotations

import time

import numpy as np
import torch

from common import KvCache, KvLayout
from transport import EventKind, KvReceiver, KvSender

LAYOUT = KvLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16")
PAGE = 16
CFG = dict(heartbeat_s=1.0, lease_s=30.0, chunk_timeout_s=60.0, done_timeout_s=600.0)


def repeats_for(tokens: int, repeats: int) -> int:
    """Runs per figure at ``tokens``: ``repeats`` from 8k tokens up, proportionally more
    below. A 1k request moves in 40-70 ms, a few scheduler slices, and the median of five
    spread from run to run with the machine's noise (paired 0.82-0.96x at 1k in seven runs
    of 2026-12-04) while 8k stayed within 0.89-0.98x."""
    return repeats * max(1, 8192 // tokens)


def cache(tokens: int, node: str, shared: bool = False, device: str = "cpu") -> KvCache:
    return KvCache(tokens // PAGE + 2, PAGE, layout=LAYOUT, node=node, max_rows=4,
                   shared_memory=shared, device=device)


def host_bytes(cache: KvCache) -> np.ndarray:
    """The pool's bytes in host memory: a view of a CPU pool, a copy of a device one."""
    data = cache.data() if cache.device.type == "cpu" else cache.data().cpu()
    return data.view(torch.uint8).numpy().reshape(-1)


def pool_rounds(tokens: int, pool_tokens: int) -> tuple[int, int]:
    per = min(tokens, pool_tokens)
    return per, max(1, tokens // per)


def receive(rx: KvReceiver, cache: KvCache, tokens: int, repeat: int,
             pool_tokens: int) -> float:
    per, rounds = pool_rounds(tokens, pool_tokens)
    t0 = time.monotonic()
    for i in range(rounds):
        rid = f"{tokens}-{repeat}-{i}"
        kv = cache.open_row(rid)
        cache.extend(kv, per)
        rx.announce(rid, kv, per)
        while not any(e.kind.is_final for e in rx.poll(0.01) if e.rid == rid):
            pass
        cache.free_kv_row(kv, [(0, per)], reason="finished")
        cache.close_row(kv)
    return time.monotonic() - t0


def memcpy(src: np.ndarray, total: int) -> float:
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in first
    t0 = time.perf_counter()
    for _ in range(max(1, total // len(src))):
        np.copyto(dst, src)
    return time.perf_counter() - t0


def await_pdkv(tx: KvSender, cache: KvCache, rows: dict, queue,
                faults: list | None = None) -> float:
    """Serve the child's announces until it reports the seconds the request took (and
    the page faults the decode took meanwhile, appended to ``faults``).

    ``poll`` wakes as soon as a message arrives; its timeout only paces the check for the
    child's report (outside the child's timing), so a long one keeps this loop from
    waking 500 times a second and stealing the 2-core machine's copy threads' time.
    """
    while True:
        pump(tx, cache, tx.poll(0.02), rows)
        if not queue.empty():
            kind, _, seconds, *flt = queue.get()
            assert kind == "pdkv", kind
            if faults is not None:
                faults.extend(flt)
            return seconds


def pump(tx: KvSender, cache: KvCache, events: list, rows: dict) -> None:
    """The prefill worker's part: on READY send the whole (already computed) prompt."""
    for ev in events:
        if ev.kind == EventKind.READY:
            kv = rows[ev.rid] = cache.open_row(ev.rid)
            cache.extend(kv, ev.prompt_len)
            tx.finish(ev.rid, kv, first_token=1)
        elif ev.kind.is_final:
            kv = rows.pop(ev.rid)
            cache.free_kv_row(kv, [(0, kv.allocated_len)], reason=ev.reason or "sent")
            cache.close_row(kv)
