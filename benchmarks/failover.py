"""``pdkv bench failover``: what a client sees when a decode dies under its stream.

A 2P2D deployment with keys serves ``--requests`` concurrent streams; once they stream,
``decode0`` is SIGKILLed (``--fault drain``: drained with ``drain_timeout_s`` 0, so its
requests move at once). The router moves its requests to ``decode1`` through a prefill,
carrying the tokens already streamed. Measured in the same run, per transport
(``--transports ipc tcp``):

- **detected**: the kill to the router's decision that the worker is lost (its log
  line's time against the kill's, both wall clocks of this machine). With a lease of
  ``--lease`` seconds (30 by default) any figure below it came from the closed
  connections, not the lease;
- **added ITL at migration**, per migrated request: the gap between the last token it
  got before the fault and the first one after, less the ITL p50 of the same run's
  unmigrated requests (the baseline: what a token costs without the fault); p50 and max
  over the migrated requests;
- the unmigrated requests' largest gap around the fault (they share the surviving decode
  with the newcomers), and every request's tokens against a run without the fault is the
  tests' job (tests/test_e2e_failover.py), not this bench's.

Medians over ``--repeats``. Goals: every request served; detected within ``--detect-goal``
seconds (0.5); the max added ITL below half the lease (a migrated request never waits
out a lease). Exit 1 on a miss unless ``--report-only``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from dataclasses import replace
from datetime import datetime

from benchmarks.goals import Goals, add_bench_flags, run_as_script
from deploy.launch.config_args import config_from_args
from deploy.launch.flags import add_config_flags, add_workload_flags
from deploy.launch.launcher import Cluster
from deploy.launch.run import workload_from_args
from deploy.loadgen.driver import Result, drive
from deploy.loadgen.summary import pct
from deploy.loadgen.workload import make_workload

VICTIM = "decode0"
FIGURES = ("detect_ms", "added_itl_p50_ms", "added_itl_max_ms", "itl_p50_ms",
           "survivor_gap_max_ms", "migrated")


def run_once(args: argparse.Namespace, transport: str, seed: int) -> dict:
    """One deployment, one fault under load: the figures of that run."""
    cfg = replace(config_from_args(args), transport=transport, lease_s=args.lease,
                  drain_timeout_s=0.0)
    spec = replace(workload_from_args(args), seed=seed)
    cluster = Cluster(cfg, "disagg", 2, 2, threads=args.threads)
    results: dict[str, Result] = {}
    fault = _Fault(cluster, args.fault, args.after_tokens)
    try:
        cluster.start()
        drive(cluster.client, make_workload(spec, cfg.model_config().vocab_size),
              check=lambda: fault(results), into=results, timeout_s=300, lease_s=60.0)
    except BaseException:
        cluster.stop()
        print(f"pdkv bench failover: {transport} failed; logs kept in {cluster.log_dir}",
              file=sys.stderr)
        raise
    cluster.stop()
    detect = _detected_s(cluster.log_dir / "router.log", fault.t_wall)
    out = figures(results, fault.t_mono)
    cluster.cleanup()
    return {**out, "detect_ms": detect * 1e3}


class _Fault:
    """Kill (or drain) the victim once ``after`` tokens streamed in all."""

    def __init__(self, cluster: Cluster, how: str, after: int) -> None:
        self.cluster, self.how, self.after = cluster, how, after
        self.t_mono = self.t_wall = 0.0

    def __call__(self, results: dict[str, Result]) -> None:
        if self.t_mono or sum(len(r.output_ids) for r in results.values()) < self.after:
            return
        proc = next(p for p in self.cluster.procs if p.name == VICTIM)
        self.t_mono, self.t_wall = time.monotonic(), time.time()
        if self.how == "kill":
            proc.popen.kill()
        else:
            from common.control import Drain
            self.cluster.client.send(Drain(VICTIM))


_LOST = re.compile(r"^(\S+ \S+) \S+ \S+: router: (?:worker )?" + VICTIM +
                   r"(?: \(decode, pid \d+\) lost:| drained)")


def _detected_s(router_log, t_wall: float) -> float:
    """Seconds from the fault to the router's log line that acted on it."""
    for line in router_log.read_text().splitlines():
        if m := _LOST.match(line):
            t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            return max(0.0, t - t_wall)
    raise RuntimeError(f"the router never acted on {VICTIM}'s fault (see {router_log})")


def figures(results: dict[str, Result], t_fault: float) -> dict:
    """Added ITL of migrated requests at the fault, against unmigrated requests' ITL."""
    moved = [r for r in results.values() if r.migrations]
    stayed = [r for r in results.values() if not r.migrations]
    itl = pct([b - a for r in stayed for a, b in zip(r.t_tokens, r.t_tokens[1:])], 50)
    added = [_gap_at(r, t_fault) - itl for r in moved]
    survivors = [_gap_at(r, t_fault) for r in stayed if _gap_at(r, t_fault)]
    return {"requests": len(results), "ok": sum(r.ok for r in results.values()),
            "migrated": len(moved), "itl_p50_ms": itl * 1e3,
            "added_itl_p50_ms": pct(added, 50) * 1e3 if added else 0.0,
            "added_itl_max_ms": max(added, default=0.0) * 1e3,
            "survivor_gap_max_ms": max(survivors, default=0.0) * 1e3}


