"""What the transfer benches share: the KV layout they move, pools, the receiving loop,
the memcpy ceiling, and the sender's pump (``benchmarks.transfer`` measures ZMQ frames and
shared memory with it, ``benchmarks.nixl_transfer`` NIXL)."""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch
import zmq

from benchmarks.goals import paired_ratio
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
             pool_tokens: int, group: int = 0) -> float:
    """Seconds for the decode to receive ``tokens`` (as pool-sized requests) from the
    prefill ``group`` (the benches connect one with integrity on, one with it off)."""
    per, rounds = pool_rounds(tokens, pool_tokens)
    t0 = time.monotonic()
    for i in range(rounds):
        rid = f"{tokens}-{repeat}-{i}-g{group}"
        kv = cache.open_row(rid)
        cache.extend(kv, per)
        rx.announce(rid, kv, per, group=group)
        while not any(e.kind.is_final for e in rx.poll(0.01) if e.rid == rid):
            pass
        cache.free_kv_row(kv, [(0, per)], reason="finished")
        cache.close_row(kv)
    return time.monotonic() - t0


def integrity_figures(nbytes: int, on: list, off: list) -> dict:
    """Integrity on against off, runs paired as they alternated (on rate / off rate)."""
    gb = nbytes / 1e9
    return {"pdkv_off_gbps": round(gb / statistics.median(off), 3),
            "integrity_on_vs_off_paired": round(paired_ratio(off, on), 3)}


def memcpy(src: np.ndarray, total: int) -> float:
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in first
    t0 = time.perf_counter()
    for _ in range(max(1, total // len(src))):
        np.copyto(dst, src)
    return time.perf_counter() - t0


def pump_all(senders: list[KvSender], cache: KvCache, rows: dict, timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for any sender's socket (less while one asks to be polled
    sooner: NIXL writes in flight), then ``pump`` every sender."""
    if len(senders) == 1:
        pump(senders[0], cache, senders[0].poll(timeout_s), rows)
        return
    busy = [tx for tx in senders if tx.poll_within() is not None]
    if busy:   # its own poll waits in sub-millisecond slices and progresses its writes
        waited = busy[0]
        pump(waited, cache, waited.poll(min(timeout_s, waited.poll_within())), rows)
    else:
        waited = None
        poller = zmq.Poller()
        for tx in senders:
            for sock in tx.sockets():
                poller.register(sock, zmq.POLLIN)
        poller.poll(int(1000 * timeout_s))
    for tx in senders:
        if tx is not waited:
            pump(tx, cache, tx.poll(0.0), rows)


def await_pdkv(tx: KvSender | list[KvSender], cache: KvCache, rows: dict, queue,
               faults: list | None = None) -> float:
    """Serve the child's announces until it reports the seconds the request took (and
    the page faults the decode took meanwhile, appended to ``faults``).

    ``poll`` wakes as soon as a message arrives; its timeout only paces the check for the
    child's report (outside the child's timing), so a long one keeps this loop from
    waking 500 times a second and stealing the 2-core machine's copy threads' time.
    """
    senders = tx if isinstance(tx, list) else [tx]
    while True:
        pump_all(senders, cache, rows, 0.02)
        if not queue.empty():
            kind, _, seconds, *flt = queue.get()
            assert kind == "pdkv", kind
            if faults is not None:
                faults.extend(flt)
            return seconds


def pump(tx: KvSender, cache: KvCache, events: list, rows: dict) -> None:
    """The prefill worker's part: on READY send the whole (already computed) prompt once
    the pool has room for it (the decode may register the next request before our own
    transfer of the last one reported done and freed its row: that waits, as a worker's
    admission does); on a final event free the row."""
    waiting = rows.setdefault(WAITING, [])
    for ev in events:
        if ev.kind == EventKind.READY:
            waiting.append((tx, ev.rid, ev.prompt_len))
        elif ev.kind.is_final:
            kv = rows.pop(ev.rid)
            cache.free_kv_row(kv, [(0, kv.allocated_len)], reason=ev.reason or "sent")
            cache.close_row(kv)
    while waiting and cache.num_free_pages() >= -(-waiting[0][2] // cache.page_size):
        sender, rid, prompt_len = waiting.pop(0)
        kv = rows[rid] = cache.open_row(rid)
        cache.extend(kv, prompt_len)
        sender.finish(rid, kv, first_token=1)


WAITING = ""   # rows' key of the READY requests waiting for room in the pool
