"""``pdkv bench serve``: serving latency and goodput, fair comparisons, rate sweeps.

Without ``--endpoint`` it compares disaggregated and colocated serving **on the same
resources**: 1P1D (one prefill and one decode process) against two colocated workers
(data parallel behind the same router), and with ``--layouts 2p2d`` 2P2D against four;
every worker process has ``--threads`` torch threads, so both sides of a pair have the
same processes and threads. With ``--endpoint URL`` it drives any OpenAI-compatible
server (pdkv's ``pdkv serve`` or another) over streaming HTTP, like ``vllm bench serve``.

For each rate of ``--rates`` (default: ``--rate``) and each deployment, a seeded workload
(Poisson arrivals; every rate point its own seed, so no point reuses another's cached
prefixes) reports TTFT, TPOT p50/p99, tokens/s, SLO attainment (share of requests with
TTFT <= ``--ttft-target`` and TPOT <= ``--tpot-target``) and goodput (requests/s that met
both), DistServe's view. The highest rate a deployment sustains is the highest rate
point whose attainment is at least ``--slo-attainment``. Each figure is the median over
``--repeats``; deployments alternate within a repeat so that machine noise hits all alike.
``--plot FILE.png`` draws the sweep.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace

from benchmarks.goals import run_as_script
from benchmarks.http_client import Record, Target, run, summarize_records
from deploy.launch.config_args import config_from_args
from deploy.launch.flags import add_config_flags, add_workload_flags
from deploy.launch.launcher import Cluster
from deploy.launch.run import devices_from, workload_from_args
from deploy.loadgen.driver import Result, drive
from deploy.loadgen.workload import WorkloadSpec, make_workload

FIGURES = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms",
           "itl_p99_ms", "tokens_per_s", "goodput_rps", "slo_attainment")
LAYOUTS = {"1p1d": [("1P1D", "disagg", 1, 1), ("2 colocated (DP)", "colocated", 0, 2)],
           "2p2d": [("2P2D", "disagg", 2, 2), ("4 colocated (DP)", "colocated", 0, 4)]}


def records_of(results: dict[str, Result]) -> list[Record]:
    """The router client's results as client-side records (every token message)."""
    return [Record(r.prompt_len, r.t_submit, list(r.t_tokens), r.t_done, len(r.output_ids),
                   r.reason, "" if r.ok else f"{r.reason or 'lost'}: {r.error}")
            for r in results.values()]


def point(records: list[Record], args: argparse.Namespace) -> dict:
    out = summarize_records(records, args.ttft_target, args.tpot_target)
    out["slo_attainment"] = out["goodput_rps"] / out["requests_per_s"] if \
        out["requests_per_s"] else 0.0
    return out


def _specs(args: argparse.Namespace, rep: int) -> list[tuple[float, WorkloadSpec]]:
    """Each rate point of repeat ``rep`` with a seed of its own: no point or repeat
    reuses the prompts, and so the cached prefixes, of another (a server's prefix cache
    would otherwise serve every repeat after the first from cache)."""
    base = workload_from_args(args)
    rates = args.rates or [args.rate]
    return [(rate, replace(base, rate=rate, seed=base.seed + 1000 * i + 100_000 * rep))
            for i, rate in enumerate(rates)]


def _sweep_cluster(args, rep: int, mode: str, n_p: int, n_d: int) -> dict[float, dict]:
    cfg = config_from_args(args)
    vocab = cfg.model_config().vocab_size
    cluster = Cluster(cfg, mode, n_p, n_d, devices=devices_from(args.devices),
                      threads=args.threads).start()
    try:
        return {rate: point(records_of(drive(cluster.client, make_workload(spec, vocab),
                                             check=cluster.check)), args)
                for rate, spec in _specs(args, rep)}
    finally:
        cluster.stop()
        cluster.check_exit_codes()
        cluster.cleanup()


def _sweep_endpoint(args, rep: int) -> dict[float, dict]:
    target = Target(args.endpoint.rstrip("/"), model=args.served_model or "",
                    api_key=args.api_key or "", token_ids=not args.no_token_ids,
                    ignore_eos=args.ignore_eos)
    vocab = args.vocab_size or config_from_args(args).model_config().vocab_size
    return {rate: point(run(target, make_workload(spec, vocab)), args)
            for rate, spec in _specs(args, rep)}


