"""``pdkv bench transfer``: KV transfer throughput between two processes, with raw pyzmq,
memcpy and pickle baselines measured in the same run.

Layout: 32 layers, 8 KV heads, head dim 128, fp16, page 16 (2 MiB per page, 128 KiB per
token). Requests larger than the pool (``--pool-tokens``) move as back-to-back requests of
pool size whose bytes add up to the request's (a 32k-token request is 4 GiB). Each figure
is the median of ``--repeats`` runs from 8k tokens up and of proportionally more below
(``transfer_rig.repeats_for``: 1k runs 8x as often), so that every size is measured for
about as long;
pdkv and raw-pyzmq runs alternate so that the machine's drift hits both alike. The
decode side runs in a spawned process; the prefill side, the memcpy and the senders of the
baselines run here. Transports: ``tcp`` and ``ipc`` carry KV in ZMQ frames; ``shm`` puts
the decode pool in shared memory and the prefill copies into it (control over ipc; its raw
baseline is ipc).

Like with like: pdkv must land every byte in the decode pool, so the raw baseline
(``raw_zmq_gbps``) receives each 8 MiB message into the same warm decode pool
(``recv_into``, the one copy out of ZMQ's buffer that pdkv makes too). The older figure,
which receives into ZMQ-owned buffers and drops them (no copy, bytes land nowhere), is
kept as ``raw_zmq_discard_gbps``/``ratio_vs_raw_discard``.

Integrity (docs/protocol.md, "Integrity"): every pdkv run moves its bytes with digests
on (the default); a second prefill endpoint with integrity off serves the same decode, and
its runs alternate with the others (``pdkv_off_gbps``; ``integrity_on_vs_off_paired``:
the median of each on run's rate over the off run beside it).

Goals, each a paired ratio (each pdkv run paired with the baseline run that follows it;
the median of the ratios is judged, so drift between distant runs cancels out): tcp frames
>= 0.85x raw pyzmq landing the same bytes, at every size; shm >= 0.9x memcpy, at every
size; integrity on >= 0.9x integrity off at 8k and 32k tokens on every path. Exit status
1 on a miss unless ``--report-only``.

``--kv-security`` measures what authenticating the KV plane costs (docs/security.md):
``none`` (no keys), ``plain`` (PLAIN: authenticated handshake, frames in the clear) and
``curve`` (CURVE: every byte encrypted). Rows other than ``none`` are named
``<transport>+<mode>`` and carry ``ratio_vs_none``: their paired pdkv/raw ratio over the
same transport's ``none`` row's (each row's raw pyzmq runs interleave with its pdkv runs,
so the machine's drift between rows cancels); the raw baselines are always
unauthenticated. The goal is judged on the ``none`` rows only.

``--device cuda:N`` puts both pools on that GPU (``shm`` needs CPU pools): frames then
stage every run through host memory on each side (``transport.pool_view``) and NIXL
registers VRAM. The baselines still move host bytes (raw pyzmq lands them in a host
buffer of the pool's size; memcpy is host to host), so those rows report absolute
figures and the goals set for CPU pools are not judged; NIXL's raw baseline writes VRAM
to VRAM like pdkv, and pdkv must reach 0.9x of it at 8k and 32k tokens (the GPU round).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import resource
import statistics
import sys
import time

import numpy as np
import torch
import zmq

from benchmarks import transfer_rig as rig
from benchmarks.goals import Goals, add_bench_flags, paired_ratio, run_as_script
from common.auth import PlaneAuth, new_kv_plane
from common.config import ConfigError
from transport import KvReceiver, KvSender, TransportConfig

RAW_MSG = 8 << 20
GOALS = {"tcp": 0.85}  # transport -> least pdkv/raw ratio, judged at every size
SHM_GOAL = 0.9         # shm: least pdkv/memcpy ratio, at every size
INTEGRITY_GOAL = 0.9   # integrity on / off, at INTEGRITY_SIZES on every path
INTEGRITY_SIZES = (8192, 32768)


# -- decode child --------------------------------------------------------------------------
def _child(addresses: list[str], pool_tokens: int, shared: bool, queue, cmd,
           auth: dict | None = None, device: str = "cpu") -> None:
    """Serve jobs from ``cmd``: ``("pdkv", tokens, repeat, group)`` or a baseline, until
    None. ``addresses``: the prefill with integrity on (group 0) and off (group 1).
    ``auth``: the KV plane's credentials (``PlaneAuth.to_dict``), None for none."""
    cache = rig.cache(pool_tokens, "decode", shared, device)
    cache.data().fill_(0.5)  # a serving pool is warm: fault its pages in before timing
    plane = PlaneAuth.kv_from_dict(auth) if auth else new_kv_plane("null")
    rx = KvReceiver(cache, TransportConfig(node="decode", **rig.CFG), auth=plane)
    for address in addresses:
        rx.connect(address)
    ctx = zmq.Context()
    dest = rig.host_bytes(cache)  # raw lands here too (a warm host buffer for a device pool)
    while (job := cmd.get()) is not None:
        if job[0] == "pdkv":
            f0 = _faults()
            seconds = rig.receive(rx, cache, job[1], job[2], pool_tokens, job[3])
            queue.put(("pdkv", job[1], seconds, _faults() - f0))
        else:
            _child_baseline(ctx, queue, job, dest)
    rx.close()
    ctx.term()
    cache.close()


