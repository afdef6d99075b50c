"""``pdkv bench serve``: the same workload through colocated and 1P1D, in one run.

Per mode and repeat a fresh deployment serves the seeded workload; the table quotes the
median over repeats of each figure:

- TTFT and TPOT p50/p99, output tokens/s (client-side, ``deploy.driver``);
- KV transfer share of TTFT: the prefill's transfer tail (last chunk computed -> the
  decode acknowledged every page) over the request's TTFT, median over requests; and
  the TTFT added by disaggregation, p50(1P1D) / p50(colocated) - 1;
- goodput: requests per second that met both the TTFT and the TPOT target.

Modes alternate within a repeat (colocated, 1P1D, colocated, ...) so that machine noise
hits both alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from deploy.launcher import Cluster
from deploy.run import config_from_args, serve_workload, workload_from_args
from deploy.summary import summarize

MODES = (("colocated", 0, 1), ("disagg", 1, 1))
FIGURES = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "tokens_per_s",
           "kv_transfer_share_of_ttft_p50", "goodput_rps", "kv_bytes", "kv_gb_per_s")


def run_once(args: argparse.Namespace, mode: str, num_prefill: int, num_decode: int) -> dict:
    cfg, spec = config_from_args(args), workload_from_args(args)
    cluster = Cluster(cfg, mode, num_prefill, num_decode, threads=args.threads).start()
    try:
        results, stats, wall = serve_workload(cluster, spec)
    finally:
        cluster.stop()
    summary = summarize(results, stats, wall, args.ttft_target, args.tpot_target)
    cluster.cleanup()
    if summary["ok"] != summary["requests"]:
        raise RuntimeError(f"{mode}: {summary['reasons']}")
    return summary


def main(args: argparse.Namespace) -> int:
    runs: dict[str, list[dict]] = {m: [] for m, _, _ in MODES}
    for rep in range(args.repeats):
        for mode, n_p, n_d in MODES:
            runs[mode].append(run_once(args, mode, n_p, n_d))
            print(f"  repeat {rep + 1}/{args.repeats} {mode} done", file=sys.stderr)
    table = {m: {f: statistics.median(r[f] for r in rs) for f in FIGURES}
             for m, rs in runs.items()}
    added = table["disagg"]["ttft_p50_ms"] / max(table["colocated"]["ttft_p50_ms"], 1e-9) - 1
    out = {"workload": {"requests": args.requests, "seed": args.seed, "rate": args.rate,
                        "prompt_len": args.prompt_len, "output_len": args.output_len},
           "repeats": args.repeats, "ttft_target_s": args.ttft_target,
           "tpot_target_s": args.tpot_target, "modes": table,
           "ttft_p50_added_by_disagg": added}
    if args.json:
        print(json.dumps(out))
    else:
        print(format_table(out))
    return 0


def format_table(out: dict) -> str:
    t = out["modes"]
    rows = [("TTFT p50 (ms)", "ttft_p50_ms", "{:.1f}"), ("TTFT p99 (ms)", "ttft_p99_ms", "{:.1f}"),
            ("TPOT p50 (ms)", "tpot_p50_ms", "{:.2f}"), ("TPOT p99 (ms)", "tpot_p99_ms", "{:.2f}"),
            ("output tokens/s", "tokens_per_s", "{:.1f}"),
            ("KV transfer tail / TTFT (p50)", "kv_transfer_share_of_ttft_p50", "{:.1%}"),
            ("KV moved (MB)", "kv_bytes", "{:.2f}"),
            (f"goodput (req/s, TTFT<={out['ttft_target_s']}s & TPOT<={out['tpot_target_s']}s)",
             "goodput_rps", "{:.2f}")]
    lines = [f"pdkv bench serve: {out['workload']}, medians of {out['repeats']} repeats",
             f"{'':52s} {'colocated':>12s} {'1P1D':>12s}"]
    for label, key, fmt in rows:
        c, d = t["colocated"][key], t["disagg"][key]
        if key == "kv_bytes":
            c, d = c / 1e6, d / 1e6
        lines.append(f"{label:52s} {fmt.format(c):>12s} {fmt.format(d):>12s}")
    lines.append(f"TTFT p50 added by disaggregation: {out['ttft_p50_added_by_disagg']:+.1%}")
    return "\n".join(lines)