def main(args: argparse.Namespace) -> int:
    args.repeats = args.repeats or (1 if args.quick else 3)
    devices_from(args.devices)  # before any deployment starts
    args.requests = args.requests or (12 if args.quick else 48)
    if args.endpoint:
        deployments = [(args.endpoint, None)]
    else:
        deployments = [(name, (mode, n_p, n_d)) for layout in args.layouts
                       for name, mode, n_p, n_d in LAYOUTS[layout]]
    runs: dict[str, list[dict[float, dict]]] = {name: [] for name, _ in deployments}
    for rep in range(args.repeats):
        for name, how in deployments:
            runs[name].append(_sweep_endpoint(args, rep) if how is None else
                              _sweep_cluster(args, rep, *how))
            print(f"  repeat {rep + 1}/{args.repeats} {name} done", file=sys.stderr)
    out = _result(args, runs)
    print(json.dumps(out) if args.json else format_table(out))
    if args.plot:
        plot(out, args.plot)
    failed = {name: pts for name, d in out["deployments"].items()
              for pts in [[r for r, p in d["points"].items() if p["ok"] != p["requests"]]]
              if pts}
    if failed:
        print(f"pdkv bench serve: requests failed at rates {failed}", file=sys.stderr)
        return 0 if args.report_only else 1
    return 0


def _result(args: argparse.Namespace, runs: dict[str, list[dict[float, dict]]]) -> dict:
    deployments = {}
    for name, reps in runs.items():
        points = {}
        for rate in reps[0]:
            pts = [r[rate] for r in reps]
            points[rate] = {f: statistics.median(p[f] for p in pts) for f in FIGURES}
            points[rate]["requests"] = pts[0]["requests"]
            points[rate]["output_tokens"] = min(p["output_tokens"] for p in pts)
            points[rate]["ok"] = min(p["ok"] for p in pts)
        sustained = [r for r, p in points.items() if p["slo_attainment"] >= args.slo_attainment]
        deployments[name] = {"points": points, "max_rate_under_slo": max(sustained, default=0)}
    return {"workload": {"requests": args.requests, "seed": args.seed,
                         "prompt_len": args.prompt_len, "output_len": args.output_len,
                         "turns": args.turns, "shared_prefix": args.shared_prefix},
            "resources": _resources(args), "repeats": args.repeats,
            "slo": {"ttft_s": args.ttft_target, "tpot_s": args.tpot_target,
                    "attainment": args.slo_attainment},
            "deployments": deployments}


def _resources(args: argparse.Namespace) -> str:
    if args.endpoint:
        return f"the server at {args.endpoint}"
    return (f"each pair has the same worker processes, {args.threads} torch thread(s) each, "
            f"on {args.devices}, behind one router")


def format_table(out: dict) -> str:
    slo = out["slo"]
    lines = [f"pdkv bench serve: {out['workload']}, medians of {out['repeats']} repeats",
             f"  resources: {out['resources']}",
             f"  SLO: TTFT <= {slo['ttft_s']}s and TPOT <= {slo['tpot_s']}s",
             f"{'rate/s':>7s} {'deployment':18s} {'TTFT p50':>9s} {'p99':>8s} "
             f"{'TPOT p50':>9s} {'p99':>8s} {'tok/s':>8s} {'goodput':>8s} {'SLO met':>8s}"]
    rates = sorted({r for d in out["deployments"].values() for r in d["points"]})
    for rate in rates:
        for name, d in out["deployments"].items():
            p = d["points"].get(rate)
            if p is None:
                continue
            lines.append(f"{rate:7.2f} {name:18s} {p['ttft_p50_ms']:8.1f}ms "
                         f"{p['ttft_p99_ms']:6.1f}ms {p['tpot_p50_ms']:7.2f}ms "
                         f"{p['tpot_p99_ms']:6.2f}ms {p['tokens_per_s']:8.1f} "
                         f"{p['goodput_rps']:8.2f} {p['slo_attainment']:8.1%}")
    best = ", ".join(f"{name} {d['max_rate_under_slo']:g}/s"
                     for name, d in out["deployments"].items())
    lines.append(f"highest rate with >= {slo['attainment']:.0%} of requests within the SLO: "
                 f"{best}")
    return "\n".join(lines)