def _faults() -> int:
    """Minor page faults of this process so far (all threads: ZMQ's I/O thread too)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _child_baseline(ctx: zmq.Context, queue, job, dest: np.ndarray) -> None:
    """``raw``: each message into the next slice of ``dest`` (the decode pool), as pdkv
    must; ``discard``: into ZMQ's own buffers, dropped; ``pickle``: unpickled tensors."""
    kind, address, nbytes, messages = job
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    queue.put(("ready", kind, 0.0))
    got, offset, f0 = 0, 0, _faults()
    for _ in range(messages):
        if kind == "raw":
            offset = 0 if offset + RAW_MSG > dest.nbytes else offset
            n = sock.recv_into(dest[offset:offset + RAW_MSG])
            offset += n
            got += n
        elif kind == "discard":
            got += len(sock.recv(copy=False).buffer)
        else:
            got += sum(t.numel() * t.element_size() for t in sock.recv_pyobj())
    queue.put((kind, nbytes, time.monotonic(), _faults() - f0))
    assert got == nbytes, (got, nbytes)
    sock.close(linger=0)


# -- prefill side and baselines ------------------------------------------------------------
def _baseline(kind: str, address: str, src: np.ndarray, total: int, queue, cmd,
              faults: list | None = None) -> float:
    """Seconds to push ``total`` bytes (``src`` repeated) to the child; the child's page
    faults meanwhile are appended to ``faults``."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    port_addr = sock.bind_to_random_port("tcp://127.0.0.1") if address == "tcp" else None
    addr = f"tcp://127.0.0.1:{port_addr}" if port_addr else address
    if port_addr is None:
        sock.bind(addr)
    if kind in ("raw", "discard"):
        msgs = [src[i:i + RAW_MSG] for i in range(0, len(src), RAW_MSG)]
    else:  # the naive way: pickle each page's tensor
        pages = torch.from_numpy(src).view(torch.float16).view(-1, *rig.LAYOUT.page_shape(rig.PAGE))
        # one tensor per page with its own storage (a view would pickle the whole pool)
        msgs = [[p.clone() for p in pages[i:i + 4]] for i in range(0, len(pages), 4)]
    reps = max(1, total // len(src))
    cmd.put((kind, addr, len(src) * reps, len(msgs) * reps))
    assert queue.get(timeout=60)[0] == "ready"
    time.sleep(0.05)
    t0 = time.monotonic()
    for _ in range(reps):
        for m in msgs:
            sock.send(m, copy=False) if kind != "pickle" else sock.send_pyobj(m)
    _, _, t_end, *flt = queue.get(timeout=600)
    if faults is not None:
        faults.extend(flt)
    sock.close(linger=0)
    return t_end - t0


def run_transport(transport: str, sizes: list[int], repeats: int, pool_tokens: int,
                  tmpdir: str, security: str = "none", device: str = "cpu") -> dict:
    """Every measurement for one transport; returns ``{tokens: {figure: value}}``."""
    cache = rig.cache(pool_tokens, "prefill", device=device)
    cache.data().copy_(torch.randn(cache.data().shape, dtype=torch.float16))
    plane = new_kv_plane("null" if security == "none" else security)
    senders = []   # integrity on (the default), then off: the same pool, two endpoints
    for integrity in (True, False):
        address = "tcp://127.0.0.1:*" if transport == "tcp" else \
            f"ipc://{tmpdir}/pdkv-{int(integrity)}.sock"
        senders.append(KvSender(cache, address, TransportConfig(
            node="prefill" if integrity else "prefill-off", kv_integrity=integrity,
            **rig.CFG), auth=plane))
    spawn = mp.get_context("spawn")
    queue, cmd = spawn.Queue(), spawn.Queue()
    proc = spawn.Process(target=_child, args=([tx.address for tx in senders], pool_tokens,
                                              transport == "shm", queue, cmd,
                                              plane.to_dict() if plane.secured else None,
                                              device))
    proc.start()
    rows: dict = {}
    while not all(tx.peers for tx in senders):  # handshakes
        rig.pump_all(senders, cache, rows, 0.02)
    pool_bytes = pool_tokens * rig.LAYOUT.page_bytes(rig.PAGE) // rig.PAGE
    src = rig.host_bytes(cache)[:pool_bytes]
    base = "tcp" if transport == "tcp" else f"ipc://{tmpdir}/raw.sock"
    results = {}
    for tokens in sizes:
        nbytes = tokens * rig.LAYOUT.page_bytes(rig.PAGE) // rig.PAGE
        part = src[:min(nbytes, src.nbytes)]  # the same bytes; repeated when pool < request
        pdkv, off, raw, discard, faults = [], [], [], [], {"pdkv": [], "raw": []}
        for repeat in range(rig.repeats_for(tokens, repeats)):  # alternate: drift hits all
            cmd.put(("pdkv", tokens, repeat, 0))
            pdkv.append(rig.await_pdkv(senders, cache, rows, queue, faults["pdkv"]))
            raw.append(_baseline("raw", base, part, nbytes, queue, cmd, faults["raw"]))
            cmd.put(("pdkv", tokens, repeat, 1))
            off.append(rig.await_pdkv(senders, cache, rows, queue))
            discard.append(_baseline("discard", base, part, nbytes, queue, cmd))
        pick = [_baseline("pickle", base, part, part.nbytes, queue, cmd)
                for _ in range(max(1, repeats // 2))]
        mem = [rig.memcpy(part, nbytes) for _ in range(repeats)]
        results[tokens] = _figures(nbytes, pdkv, raw, discard, mem, pick, part.nbytes)
        results[tokens].update(rig.integrity_figures(nbytes, pdkv, off))
        for kind, counts in faults.items():   # where a slow run's time went (see docs)
            results[tokens][f"decode_faults_{kind}"] = counts
    cmd.put(None)
    while proc.is_alive() and any(tx.peers for tx in senders):
        rig.pump_all(senders, cache, rows, 0.01)  # until the child's Bye
    proc.join(30)
    for tx in senders:
        tx.close()
    cache.close()
    return results



def _figures(nbytes: int, pdkv: list, raw: list, discard: list, mem: list, pick: list,
             pick_bytes: int) -> dict:
    """Medians, plus the pdkv and raw spread (slowest, fastest run) in GB/s."""
    gb = nbytes / 1e9
    out = {"bytes": nbytes,
           "pdkv_gbps": gb / statistics.median(pdkv),
           "raw_zmq_gbps": gb / statistics.median(raw),
           "raw_zmq_discard_gbps": gb / statistics.median(discard),
           "memcpy_gbps": gb / statistics.median(mem),
           "pickle_gbps": pick_bytes / 1e9 / statistics.median(pick)}
    out["ratio_vs_raw"] = out["pdkv_gbps"] / out["raw_zmq_gbps"]
    out["ratio_vs_raw_paired"] = paired_ratio(raw, pdkv)
    out["ratio_vs_raw_discard"] = out["pdkv_gbps"] / out["raw_zmq_discard_gbps"]
    out["ratio_vs_memcpy"] = out["pdkv_gbps"] / out["memcpy_gbps"]
    out["ratio_vs_pickle"] = out["pdkv_gbps"] / out["pickle_gbps"]
    out = {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}
    out["pdkv_spread_gbps"] = [round(gb / max(pdkv), 3), round(gb / min(pdkv), 3)]
    out["raw_spread_gbps"] = [round(gb / max(raw), 3), round(gb / min(raw), 3)]
    return out


def main(args) -> int:
    """Entry from ``deploy.cli.main`` (``pdkv bench transfer``)."""
    import tempfile
    sizes = args.sizes or ([1024, 8192] if args.quick else [1024, 8192, 32768])
    repeats = args.repeats or (2 if args.quick else 5)
    pool_tokens = args.pool_tokens or (2048 if args.quick else 8192)
    device = getattr(args, "device", "cpu")
    if device != "cpu" and "shm" in args.transports:
        raise ConfigError("--transports shm needs CPU pools (the decode pool in shared "
                          f"memory); with --device {device} measure tcp, ipc, nixl or "
                          "nixl-tcp")
    from deploy.launch.run import check_devices
    check_devices([device])   # a GPU this machine lacks: one clear line, no child started
    from benchmarks import nixl_transfer  # NIXL rows (--transports nixl nixl-tcp)
    report = {}
    modes = getattr(args, "kv_security", None) or ["none"]
    with tempfile.TemporaryDirectory() as tmpdir:
        for transport in args.transports:
            if transport in nixl_transfer.VARIANTS:   # NIXL's data path is not ZMQ's
                report[transport] = {str(t): r for t, r in nixl_transfer.run_variant(
                    transport, sizes, repeats, pool_tokens, tmpdir, device).items()}
                continue
            for mode in modes:
                name = transport if mode == "none" else f"{transport}+{mode}"
                report[name] = {str(t): r for t, r in run_transport(
                    transport, sizes, repeats, pool_tokens, tmpdir, mode, device).items()}
                base = report.get(transport) if mode != "none" else None
                for tokens, r in report[name].items():
                    if base is not None:   # each against its own raw runs: drift cancels
                        r["ratio_vs_none"] = round(r["ratio_vs_raw_paired"]
                                                   / base[tokens]["ratio_vs_raw_paired"], 3)
    goals = judge(report) if device == "cpu" else judge_device(report)
    if args.json:
        print(json.dumps({"device": device, **report, **goals.to_dict()}, indent=2))
    else:
        if device != "cpu":
            print(f"pools on {device}; frames' baselines move host bytes (not judged); "
                  f"NIXL VRAM to VRAM judged against raw NIXL at 8k and 32k tokens")
        _print_table({k: v for k, v in report.items() if k not in nixl_transfer.VARIANTS})
        nixl_transfer.print_table(report)
        goals.print()
    return goals.exit_status(args)


def judge(report: dict) -> Goals:
    """tcp frames vs raw pyzmq and shm vs memcpy at every size; integrity on vs off at
    8k and 32k tokens on every path measured; NIXL's own (``nixl_transfer.judge``)."""
    goals = Goals("transfer")
    for transport, target in GOALS.items():
        for tokens, r in report.get(transport, {}).items():
            goals.at_least(f"{transport} frames at {tokens} tokens vs raw pyzmq",
                           r["ratio_vs_raw_paired"], target,
                           baseline=f"raw {r['raw_zmq_gbps']:.2f} GB/s",
                           measured=f"pdkv {r['pdkv_gbps']:.2f} GB/s")
    for tokens, r in report.get("shm", {}).items():
        goals.at_least(f"shm at {tokens} tokens vs memcpy", r["ratio_vs_memcpy"], SHM_GOAL,
                       baseline=f"memcpy {r['memcpy_gbps']:.2f} GB/s",
                       measured=f"pdkv {r['pdkv_gbps']:.2f} GB/s")
    judge_integrity(report, goals)
    from benchmarks import nixl_transfer  # imports this module: import at use
    nixl_transfer.judge(report, goals)
    return goals


