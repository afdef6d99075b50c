"""NIXL rows of ``pdkv bench transfer`` (``--transports nixl nixl-tcp``): pdkv over its
NIXL data path against raw NIXL moving the same bytes into the same decode pool, and
memcpy, in the same run.

Layout and sizes are ``benchmarks.transfer``'s (2 MiB pages; requests larger than the pool
move as several pool-sized requests). ``nixl`` lets UCX pick its transports (on one host:
``cma`` for the bytes); ``nixl-tcp`` forces ``UCX_TLS=tcp`` on both processes.

Like with like: both figures end when the decode knows its pool holds the bytes.
- pdkv: the decode child's clock from ``announce`` to ``COMPLETED`` (the Register, then
  the prefill's WRITEs, each with its notification; the last one's is the completion);
- raw NIXL: the prefill posts one WRITE of the same bytes into the same registered decode
  pages with a notification, through the NIXL agent API directly, waits for ``DONE`` and
  posts the next; the time runs from the first post (prefill clock) to the last
  notification's arrival at the decode (child clock; ``CLOCK_MONOTONIC`` is system-wide).
pdkv and raw runs alternate so that the machine's drift hits both alike; medians. As in
the tcp rows, each pdkv run is paired with the raw run after it and the median of the
paired ratios is judged (``ratio_vs_raw_nixl_paired``; the ratio of the two medians stays
beside it as ``ratio_vs_raw_nixl``): over UCX's TCP single runs of either side moved
0.8-4.4 GB/s within minutes. Goals (``judge``): a request of at most a page takes at most
``SMALL_GOAL_TIME`` x raw NIXL's time; from 1k tokens up pdkv moves >= ``GOAL`` x raw
NIXL's rate. As in ``benchmarks.transfer``, a second prefill endpoint with integrity off
alternates with the first, and integrity on must keep >= 0.9x of off at 8k and 32k.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from contextlib import contextmanager

import numpy as np
import torch

from benchmarks import transfer_rig as tr
from benchmarks.goals import paired_ratio
from common import KvCache
from transport import KvReceiver, KvSender, TransportConfig

GOAL = 0.95
SMALL_GOAL_TIME = 1.3   # a one-page request: pdkv's time <= 1.3 x raw NIXL's
SMALL_TOKENS = 16       # "one page" of the bench layout (2 MiB)
VARIANTS = {"nixl": None, "nixl-tcp": "tcp"}  # transport name -> UCX_TLS
CFG = {**tr.CFG, "kv_transport": "nixl"}


@contextmanager
def _ucx_tls(value: str | None):
    """``UCX_TLS`` for agents made inside (and children spawned inside) the block."""
    old = os.environ.get("UCX_TLS")
    if value is None:
        os.environ.pop("UCX_TLS", None)
    else:
        os.environ["UCX_TLS"] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("UCX_TLS", None)
        else:
            os.environ["UCX_TLS"] = old


# -- decode child --------------------------------------------------------------------------
def _child(addresses: list[str], pool_tokens: int, queue, cmd, device: str = "cpu") -> None:
    """Serve ``("pdkv", tokens, repeat, group)`` and ``("raw", writes)`` jobs until None;
    group 0 is the prefill with integrity on, 1 the one with it off."""
    cache = tr.cache(pool_tokens, "decode", device=device)
    cache.data().fill_(0.5)  # a serving pool is warm: fault its pages in before timing
    rx = KvReceiver(cache, TransportConfig(node="decode", **CFG))
    for address in addresses:
        rx.connect(address)
    while (job := cmd.get()) is not None:
        if job[0] == "pdkv":
            queue.put(("pdkv", job[1], tr.receive(rx, cache, job[1], job[2], pool_tokens,
                                                  job[3])))
        else:
            queue.put(("ready", job[1], 0.0))
            queue.put(("raw", job[1], _await_notifs(rx, job[1])))
    rx.close()
    cache.close()


def _await_notifs(rx: KvReceiver, count: int) -> float:
    """Poll the decode's agent (no pdkv in between) until ``count`` raw notifications
    came; returns the monotonic time of the last."""
    agent = rx.nixl.agent.agent
    got = 0
    while True:
        for msgs in agent.get_new_notifs().values():
            got += sum(m.startswith(b"raw") for m in msgs)
        if got >= count:
            return time.monotonic()
        time.sleep(0.0001)  # a polite poller, as pdkv's (nixl.SLICE_S, 0.1 ms slices)


# -- prefill side --------------------------------------------------------------------------
def _raw(tx: KvSender, cache: KvCache, nbytes: int, per_bytes: int, queue, cmd) -> float:
    """Seconds for raw NIXL to move ``nbytes`` into the decode pool, ``per_bytes`` a write."""
    channel = next(iter(tx.nixl.channels.values()))
    agent, local, remote = channel.agent.agent, channel.local, channel.remote
    page = local.page_bytes
    src = agent.get_xfer_descs([(local.addr + page, per_bytes, local.dev)], local.mem)
    dst = agent.get_xfer_descs([(remote.addr + page, per_bytes, remote.dev)], remote.mem)
    writes = max(1, nbytes // per_bytes)
    cmd.put(("raw", writes))
    assert queue.get(timeout=60)[0] == "ready"
    time.sleep(0.01)  # the child is polling by now
    t0 = time.monotonic()
    for i in range(writes):
        handle = agent.initialize_xfer("WRITE", src, dst, channel.peer_agent, b"raw%d" % i)
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        assert state == "DONE", state
        agent.release_xfer_handle(handle)
    kind, _, t_end = queue.get(timeout=600)
    assert kind == "raw", kind
    return t_end - t0


def run_variant(variant: str, sizes: list[int], repeats: int, pool_tokens: int,
                tmpdir: str, device: str = "cpu") -> dict:
    """Every figure of one NIXL variant; returns ``{tokens: {figure: value}}``. With a
    ``device`` both pools are VRAM, and raw NIXL writes VRAM to VRAM too."""
    with _ucx_tls(VARIANTS[variant]):
        cache = tr.cache(pool_tokens, "prefill", device=device)
        cache.data().copy_(torch.randn(cache.data().shape, dtype=torch.float16))
        senders = [KvSender(cache, f"ipc://{tmpdir}/nixl-{int(on)}.sock", TransportConfig(
            node="prefill" if on else "prefill-off", kv_integrity=on, **CFG))
            for on in (True, False)]   # the same pool; integrity on, then off
        tx = senders[0]
        spawn = mp.get_context("spawn")
        queue, cmd = spawn.Queue(), spawn.Queue()
        proc = spawn.Process(target=_child, args=([t.address for t in senders], pool_tokens,
                                                  queue, cmd, device))
        proc.start()
    rows: dict = {}
    while not all(t.peers for t in senders):  # handshakes
        tr.pump_all(senders, cache, rows, 0.02)
    assert list(tx.data_paths().values()) == ["nixl"], tx.data_paths()
    page_bytes = tr.LAYOUT.page_bytes(tr.PAGE)
    src = tr.host_bytes(cache)
    results = {}
    for tokens in sizes:
        nbytes = tokens * page_bytes // tr.PAGE
        per_tokens, _ = tr.pool_rounds(tokens, pool_tokens)
        per_bytes = per_tokens * page_bytes // tr.PAGE
        pdkv, off, raw = [], [], []
        for repeat in range(tr.repeats_for(tokens, repeats)):
            cmd.put(("pdkv", tokens, repeat, 0))
            pdkv.append(tr.await_pdkv(senders, cache, rows, queue))
            raw.append(_raw(tx, cache, nbytes, per_bytes, queue, cmd))
            cmd.put(("pdkv", tokens, repeat, 1))
            off.append(tr.await_pdkv(senders, cache, rows, queue))
        part = src[:min(nbytes, per_bytes)]
        mem = [tr.memcpy(np.ascontiguousarray(part), nbytes) for _ in range(repeats)]
        results[tokens] = _figures(nbytes, pdkv, raw, mem, tokens)
        results[tokens].update(tr.integrity_figures(nbytes, pdkv, off))
    cmd.put(None)
    while proc.is_alive() and any(t.peers for t in senders):
        tr.pump_all(senders, cache, rows, 0.01)  # until the child's Bye
    proc.join(30)
    for t in senders:
        t.close()
    cache.close()
    return results


def goal_of(tokens: int) -> float:
    """Least pdkv/raw rate at ``tokens``: 1/1.3 for one page (time <= 1.3x), else GOAL."""
    return round(1 / SMALL_GOAL_TIME, 3) if int(tokens) <= SMALL_TOKENS else GOAL


def _figures(nbytes: int, pdkv: list, raw: list, mem: list, tokens: int) -> dict:
    gb = nbytes / 1e9
    out = {"bytes": nbytes, "pdkv_gbps": gb / statistics.median(pdkv),
           "raw_nixl_gbps": gb / statistics.median(raw),
           "memcpy_gbps": gb / statistics.median(mem)}
    out["ratio_vs_raw_nixl"] = out["pdkv_gbps"] / out["raw_nixl_gbps"]
    out["ratio_vs_raw_nixl_paired"] = paired_ratio(raw, pdkv)
    out["ratio_vs_memcpy"] = out["pdkv_gbps"] / out["memcpy_gbps"]
    out = {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}
    out["pdkv_spread_gbps"] = [round(gb / max(pdkv), 3), round(gb / min(pdkv), 3)]
    out["raw_spread_gbps"] = [round(gb / max(raw), 3), round(gb / min(raw), 3)]
    out["pdkv_ms"] = round(statistics.median(pdkv) * 1e3, 3)
    out["raw_nixl_ms"] = round(statistics.median(raw) * 1e3, 3)
    out["goal"] = f"pdkv >= {goal_of(tokens)} x raw NIXL's rate"
    out["goal_met"] = out["ratio_vs_raw_nixl_paired"] >= goal_of(tokens)
    return out


def judge(report: dict, goals) -> None:
    """Add one goal per NIXL row to ``goals`` (benchmarks.goals.Goals): pdkv / raw NIXL."""
    for variant, sizes in report.items():
        if variant not in VARIANTS:
            continue
        for tokens, r in sizes.items():
            goals.at_least(f"{variant} at {tokens} tokens vs raw NIXL",
                           r["ratio_vs_raw_nixl_paired"], goal_of(tokens),
                           baseline=f"raw NIXL {r['raw_nixl_ms']:.3f} ms, "
                                    f"{r['raw_nixl_gbps']:.2f} GB/s",
                           measured=f"pdkv {r['pdkv_ms']:.3f} ms, {r['pdkv_gbps']:.2f} GB/s")


def print_table(report: dict) -> None:
    rows = [(v, t, r) for v, sizes in report.items() if v in VARIANTS
            for t, r in sizes.items()]
    if not rows:
        return
    print(f"{'transport':9} {'tokens':>6} {'GiB':>5} {'pdkv':>6} {'off':>6} {'rawnixl':>7} "
          f"{'memcpy':>6} {'/raw':>5} {'paired':>6} {'/memcpy':>7} {'on/off':>6}   (GB/s, "
          f"medians; goal paired >= {GOAL}, one page >= {goal_of(SMALL_TOKENS)})")
    for variant, tokens, r in rows:
        print(f"{variant:9} {tokens:>6} {r['bytes'] / 2**30:5.2f} {r['pdkv_gbps']:6.2f} "
              f"{r['pdkv_off_gbps']:6.2f} "
              f"{r['raw_nixl_gbps']:7.2f} {r['memcpy_gbps']:6.2f} "
              f"{r['ratio_vs_raw_nixl']:5.2f} {r['ratio_vs_raw_nixl_paired']:6.2f} "
              f"{r['ratio_vs_memcpy']:7.2f} {r['integrity_on_vs_off_paired']:6.2f}"
              f"{'' if r['goal_met'] else '  MISS'}")