def plot(out: dict, path: str) -> None:
    """TTFT, TPOT (p50 solid, p99 dashed), goodput and SLO attainment against rate."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [(axes[0][0], "TTFT (ms)", "ttft"), (axes[0][1], "TPOT (ms)", "tpot"),
              (axes[1][0], "goodput (requests/s)", "goodput_rps"),
              (axes[1][1], "SLO attainment", "slo_attainment")]
    for name, d in out["deployments"].items():
        rates = sorted(d["points"])
        pts = [d["points"][r] for r in rates]
        for ax, _, key in panels:
            if key in ("ttft", "tpot"):
                line, = ax.plot(rates, [p[f"{key}_p50_ms"] for p in pts], "o-", label=name)
                ax.plot(rates, [p[f"{key}_p99_ms"] for p in pts], "o--",
                        color=line.get_color())
            else:
                ax.plot(rates, [p[key] for p in pts], "o-", label=name)
    for ax, label, _ in panels:
        ax.set_xlabel("request rate (requests/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[1][1].axhline(out["slo"]["attainment"], color="grey", lw=0.8)
    fig.suptitle(f"pdkv bench serve ({out['resources']}; p50 solid, p99 dashed)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_command(bench) -> None:
    """``pdkv bench serve``: its arguments (registered in pyproject.toml)."""
    p = bench.add_parser(
        "serve", help="disaggregated vs colocated on the same resources, rate sweeps, "
                      "or any OpenAI-compatible server (--endpoint)",
        description="Serve one seeded workload per rate point and report TTFT/TPOT p50 "
                    "and p99, tokens/s, SLO attainment and goodput. Without --endpoint: "
                    "1P1D against two colocated workers (data parallel), 2P2D against "
                    "four, every worker process with the same torch threads. With "
                    "--endpoint URL: drive that server over streaming HTTP.",
        epilog="exit status: 0; 1 when a request failed (unless --report-only).")
    p.add_argument("--endpoint", metavar="URL",
                   help="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000; "
                        "prompts are token ids drawn from --model's vocabulary or "
                        "--vocab-size")
    p.add_argument("--rates", type=float, nargs="+", metavar="R",
                   help="rate sweep: requests/s of each point (default: --rate alone)")
    p.add_argument("--layouts", nargs="+", choices=["1p1d", "2p2d"], default=["1p1d"],
                   help="pairs to compare: 1p1d (vs 2 colocated), 2p2d (vs 4 colocated)")
    p.add_argument("--quick", action="store_true",
                   help="1 repeat of 12 requests per point (unless given)")
    p.add_argument("--repeats", type=int, metavar="N",
                   help="runs per point; medians (default 3, 1 with --quick)")
    p.add_argument("--ttft-target", type=float, default=1.0, metavar="S",
                   help="SLO: TTFT target in seconds (default 1.0)")
    p.add_argument("--tpot-target", type=float, default=0.1, metavar="S",
                   help="SLO: TPOT target in seconds (default 0.1)")
    p.add_argument("--slo-attainment", type=float, default=0.9, metavar="F",
                   help="share of requests within the SLO for a rate to count as "
                        "sustained (default 0.9)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw TTFT, TPOT, goodput and attainment against rate (needs "
                        "matplotlib: pip install 'pdkv[plot]')")
    p.add_argument("--json", action="store_true", help="print results as one JSON object")
    p.add_argument("--report-only", action="store_true",
                   help="exit 0 even when requests failed")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--devices", default="cpu", metavar="LIST",
                   help="comma-separated devices given to each deployment's workers "
                        "round-robin, as pdkv run's (default cpu); e.g. cuda:0 puts every "
                        "worker of both sides on one GPU")
    g = p.add_argument_group("with --endpoint")
    g.add_argument("--served-model", metavar="NAME",
                   help="model name to send (default: the server's first in /v1/models)")
    g.add_argument("--api-key", metavar="KEY", help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--vocab-size", type=int, metavar="N",
                   help="draw prompt token ids from [0, N) (default: --model's vocabulary)")
    g.add_argument("--no-token-ids", action="store_true",
                   help="do not ask for return_token_ids (servers that refuse it); tokens "
                        "are then counted from the final usage")
    g.add_argument("--ignore-eos", action="store_true",
                   help="ask the server to generate past end-of-sequence (vLLM extension)")
    add_workload_flags(p, None, "48, 12 with --quick")
    add_config_flags(p)
    p.set_defaults(func=main)


if __name__ == "__main__":
    sys.exit(run_as_script(add_command))