GPU_NIXL_GOAL = 0.9    # on a device: NIXL VRAM to VRAM vs raw NIXL VRAM to VRAM


def judge_device(report: dict) -> Goals:
    """Pools on a device: the baselines of frames move host bytes (not judged), raw NIXL
    writes VRAM to VRAM like pdkv; NIXL >= ``GPU_NIXL_GOAL`` x raw at 8k and 32k tokens."""
    goals = Goals("transfer")
    for variant in ("nixl", "nixl-tcp"):
        for tokens, r in report.get(variant, {}).items():
            if int(tokens) in INTEGRITY_SIZES:
                goals.at_least(f"{variant} VRAM at {tokens} tokens vs raw NIXL",
                               r["ratio_vs_raw_nixl_paired"], GPU_NIXL_GOAL,
                               baseline=f"raw NIXL {r['raw_nixl_gbps']:.2f} GB/s",
                               measured=f"pdkv {r['pdkv_gbps']:.2f} GB/s")
    return goals


def judge_integrity(report: dict, goals: Goals) -> None:
    """Integrity on >= ``INTEGRITY_GOAL`` x off at 8k and 32k tokens, every path."""
    for transport, sizes in report.items():
        for tokens, r in sizes.items():
            if int(tokens) in INTEGRITY_SIZES and "integrity_on_vs_off_paired" in r:
                goals.at_least(f"{transport} at {tokens} tokens, integrity on vs off",
                               r["integrity_on_vs_off_paired"], INTEGRITY_GOAL,
                               baseline=f"off {r['pdkv_off_gbps']:.2f} GB/s",
                               measured=f"on {r['pdkv_gbps']:.2f} GB/s")


