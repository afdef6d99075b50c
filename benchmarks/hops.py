"""``pdkv bench hops``: the TTFT that disaggregation adds at light load, hop by hop.

One colocated worker and one 1P1D deployment run side by side; the same seeded prompts
go one at a time (each after the previous one ended: no queueing, no batching, light
load) to one deployment and then to the other, the order alternating, so that the two
measurements of a prompt lie a fraction of a second apart and the machine's drift hits
both alike. Per prompt it takes the client's TTFT in each, the request's KV bytes (the
router's ``done``) and the time those bytes take on the deployment's data path at that
path's speed measured here in the same run (``shm``: a copy between two buffers; frames
over ``ipc``/``tcp``: a raw pyzmq PUSH/PULL pair moving the same bytes). Then

    hop cost = disaggregated TTFT - colocated TTFT - transfer

per prompt (median over prompts, then over repeats, each repeat on fresh deployments).
Goal: hop cost <= 0.3 ms, judged as the ratio (colocated + transfer + hop cost) /
(colocated + transfer + 0.3 ms) <= 1; exit status 1 on a miss unless ``--report-only``.

To find where the time goes, every process of both deployments runs with the
benchmark-only hop trace (``common.trace``, ``PDKV_TRACE_DIR``): below the figures,
per deployment, each point of a request's path (router, prefill, decode, colocated
worker) with its median milliseconds since the client's submit and since the point
above. The host tier is off unless ``--offload`` is given (a request's copies to it
would run into the next one's TTFT).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace

import numpy as np
import zmq

from benchmarks.goals import Goals, add_bench_flags, run_as_script
from common import trace
from common.config import ServeConfig
from deploy.launch.config_args import config_from_args
from deploy.launch.flags import add_config_flags, add_workload_flags
from deploy.launch.launcher import Cluster
from deploy.launch.run import workload_from_args
from deploy.loadgen.driver import Result, drive
from deploy.loadgen.workload import WorkRequest, make_workload
from deploy.router.routes import label_of

BUDGET_MS = 0.3
DEPLOYMENTS = (("colocated", "colocated", 0, 1), ("1P1D", "disagg", 1, 1))


def data_path(cfg: ServeConfig) -> str:
    """The KV data path of a one-host deployment: ``shm`` or frames over the transport."""
    return "shm" if cfg.shared_memory else cfg.transport


def transfer_s(path: str, nbytes: int, repeats: int = 7) -> float:
    """Seconds ``nbytes`` take on ``path`` at its speed measured now (median)."""
    if nbytes <= 0:
        return 0.0
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    if path == "shm":
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])
    return _zmq_s(path, src, dst, repeats)


def _zmq_s(path: str, src: np.ndarray, dst: np.ndarray, repeats: int) -> float:
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        for s in (pull, push):
            s.setsockopt(zmq.LINGER, 0)
        if path == "ipc":
            addr = f"ipc://{tempfile.gettempdir()}/pdkv-hops-{os.getpid()}.sock"
            pull.bind(addr)
        else:
            pull.bind("tcp://127.0.0.1:*")
            addr = pull.getsockopt_string(zmq.LAST_ENDPOINT)
        push.connect(addr)
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            push.send(src, copy=False)
            frame = pull.recv(copy=False)
            np.copyto(dst, np.frombuffer(frame.buffer, np.uint8))  # lands, as pdkv does
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])
    finally:
        pull.close()
        push.close()
        ctx.term()


def serve_one(cluster: Cluster, req: WorkRequest) -> Result:
    """``req`` alone on ``cluster``: nothing else in flight there."""
    return drive(cluster.client, [replace(req, arrival_s=0.0)], check=cluster.check)[req.rid]


def start_traced(cfg: ServeConfig, mode: str, n_p: int, n_d: int, threads: int
                 ) -> tuple[Cluster, str]:
    """A deployment whose every process keeps a hop trace (in the returned directory)."""
    trace_dir = tempfile.mkdtemp(prefix="pdkv-trace-")
    os.environ[trace.ENV] = trace_dir  # the router and the workers inherit it
    try:
        return Cluster(cfg, mode, n_p, n_d, threads=threads).start(), trace_dir
    finally:
        del os.environ[trace.ENV]


def stop_traced(cluster: Cluster, trace_dir: str) -> list:
    """Stop the deployment (its processes write their marks as they exit); the marks."""
    cluster.stop()
    cluster.check_exit_codes()
    cluster.cleanup()
    marks = trace.read(trace_dir)
    shutil.rmtree(trace_dir, ignore_errors=True)
    return marks


def run_pair(cfg: ServeConfig, warmup: list, requests: list, threads: int
             ) -> dict[str, tuple[dict[str, Result], list]]:
    """Both deployments up at once; each prompt goes to one, then (once it ended) to the
    other, the order alternating, so that the machine's drift between the two
    measurements of a prompt is a fraction of a second. Per deployment: the results of
    ``requests`` and every process's trace marks."""
    up: dict[str, tuple[Cluster, str]] = {}
    try:
        for name, mode, n_p, n_d in DEPLOYMENTS:
            up[name] = start_traced(cfg, mode, n_p, n_d, threads)
        results: dict[str, dict[str, Result]] = {name: {} for name in up}
        for req in warmup:
            for cluster, _ in up.values():
                serve_one(cluster, req)
        for i, req in enumerate(requests):
            for name in (list(up) if i % 2 == 0 else list(up)[::-1]):
                results[name][req.rid] = serve_one(up[name][0], req)
    except BaseException:
        for cluster, _ in up.values():
            cluster.stop()
        raise
    out = {name: (results[name], stop_traced(*up[name])) for name in up}
    for name, (res, _) in out.items():
        failed = [r for r in res.values() if not r.ok]
        if failed:
            raise RuntimeError(f"{name}: {len(failed)} requests failed: {failed[0].error}")
    return out


