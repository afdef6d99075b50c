"""``pdkv bench routing``: prefix-aware routing against least-loaded, on 2P2D (and 1P2D).

For each layout, two deployments with the same processes and threads, one routing by
prefix (``--routing prefix``: the workers' KV events, conditional disaggregation) and one
by load (``--routing least-loaded``), each serve three seeded closed-loop workloads in
turn (``deploy.loadgen.conversation``: every client sends its next request when its last
one ended):

- ``chat``: multi-turn conversations of 4-8 turns whose history grows (each turn's prompt
  is the conversation so far, the model's real replies included), interleaved across
  clients;
- ``system``: single-turn requests that begin with one of a few long system prompts;
- ``random``: single-turn random prompts, nothing to reuse (the control).

Each prints TTFT p50/p99 (client side), the prefix hit rate (prompt tokens a worker's
host tier supplied, over all prompt tokens, as the router reports them per request: the
larger of the prefill's and the decode's count), the share of prompt tokens some worker
computed (``pdkv_prefill_computed_tokens_total``: what the hits saved in compute),
output tokens/s and the load imbalance (per role, the busiest worker's tokens over the
mean: prefill prompt tokens, decode generated tokens). Every figure is the median over
``--repeats``; the two routings alternate which goes first within a repeat.

Goals (2P2D), judged in the same run (exit 1 on a miss unless ``--report-only``):

- chat: TTFT p50 at least 2x lower than least-loaded's, and a prefix hit rate >= 0.8;
- random: tokens/s >= 0.97x least-loaded's, and no worker above 1.3x its role's mean load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace

from benchmarks.goals import EPILOG, Goals, add_bench_flags, run_as_script
from common.config import ServeConfig
from common.metrics import render_snapshot
from deploy.launch.config_args import config_from_args
from deploy.launch.flags import add_config_flags
from deploy.launch.launcher import Cluster
from deploy.launch.run import devices_from
from deploy.loadgen.conversation import ChatSpec, converse, make_conversations
from deploy.loadgen.driver import Result
from deploy.loadgen.summary import pct

LAYOUTS = {"2p2d": (2, 2), "1p2d": (1, 2)}
ROUTINGS = ("prefix", "least-loaded")
FIGURES = ("ttft_p50_ms", "ttft_p99_ms", "hit_rate", "computed", "tokens_per_s",
           "max_load_ratio")


def workloads(args: argparse.Namespace, seed: int) -> dict[str, ChatSpec]:
    """The three workloads of one repeat (``seed``: the repeat's)."""
    n = 8 if args.quick else args.conversations
    clients = args.clients
    return {
        "chat": ChatSpec(conversations=n, clients=clients, turns=(4, 8),
                         first_len=tuple(args.first_len), user_len=tuple(args.user_len),
                         reply_len=tuple(args.reply_len), seed=seed),
        "system": ChatSpec(conversations=4 * n, clients=clients, turns=(1, 1), systems=4,
                           system_len=args.system_len, first_len=tuple(args.user_len),
                           reply_len=tuple(args.reply_len), seed=seed + 1),
        "random": ChatSpec(conversations=4 * n, clients=clients, turns=(1, 1),
                           first_len=tuple(args.first_len), reply_len=tuple(args.reply_len),
                           seed=seed + 2)}


def figures(results: dict[str, Result], counts: dict[str, dict[str, float]]) -> dict:
    """One workload's figures from its client results and its workers' counters."""
    loads = {role: counts[name] for role, name in _LOAD_OF.items()}
    ok = [r for r in results.values() if r.ok]
    ttft = [r.ttft_s * 1000 for r in ok if r.t_first]
    wall = max(r.t_done for r in ok) - min(r.t_submit for r in ok) if ok else 0.0
    prompt = sum(r.prompt_len for r in ok)
    ratios = [max(v.values()) / statistics.mean(v.values())
              for v in loads.values() if len(v) > 1 and statistics.mean(v.values()) > 0]
    return {"requests": len(results), "ok": len(ok),
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
            "hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
            "computed": sum(counts[_COMPUTED].values()) / prompt if prompt else 0.0,
            "tokens_per_s": sum(len(r.output_ids) for r in ok) / wall if wall else 0.0,
            "max_load_ratio": max(ratios, default=1.0)}


_LOAD_OF = {"prefill": "pdkv_prompt_tokens_total", "decode": "pdkv_generation_tokens_total"}
"""A worker's load, by role: prefill, prompt tokens it prefilled; decode, tokens it
generated."""
_COMPUTED = "pdkv_prefill_computed_tokens_total"


def worker_counts(cluster: Cluster, cfg: ServeConfig) -> dict[str, dict[str, float]]:
    """Each worker's load and computed prompt tokens so far, from the deployment's
    metrics: ``{metric: {worker: value}}``. Workers report every ``heartbeat_s``: wait for
    a report that covers everything done so far."""
    from prometheus_client.parser import text_string_to_metric_families

    time.sleep(2.5 * cfg.heartbeat_s)
    text = render_snapshot(cluster.client.metrics())[0].decode()
    out: dict[str, dict[str, float]] = {name: {} for name in (*_LOAD_OF.values(), _COMPUTED)}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            role = s.labels.get("role", "")
            if s.name == _COMPUTED or (role in _LOAD_OF and s.name == _LOAD_OF[role]):
                out[s.name][s.labels["worker"]] = s.value
    return out


def _delta(after: dict, before: dict) -> dict:
    return {name: {w: v - before.get(name, {}).get(w, 0.0) for w, v in ws.items()}
            for name, ws in after.items()}


def run_deployment(args: argparse.Namespace, cfg: ServeConfig, layout: str, routing: str,
                   seed: int) -> dict[str, dict]:
    """Start one deployment, serve the three workloads, stop it: figures per workload."""
    n_p, n_d = LAYOUTS[layout]
    cfg = replace(cfg, routing=routing)
    vocab = cfg.model_config().vocab_size
    cluster = Cluster(cfg, "disagg", n_p, n_d, devices=devices_from(args.devices),
                      threads=args.threads).start()
    out = {}
    try:
        for name, spec in workloads(args, seed).items():
            before = worker_counts(cluster, cfg)
            results = converse(cluster.client, make_conversations(spec, vocab), spec.clients,
                               label=f"{name}{seed}", check=cluster.check,
                               timeout_s=args.timeout)
            out[name] = figures(results, _delta(worker_counts(cluster, cfg), before))
    finally:
        cluster.stop()
        cluster.check_exit_codes()
        cluster.cleanup()
    return out


def main(args: argparse.Namespace) -> int:
    args.repeats = args.repeats or (1 if args.quick else 3)
    cfg = config_from_args(args)
    devices_from(args.devices)
    runs: dict[tuple[str, str], list[dict]] = {}
    for rep in range(args.repeats):
        for layout in args.layouts:
            order = ROUTINGS if rep % 2 == 0 else ROUTINGS[::-1]
            for routing in order:
                runs.setdefault((layout, routing), []).append(
                    run_deployment(args, cfg, layout, routing, args.seed + 100 * rep))
                print(f"  repeat {rep + 1}/{args.repeats} {layout} {routing} done",
                      file=sys.stderr, flush=True)
    table = {f"{layout} {routing}": {w: _median([r[w] for r in reps])
                                     for w in reps[0]}
             for (layout, routing), reps in runs.items()}
    goals = judge(table, args.layouts)
    if args.json:
        print(json.dumps({"repeats": args.repeats, "config": _config_line(cfg),
                          "figures": table, **goals.to_dict()}))
    else:
        print(format_table(table, args.repeats, cfg))
        goals.print()
    return goals.exit_status(args)


def _median(points: list[dict]) -> dict:
    out = {f: statistics.median(p[f] for p in points) for f in FIGURES}
    out["requests"] = sum(p["requests"] for p in points)   # every repeat's (seeds differ)
    out["failed"] = sum(p["requests"] - p["ok"] for p in points)
    return out


def judge(table: dict, layouts: list[str]) -> Goals:
    goals = Goals("routing")
    if "2p2d" not in layouts:
        return goals
    chat_p, chat_l = table["2p2d prefix"]["chat"], table["2p2d least-loaded"]["chat"]
    goals.at_least("2P2D chat TTFT p50, least-loaded / prefix",
                   chat_l["ttft_p50_ms"] / max(chat_p["ttft_p50_ms"], 1e-9), 2.0,
                   baseline=f"least-loaded {chat_l['ttft_p50_ms']:.1f} ms",
                   measured=f"prefix {chat_p['ttft_p50_ms']:.1f} ms")
    goals.at_least("2P2D chat prefix hit rate", chat_p["hit_rate"], 0.8,
                   baseline=f"least-loaded {chat_l['hit_rate']:.3f}",
                   measured=f"prefix {chat_p['hit_rate']:.3f}")
    rnd_p, rnd_l = table["2p2d prefix"]["random"], table["2p2d least-loaded"]["random"]
    goals.at_least("2P2D random tokens/s, prefix / least-loaded",
                   rnd_p["tokens_per_s"] / max(rnd_l["tokens_per_s"], 1e-9), 0.97,
                   baseline=f"least-loaded {rnd_l['tokens_per_s']:.1f}/s",
                   measured=f"prefix {rnd_p['tokens_per_s']:.1f}/s")
    goals.at_most("2P2D random busiest worker / its role's mean load (prefix)",
                  rnd_p["max_load_ratio"], 1.3,
                  baseline=f"least-loaded {rnd_l['max_load_ratio']:.3f}",
                  measured=f"prefix {rnd_p['max_load_ratio']:.3f}")
    failed = {f"{name} {workload}": f["failed"] for name, figs in table.items()
              for workload, f in figs.items() if f["failed"]}
    goals.at_least("requests that succeeded, every deployment and workload",
                   1 - sum(failed.values()) / max(1, sum(
                       f["requests"] for figs in table.values() for f in figs.values())),
                   1.0, measured=f"failed: {failed or 'none'}")
    return goals


def _config_line(cfg: ServeConfig) -> str:
    return (f"model {cfg.model_path or cfg.model}, page {cfg.page_size}, chunk "
            f"{cfg.chunk_size}, local prefill <= {cfg.local_prefill_tokens} tokens, host "
            f"weight {cfg.routing_host_weight}, imbalance {cfg.routing_imbalance} requests "
            f"and x{cfg.routing_imbalance_ratio}")


def format_table(table: dict, repeats: int, cfg: ServeConfig) -> str:
    lines = [f"pdkv bench routing: medians of {repeats} repeat(s); {_config_line(cfg)}",
             f"{'deployment':20s} {'workload':8s} {'TTFT p50':>9s} {'p99':>9s} "
             f"{'hit rate':>8s} {'computed':>8s} {'tok/s':>8s} {'max load':>8s} "
             f"{'failed':>10s}"]
    for name, figs in table.items():
        for workload, f in figs.items():
            lines.append(f"{name:20s} {workload:8s} {f['ttft_p50_ms']:7.1f}ms "
                         f"{f['ttft_p99_ms']:7.1f}ms {f['hit_rate']:8.3f} "
                         f"{f['computed']:8.3f} "
                         f"{f['tokens_per_s']:8.1f} {f['max_load_ratio']:7.2f}x "
                         f"{f['failed']:>4d} of {f['requests']:<3d}")
    return "\n".join(lines)


def add_command(bench) -> None:
    """``pdkv bench routing``: its arguments (registered in pyproject.toml)."""
    p = bench.add_parser(
        "routing", help="prefix-aware routing against least-loaded (2P2D, 1P2D)",
        description="Serve closed-loop multi-turn chat, shared-system-prompt and random "
                    "workloads on deployments routed by prefix and by load alone; print "
                    "TTFT p50/p99, prefix hit rate, tokens/s and load imbalance, and judge "
                    "the goals (docs/routing.md).",
        epilog=EPILOG)
    add_bench_flags(p, quick="one repeat of 8 conversations (32 single-turn requests) "
                             "per workload, 2P2D only unless --layouts", repeats="3")
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=None,
                   help="deployments to compare (default: 2p2d 1p2d; 2p2d with --quick)")
    p.add_argument("--conversations", type=int, default=12, metavar="N",
                   help="chat conversations per repeat; system and random send 4N "
                        "single-turn requests (default 12)")
    p.add_argument("--clients", type=int, default=8, metavar="N",
                   help="requests in flight at once: closed-loop clients (default 8)")
    p.add_argument("--first-len", type=int, nargs=2, default=[256, 768], metavar=("MIN", "MAX"),
                   help="a conversation's first message, and a random prompt (default 256 768)")
    p.add_argument("--user-len", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"),
                   help="later chat messages, and the user part after a system prompt "
                        "(default 16 64)")
    p.add_argument("--reply-len", type=int, nargs=2, default=[32, 96], metavar=("MIN", "MAX"),
                   help="max_new_tokens of every request (default 32 96)")
    p.add_argument("--system-len", type=int, default=1024, metavar="TOKENS",
                   help="tokens of each of the 4 system prompts (default 1024)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--timeout", type=float, default=900.0, metavar="S",
                   help="longest one workload may take (default 900)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--devices", default="cpu", metavar="LIST",
                   help="devices given to each deployment's workers round-robin (default cpu)")
    add_config_flags(p)
    p.set_defaults(func=_main_with_defaults)


def _main_with_defaults(args: argparse.Namespace) -> int:
    if args.layouts is None:
        args.layouts = ["2p2d"] if args.quick else ["2p2d", "1p2d"]
    return main(args)


if __name__ == "__main__":
    sys.exit(run_as_script(add_command))