def _print_table(report: dict) -> None:
    if not report:
        return
    print(f"{'transport':15} {'tokens':>6} {'GiB':>5} {'pdkv':>6} {'off':>6} {'raw':>6} "
          f"{'rawdis':>6} {'memcpy':>6} {'pickle':>6} {'/raw':>5} {'paired':>6} "
          f"{'/rawdis':>7} {'/memcpy':>7} {'/pickle':>7} {'on/off':>6} {'/none':>6}"
          "   (GB/s, medians; off: integrity off)")
    for transport, sizes in report.items():
        for tokens, r in sizes.items():
            vs_none = f"{r['ratio_vs_none']:6.2f}" if "ratio_vs_none" in r else f"{'':6}"
            print(f"{transport:15} {tokens:>6} {r['bytes'] / 2**30:5.2f} {r['pdkv_gbps']:6.2f} "
                  f"{r['pdkv_off_gbps']:6.2f} "
                  f"{r['raw_zmq_gbps']:6.2f} {r['raw_zmq_discard_gbps']:6.2f} "
                  f"{r['memcpy_gbps']:6.2f} {r['pickle_gbps']:6.2f} {r['ratio_vs_raw']:5.2f} "
                  f"{r['ratio_vs_raw_paired']:6.2f} "
                  f"{r['ratio_vs_raw_discard']:7.2f} {r['ratio_vs_memcpy']:7.2f} "
                  f"{r['ratio_vs_pickle']:7.1f} {r['integrity_on_vs_off_paired']:6.2f} "
                  f"{vs_none}")