def timeline(results: dict[str, Result], marks: list) -> dict[str, dict[str, float]]:
    """Every traced point of the requests' path (the client's first token too), in the
    order of their median time: ``{"at": median ms since the client's submit, "step":
    median over requests of ms since the point before it}`` (a step is negative where
    requests reach the two points in either order)."""
    by_rid: dict[str, dict[str, int]] = {}
    for t, point, rid in marks:
        by_rid.setdefault(label_of(rid), {}).setdefault(point, t)
    offsets: dict[str, dict[str, float]] = {}  # label -> point -> ms since submit
    for label, res in results.items():
        t0 = res.t_submit * 1e9
        points = {**by_rid.get(label, {}), "client.first": res.t_first * 1e9}
        offsets[label] = {p: (t - t0) / 1e6 for p, t in points.items()}
    at = {p: statistics.median(o[p] for o in offsets.values() if p in o)
          for p in {p for o in offsets.values() for p in o}}
    order = sorted(at, key=at.get)
    out = {}
    for prev, point in zip(["client.submit", *order], order):
        steps = [o[point] - o.get(prev, 0.0) for o in offsets.values() if point in o]
        out[point] = {"at": at[point], "step": statistics.median(steps)}
    return out


SEGMENTS = ("before the pass", "the pass", "after the pass")
PASS_POINTS = {"colocated": ("colocated.start", "colocated.computed"),
               "1P1D": ("prefill.start", "prefill.computed")}


def segments(results: dict[str, Result], marks: list, name: str) -> dict[str, tuple]:
    """Per prompt, ms from the client's submit to the worker starting the prompt's pass,
    the pass itself, and from its end to the first token at the client."""
    start, end = PASS_POINTS[name]
    seen: dict[str, dict[str, int]] = {}
    for t, point, rid in marks:
        if point in (start, end):
            seen.setdefault(label_of(rid), {}).setdefault(point, t)
    out = {}
    for label, res in results.items():
        pts = seen.get(label, {})
        if start in pts and end in pts:
            t0, t1 = pts[start] / 1e6, pts[end] / 1e6
            out[label] = (t0 - res.t_submit * 1e3, t1 - t0, res.t_first * 1e3 - t1)
    return out


def one_repeat(args: argparse.Namespace, cfg: ServeConfig, warmup: list,
               requests: list) -> dict:
    runs = run_pair(cfg, warmup, requests, args.threads)
    (coloc, _), (disagg, _) = runs["colocated"], runs["1P1D"]
    path = data_path(cfg)
    rows = []
    for rid, d in disagg.items():
        c = coloc[rid]
        xfer = transfer_s(path, d.kv_bytes)
        rows.append({"ttft_colocated_ms": c.ttft_s * 1e3, "ttft_disagg_ms": d.ttft_s * 1e3,
                     "transfer_ms": xfer * 1e3, "exposed_transfer_ms": d.xfer_s * 1e3,
                     "kv_bytes": d.kv_bytes,
                     "hop_cost_ms": (d.ttft_s - c.ttft_s - xfer) * 1e3})
    out = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    # where the hop cost lies: the same prompt's segments, 1P1D minus colocated
    seg = {name: segments(*runs[name], name) for name in runs}
    both = [rid for rid in seg["1P1D"] if rid in seg["colocated"]]
    out["split_ms"] = {s: statistics.median(seg["1P1D"][r][i] - seg["colocated"][r][i]
                                            for r in both) if both else 0.0
                       for i, s in enumerate(SEGMENTS)}
    out["timeline_ms"] = {name: timeline(res, marks) for name, (res, marks) in runs.items()}
    return out


def main(args: argparse.Namespace) -> int:
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.requests = args.requests or (8 if args.quick else 24)
    cfg = config_from_args(args)
    if args.offload is None:
        cfg = cfg.with_overrides(offload=False, overcommit=False)
    spec = workload_from_args(args)
    vocab = cfg.model_config().vocab_size
    warmup = make_workload(replace(spec, requests=args.warmup, seed=spec.seed + 7919), vocab)
    warmup = [replace(r, rid=f"warmup-{r.rid}") for r in warmup]
    requests = make_workload(spec, vocab)
    reps = []
    for rep in range(args.repeats):
        reps.append(one_repeat(args, cfg, warmup, requests))
        print(f"  repeat {rep + 1}/{args.repeats} done", file=sys.stderr)
    out = summarize(reps, args, data_path(cfg))
    goals = judge(out)
    if args.json:
        print(json.dumps({**out, **goals.to_dict()}))
    else:
        print(format_table(out))
        goals.print()
    return goals.exit_status(args)