def _gap_at(r: Result, t: float) -> float:
    """The gap between ``r``'s token messages that spans time ``t`` (0: none does)."""
    for a, b in zip(r.t_tokens, r.t_tokens[1:]):
        if a <= t < b:
            return b - a
    return 0.0


def main(args: argparse.Namespace) -> int:
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.quick:
        args.requests = min(args.requests, 8)
    runs: dict[str, list[dict]] = {t: [] for t in args.transports}
    for rep in range(args.repeats):
        for transport in args.transports:
            runs[transport].append(run_once(args, transport, args.seed + rep))
        print(f"  repeat {rep + 1}/{args.repeats} done", file=sys.stderr)
    out = {"fault": args.fault, "lease_s": args.lease, "repeats": args.repeats,
           "workload": {"requests": args.requests, "prompt_len": args.prompt_len,
                        "output_len": args.output_len},
           "transports": {t: _median(reps) for t, reps in runs.items()}}
    goals = Goals("failover")
    for t, d in out["transports"].items():
        goals.at_least(f"{t}: requests served", d["ok"] / max(1, d["requests"]), 1.0,
                       measured=f"{d['ok']} of {d['requests']}")
        if args.fault == "kill":
            goals.at_most(f"{t}: kill noticed vs {args.detect_goal:g} s",
                          d["detect_ms"] / 1e3 / args.detect_goal, 1.0,
                          measured=f"{d['detect_ms']:.0f} ms",
                          baseline=f"lease {args.lease:g} s")
        goals.at_most(f"{t}: max added ITL at migration vs half the lease",
                      d["added_itl_max_ms"] / 1e3 / (args.lease / 2), 1.0,
                      measured=f"{d['added_itl_max_ms']:.0f} ms",
                      baseline=f"ITL p50 {d['itl_p50_ms']:.1f} ms unmigrated")
    if args.json:
        print(json.dumps({**out, **goals.to_dict()}))
    else:
        print(format_table(out))
        goals.print()
    return goals.exit_status(args)


def _median(reps: list[dict]) -> dict:
    d = {f: statistics.median(r[f] for r in reps) for f in FIGURES}
    d["requests"] = reps[0]["requests"]
    d["ok"] = min(r["ok"] for r in reps)
    d["spread_added_itl_max_ms"] = [min(r["added_itl_max_ms"] for r in reps),
                                    max(r["added_itl_max_ms"] for r in reps)]
    return d


def format_table(out: dict) -> str:
    w = out["workload"]
    lines = [f"pdkv bench failover: 2P2D with keys, {w['requests']} streams, decode0 "
             f"{'SIGKILLed' if out['fault'] == 'kill' else 'drained'} mid-stream, lease "
             f"{out['lease_s']:g} s, medians of {out['repeats']}",
             f"  {'transport':9} {'detected':>9} {'migrated':>9} {'added ITL p50':>14} "
             f"{'max':>8} {'ITL p50':>8} {'survivors max gap':>18}   (ms)"]
    for t, d in out["transports"].items():
        lines.append(f"  {t:9} {d['detect_ms']:9.0f} {d['migrated']:9.0f} "
                     f"{d['added_itl_p50_ms']:14.1f} {d['added_itl_max_ms']:8.1f} "
                     f"{d['itl_p50_ms']:8.1f} {d['survivor_gap_max_ms']:18.1f}")
    return "\n".join(lines)


def add_command(bench) -> None:
    """``pdkv bench failover``: its arguments (registered in pyproject.toml)."""
    p = bench.add_parser(
        "failover", help="the stall a request sees when its decode dies, and how fast the "
                         "death is noticed",
        description="Serve concurrent streams through 2P2D (with keys), SIGKILL decode0 once "
                    "--after-tokens tokens streamed, and report: the kill to the router's "
                    "loss decision; per migrated request the added ITL at the move (its gap "
                    "at the fault less the unmigrated requests' ITL p50), p50 and max. "
                    "Defaults here: --requests 16 --rate 0 --output-len 64 96 --prompt-len "
                    "16 96 --lease 30. See docs/operations.md, \"Migration\".",
        epilog="exit status: 0; 1 when a request failed, the kill was noticed later than "
               "--detect-goal, or a migrated request stalled past half the lease (unless "
               "--report-only).")
    add_bench_flags(p, quick="one repeat of 8 streams", repeats="3, 1 with --quick")
    p.add_argument("--transports", nargs="+", choices=["ipc", "tcp"], default=["ipc", "tcp"],
                   help="control and KV addresses of the deployment (default both)")
    p.add_argument("--fault", choices=["kill", "drain"], default="kill",
                   help="SIGKILL decode0 (default), or drain it with drain_timeout_s 0")
    p.add_argument("--after-tokens", type=int, default=96, metavar="N",
                   help="the fault comes once N tokens streamed in all (default 96)")
    p.add_argument("--lease", type=float, default=30.0, metavar="S",
                   help="lease_s of the deployment (default 30: a long lease shows that the "
                        "kill is noticed through closed connections)")
    p.add_argument("--detect-goal", type=float, default=0.5, metavar="S",
                   help="the kill must be noticed within this many seconds (default 0.5)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    add_workload_flags(p, 16)
    add_config_flags(p)
    p.set_defaults(func=main, rate=0.0, prompt_len=[16, 96], output_len=[64, 96])


if __name__ == "__main__":
    sys.exit(run_as_script(add_command))