def add_command(bench) -> None:
    """``pdkv bench transfer``: its arguments (registered in pyproject.toml)."""
    t = bench.add_parser("transfer", help="KV transfer throughput between two processes",
                         description="Move the KV of 1k/8k/32k-token requests (32 layers, 8 "
                                     "KV heads, dim 128, fp16, page 16) prefill -> decode; "
                                     "report GB/s next to raw pyzmq, memcpy and pickle.")

    add_bench_flags(t, quick="small sizes, under 30 s",
                    repeats="5, 2 with --quick; below 8k tokens proportionally more: 8x at 1k")
    t.add_argument("--sizes", type=int, nargs="+", metavar="TOKENS",
                   help="request sizes in tokens (default 1024 8192 32768)")
    t.add_argument("--transports", nargs="+",
                   choices=["tcp", "ipc", "shm", "nixl", "nixl-tcp"],
                   default=["tcp", "ipc", "shm"],
                   help="transports to measure (default: tcp ipc shm; shm = shared-memory "
                        "pool; nixl = NIXL WRITEs vs raw NIXL, UCX's choice; nixl-tcp = "
                        "UCX_TLS=tcp; both need pdkv[nixl])")
    t.add_argument("--kv-security", nargs="+", choices=["none", "plain", "curve"],
                   default=["none"], metavar="MODE",
                   help="KV-plane authentication to measure for each transport: none, "
                        "plain (authenticated, frames in the clear), curve (encrypted); "
                        "rows other than none report ratio_vs_none (default none)")
    t.add_argument("--pool-tokens", type=int,
                   help="pool size in tokens; larger requests move as several pool-sized "
                        "requests (default 8192, 2048 with --quick)")
    t.add_argument("--device", default="cpu", metavar="DEVICE",
                   help="where both pools live: cpu (default) or cuda:N; on a GPU frames "
                        "are staged through host memory and NIXL registers VRAM; the "
                        "baselines move host bytes, so the goals (set for CPU pools) are "
                        "reported, not judged; shm needs cpu")
    t.set_defaults(func=main)


if __name__ == "__main__":
    sys.exit(run_as_script(add_command))