def summarize(reps: list[dict], args: argparse.Namespace, path: str) -> dict:
    figures = [k for k in reps[0] if k not in ("timeline_ms", "split_ms")]
    out = {"requests": args.requests, "warmup": args.warmup, "repeats": args.repeats,
           "data_path": path, "threads": args.threads,
           **{k: statistics.median(r[k] for r in reps) for k in figures},
           "hop_cost_ms_each": [r["hop_cost_ms"] for r in reps],
           "split_ms": {s: statistics.median(r["split_ms"][s] for r in reps)
                        for s in SEGMENTS}}
    out["timeline_ms"] = {}
    for name in reps[0]["timeline_ms"]:
        points = set.intersection(*(set(r["timeline_ms"][name]) for r in reps))
        med = {p: {k: statistics.median(r["timeline_ms"][name][p][k] for r in reps)
                   for k in ("at", "step")} for p in points}
        out["timeline_ms"][name] = dict(sorted(med.items(), key=lambda kv: kv[1]["at"]))
    return out


def judge(out: dict) -> Goals:
    """hop cost <= 0.3 ms, as the ratio (colocated + transfer + hop cost) / (colocated +
    transfer + 0.3 ms): the paired per-prompt hop cost, not a difference of two medians
    that the machine's noise moves apart."""
    goals = Goals("hops")
    base = out["ttft_colocated_ms"] + out["transfer_ms"]
    goals.at_most(f"1P1D TTFT vs colocated + transfer + {BUDGET_MS:g} ms",
                  (base + out["hop_cost_ms"]) / (base + BUDGET_MS), 1.0,
                  measured=f"hop cost {out['hop_cost_ms']:+.2f} ms, 1P1D "
                           f"{out['ttft_disagg_ms']:.2f} ms",
                  baseline=f"colocated {out['ttft_colocated_ms']:.2f} ms + transfer "
                           f"{out['transfer_ms']:.3f} ms + {BUDGET_MS:g} ms")
    return goals


def format_table(out: dict) -> str:
    lines = [f"pdkv bench hops: {out['requests']} requests one at a time (after "
             f"{out['warmup']} warm-up), {out['threads']} torch thread(s) per worker, "
             f"medians over prompts then {out['repeats']} repeats",
             f"  TTFT colocated (1 worker)   {out['ttft_colocated_ms']:8.2f} ms",
             f"  TTFT 1P1D                   {out['ttft_disagg_ms']:8.2f} ms",
             f"  KV per request              {out['kv_bytes'] / 1024:8.1f} KiB",
             f"  transfer at {out['data_path']:4s} speed       {out['transfer_ms']:8.3f} ms "
             f"(exposed, as the router measures it: {out['exposed_transfer_ms']:.2f} ms)",
             f"  hop cost = 1P1D - colocated - transfer: {out['hop_cost_ms']:+.2f} ms "
             f"(each repeat: {', '.join(f'{x:+.2f}' for x in out['hop_cost_ms_each'])}; "
             f"goal <= {BUDGET_MS:g} ms)",
             "  1P1D - colocated, the same prompt: " + ", ".join(
                 f"{s} {v:+.2f} ms" for s, v in out["split_ms"].items())]
    for name, points in out["timeline_ms"].items():
        lines.append(f"  {name} path (medians): ms since the client's submit, and since "
                     "the point above")
        for point, t in points.items():
            lines.append(f"    {point:28s} {t['at']:8.2f} {t['step']:+8.2f}")
    return "\n".join(lines)


def add_command(bench) -> None:
    """``pdkv bench hops``: its arguments (registered in pyproject.toml)."""
    p = bench.add_parser(
        "hops", help="the TTFT disaggregation adds at light load, hop by hop",
        description="Serve the same seeded prompts one at a time through one colocated "
                    "worker and through 1P1D (alternating); report both TTFTs, the "
                    "request's KV transfer at its data path's speed measured in the same "
                    "run, the hop cost (1P1D - colocated - transfer; goal <= 0.3 ms) and "
                    "each traced point of a request's path (router, prefill, decode) in "
                    "ms since the client's submit. The host tier is off unless --offload.",
        epilog="exit status: 0 goal met; 1 goal missed (unless --report-only) or a request "
               "failed.")

    add_bench_flags(p, quick="1 repeat of 8 requests", repeats="3, 1 with --quick")
    p.add_argument("--warmup", type=int, default=3, metavar="N",
                   help="requests served first on each deployment, not counted (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    add_workload_flags(p, None, "24, 8 with --quick; --rate is not used: one at a time")
    add_config_flags(p)
    p.set_defaults(func=main, output_len=[4, 8])


if __name__ == "__main__":
    sys.exit(run_as_script(add_command))
