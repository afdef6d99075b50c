"""``pdkv bench security``: what authentication costs a served request, in one run.

The same seeded workload goes through three 1P1D deployments on this machine, with KV in
ZMQ frames over tcp as between hosts (``shared_memory`` off; the same-host shared-memory
path moves no KV bytes over a socket, so it costs the same in every mode):

| mode | control plane | KV plane |
| --- | --- | --- |
| ``none`` | no keys (loopback only) | no authentication |
| ``plain`` | CURVE | PLAIN: authenticated handshake, KV bytes in the clear |
| ``curve`` | CURVE | CURVE: every KV byte encrypted (the default with keys) |

For each it reports TTFT p50/p99 and their ratio to ``none``, and the exposed KV
transfer p50 (last chunk computed -> the decode holds every page, as the router measures
it; it reads 0 when the decode's clock reading comes first); medians over
``--repeats``, the modes alternating within a repeat so the machine's drift hits all
alike. Goal: ``plain`` TTFT p50 within ``--goal`` of ``none`` (authentication alone
must be cheap); ``curve`` is reported, it is the price of encryption. Exit 1 on a
missed goal or a failed request unless ``--report-only``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace

from benchmarks.goals import Goals, add_bench_flags, run_as_script
from deploy.launch.config_args import config_from_args
from deploy.launch.flags import add_config_flags, add_workload_flags
from deploy.launch.launcher import Cluster
from deploy.launch.run import workload_from_args
from deploy.loadgen.driver import drive
from deploy.loadgen.summary import pct
from deploy.loadgen.workload import make_workload

MODES = ("none", "plain", "curve")
FIGURES = ("ttft_p50_ms", "ttft_p99_ms", "xfer_p50_ms")


def run_mode(args: argparse.Namespace, mode: str, seed: int) -> dict:
    # a long lease: building the model on a loaded machine outlasts 10 s of silence
    cfg = replace(config_from_args(args), transport="tcp", shared_memory=False,
                  kv_security="curve" if mode == "none" else mode, lease_s=60.0)
    spec = replace(workload_from_args(args), seed=seed)
    cluster = Cluster(cfg, "disagg", 1, 1, threads=args.threads, secure=mode != "none")
    try:
        cluster.start()
        results = drive(cluster.client, make_workload(spec, cfg.model_config().vocab_size),
                        check=cluster.check)
    except BaseException:
        cluster.stop()
        print(f"pdkv bench security: {mode} failed; logs kept in {cluster.log_dir}",
              file=sys.stderr)
        raise
    stats = cluster.stop()
    cluster.check_exit_codes()
    cluster.cleanup()
    ok = [r for r in results.values() if r.ok]
    return {"requests": len(results), "ok": len(ok),
            "ttft_p50_ms": pct([r.ttft_s for r in ok], 50) * 1e3,
            "ttft_p99_ms": pct([r.ttft_s for r in ok], 99) * 1e3,
            "xfer_p50_ms": pct([r.xfer_s for r in ok], 50) * 1e3,
            "kv_bytes": sum(int(s.get("bytes_sent", 0)) for s in stats.values())}


def main(args: argparse.Namespace) -> int:
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.quick:
        args.requests = min(args.requests, 6)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for rep in range(args.repeats):
        for mode in MODES:   # the same workload (seed) for every mode of a repeat
            runs[mode].append(run_mode(args, mode, args.seed + rep))
        print(f"  repeat {rep + 1}/{args.repeats} done", file=sys.stderr)
    out = summarize(runs, args)
    modes = out["modes"]
    goals = Goals("security")
    goals.at_most("plain TTFT p50 vs none", modes["plain"]["ttft_p50_ratio"], args.goal,
                  measured=f"plain {modes['plain']['ttft_p50_ms']:.1f} ms",
                  baseline=f"none {modes['none']['ttft_p50_ms']:.1f} ms")
    for mode, d in modes.items():   # a failed request is a miss whatever the timing
        goals.at_least(f"{mode} requests served", d["ok"] / max(1, d["requests"]), 1.0,
                       measured=f"{d['ok']} of {d['requests']}")
    if args.json:
        print(json.dumps({**out, **goals.to_dict()}))
    else:
        print(format_table(out))
        goals.print()
    return goals.exit_status(args)


def summarize(runs: dict[str, list[dict]], args: argparse.Namespace) -> dict:
    modes = {}
    for mode, reps in runs.items():
        d = {f: statistics.median(r[f] for r in reps) for f in FIGURES}
        d["spread_ttft_p50_ms"] = [min(r["ttft_p50_ms"] for r in reps),
                                   max(r["ttft_p50_ms"] for r in reps)]
        d["requests"] = reps[0]["requests"]
        d["ok"] = min(r["ok"] for r in reps)
        d["kv_bytes"] = reps[0]["kv_bytes"]
        modes[mode] = d
    base = modes["none"]
    for d in modes.values():
        for f in ("ttft_p50_ms", "ttft_p99_ms"):
            d[f.replace("_ms", "_ratio")] = d[f] / base[f] if base[f] else 0.0
    return {"model": config_from_args(args).model, "repeats": args.repeats,
            "workload": {"requests": args.requests, "rate": args.rate,
                         "prompt_len": args.prompt_len, "output_len": args.output_len},
            "goal_plain_ttft_p50_ratio": args.goal, "modes": modes}


def format_table(out: dict) -> str:
    lines = [f"pdkv bench security: 1P1D, model {out['model']}, KV over tcp frames, "
             f"{out['workload']['requests']} requests, medians of {out['repeats']}",
             f"  {'mode':6} {'TTFT p50':>9} {'p99':>8} {'xfer p50':>9} {'/none p50':>10} "
             f"{'/none p99':>10}   (ms)"]
    for mode, d in out["modes"].items():
        lines.append(f"  {mode:6} {d['ttft_p50_ms']:9.1f} {d['ttft_p99_ms']:8.1f} "
                     f"{d['xfer_p50_ms']:9.2f} {d['ttft_p50_ratio']:10.3f} "
                     f"{d['ttft_p99_ratio']:10.3f}")
    return "\n".join(lines)


def add_command(bench) -> None:
    """``pdkv bench security``: its arguments (registered in pyproject.toml)."""
    p = bench.add_parser(
        "security", help="TTFT without authentication, with authenticated-only KV, and "
                         "with encrypted KV",
        description="Serve one seeded workload through 1P1D three times, KV in tcp frames: "
                    "no keys (none), CURVE control plane with PLAIN KV (plain), CURVE "
                    "everywhere (curve, the default with keys). Report TTFT p50/p99 and the "
                    "exposed KV transfer, each against none. Defaults here: --model small "
                    "--prompt-len 128 512 --output-len 2 4 --rate 0.5 --requests 12 (no "
                    "queueing on 2 cores: TTFT is prefill plus transfer). See "
                    "docs/security.md.",
        epilog="exit status: 0; 1 when plain's TTFT p50 exceeds --goal times none's or a "
               "request failed (unless --report-only).")

    add_bench_flags(p, quick="one repeat of 6 requests", repeats="3, 1 with --quick")
    p.add_argument("--goal", type=float, default=1.15, metavar="RATIO",
                   help="most plain TTFT p50 / none TTFT p50 (default 1.15)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    add_workload_flags(p, 12)
    add_config_flags(p)
    # long prompts and few outputs, on a model with KV worth moving: TTFT is the point
    p.set_defaults(func=main, model="small", prompt_len=[128, 512],
                   output_len=[2, 4], rate=0.5)


if __name__ == "__main__":
    sys.exit(run_as_script(add_command))
