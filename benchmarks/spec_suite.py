"""``pdkv bench spec``: issue 5's three figures in one run, each against its baseline.

1. decode tokens/s with and without speculation (``benchmarks.speculative``, same
   prompts, ``--k``), medians and per-repeat spreads: on a built-in model its own first
   layers as the draft (seeded weights built so that the draft agrees); on a checkpoint
   directory (``--model DIR``) n-gram lookup and the layer-skip draft on real-text
   workloads (editing, quoting, code, summaries), with acceptance;
2. follow-up TTFT with prefix reuse against without for a ``--prefix``-token shared
   prefix: in-process (``benchmarks.speculative``) and through real workers (a 1P1D
   deployment serving a multi-turn workload with ``--offload`` and ``--no-offload``;
   follow-up turns only);
3. host offload GB/s against a plain copy of the same bytes (``benchmarks.offload``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys

from benchmarks import offload, speculative
from benchmarks.goals import Goals, add_bench_flags, run_as_script
from common.config import ConfigError, ServeConfig, resolve_model
from deploy.launch.launcher import Cluster
from deploy.launch.run import check_devices, serve_workload
from deploy.loadgen.summary import pct
from deploy.loadgen.workload import WorkloadSpec


def served_ttft(prefix: int, turns: int, convs: int, offload_on: bool, threads: int,
                model: str = "tiny", device: str = "cpu") -> dict:
    """TTFT of follow-up turns through a real 1P1D deployment."""
    cfg = ServeConfig(**resolve_model(model), offload=offload_on, prefill_pages=1024,
                      decode_pages=1024, host_pages=1024, chunk_size=512,
                      max_prefill_tokens=1024)
    spec = WorkloadSpec(requests=convs * turns, seed=0, rate=1.0, prompt_len=(32, 64),
                        output_len=(4, 8), turns=turns, shared_prefix=prefix,
                        turn_gap_s=1.0)
    cluster = Cluster(cfg, "disagg", 1, 1, devices=[device], threads=threads).start()
    results, stats, _ = serve_workload(cluster, spec)
    cluster.cleanup()
    follow = [r.ttft_s for rid, r in results.items() if not rid.endswith("-t0") and r.ok]
    return {"offload": offload_on, "followups": len(follow),
            "ttft_p50_ms": pct(follow, 50) * 1e3, "ttft_min_ms": min(follow) * 1e3,
            "ttft_max_ms": max(follow) * 1e3,
            "prefix_hit_pages": sum(s.get("prefix_hit_pages", 0) for s in stats.values())}


def main(args: argparse.Namespace) -> int:
    model, device = getattr(args, "model", "tiny"), getattr(args, "device", "cpu")
    try:
        resolve_model(model)
    except ValueError as exc:  # one line before anything runs, as deploy.cli.main prints it
        raise ConfigError(str(exc)) from None  # it names --model and the built-ins
    check_devices([device])
    argv = ["--k", str(args.k), "--repeat", str(args.repeats or 5), "--prefix", str(args.prefix),
            "--config", model, "--device", device]
    if args.quick:
        argv.append("--quick")
    quiet = io.StringIO()  # --json: one object, so the inner printout is dropped
    with contextlib.redirect_stdout(quiet) if args.json else contextlib.nullcontext():
        spec = speculative.main(argv)
    served = [served_ttft(args.prefix, 3, 2 if args.quick else 4, on, args.threads, model,
                          device) for on in (False, True)]
    result = {"speculative": spec, "served_ttft": served,
              "served_ttft_speedup": served[0]["ttft_p50_ms"] / served[1]["ttft_p50_ms"],
              "offload": offload.run(args.quick, None, device)}
    goals = Goals("spec")
    for c in result["offload"]["cases"]:
        goals.at_least(f"host offload {c['case']} vs plain copy", c["offload_vs_plain"],
                       offload.GOAL, measured=f"offload {c['offload_gbps']:.2f} GB/s",
                       baseline=f"plain copy {c['plain_gbps']:.2f} GB/s")
    if args.json:
        print(json.dumps({**result, **goals.to_dict()}))
        return goals.exit_status(args)
    print(f"served follow-up TTFT p50, {args.prefix}-token shared prefix, 1P1D: "
          f"{served[0]['ttft_p50_ms']:.1f} ms without reuse -> "
          f"{served[1]['ttft_p50_ms']:.1f} ms with ({result['served_ttft_speedup']:.2f}x; "
          f"{served[1]['prefix_hit_pages']} prefix-hit pages)")
    goals.print()
    return goals.exit_status(args)


def add_command(bench) -> None:
    """``pdkv bench spec``: its arguments (registered in pyproject.toml)."""
    p = bench.add_parser("spec", help="speculation, prefix reuse and host offload vs baselines",
                         description="Decode tokens/s with and without speculation; follow-up "
                                     "TTFT with and without prefix reuse (in process and "
                                     "through a real 1P1D deployment); host offload GB/s vs a "
                                     "plain copy. Medians and per-repeat spreads.")

    add_bench_flags(p, quick="small sizes", repeats="5")
    p.add_argument("--repeat", dest="repeats", type=int, help=argparse.SUPPRESS)  # old name
    p.add_argument("--k", type=int, default=3, help="draft tokens per step (default 3)")
    p.add_argument("--prefix", type=int, default=2048, help="shared prefix tokens (default 2048)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per served worker")
    p.add_argument("--model", default="tiny", metavar="NAME|DIR",
                   help="the model of the decode and TTFT figures and of the served "
                        "deployment: a built-in (tiny, small, llama-1b-shape, "
                        "llama-8b-shape; default tiny) or a checkpoint directory (then the "
                        "decode figures are n-gram and layer-skip speculation on real text)")
    p.add_argument("--device", default="cpu", metavar="DEVICE",
                   help="cpu (default) or cuda:N: the in-process model, the served "
                        "workers and the offload bench's device pool")
    p.set_defaults(func=main)


if __name__ == "__main__":
    sys.exit(run_as_script(add_command))
