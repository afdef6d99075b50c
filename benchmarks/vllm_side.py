"""``pdkv bench vllm``: pdkv against vLLM's CPU build, side by side, on the same checkpoints.

Each checkpoint is served in turn by vLLM (``benchmarks/vllm_peer.sh serve``: vLLM's CPU
build in a venv of its own, ``VLLM_PEER_VENV``), by ``pdkv serve --mode colocated`` (one
worker) and by ``pdkv serve`` 1P1D, and driven by the same client, ``vllm bench serve``
(random dataset, seed 0, ``--ignore-eos`` so every request generates its full length):

| scenario | prompts | in / out | rate | sampling |
| --- | --- | --- | --- | --- |
| ``sat-greedy`` | 128 | 512 / 64 | inf | temperature 0 |
| ``sat-sampled`` | 128 | 512 / 64 | inf | temperature 1.0, top_p 0.9 |
| ``light`` | 64 | 128 / 32 | 8/s | temperature 0 |

Goals, for each pdkv deployment against vLLM's figure from the same run (medians of
``--repeats``):

- at saturation (both samplings): output tokens/s >= 1.2x; TTFT p50 <= 1x; 1P1D TPOT
  p50 <= 0.5x;
- at 8 req/s: TTFT p50 and TPOT p50 <= 0.8x.

A request that fails, or a pdkv server whose free logs do not replay clean at shutdown,
fails the bench. vLLM's model runs on one OpenMP thread on this 2-core box while its
engine and API server take the other core; pdkv's workers run one torch thread per core
they are given: tokens/s per model thread is printed beside tokens/s. Needs the peer's
venv (``bash benchmarks/vllm_peer.sh setup``), so it is not part of the default CI.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks.goals import EPILOG, Goals, add_bench_flags, run_as_script

PEER = Path(__file__).with_name("vllm_peer.sh")
SCENARIOS = {"sat-greedy": ("sat", ["--temperature", "0"]),
             "sat-sampled": ("sat", ["--temperature", "1.0", "--top-p", "0.9"]),
             "light": ("light", ["--temperature", "0"])}
DEPLOYMENTS = ("vllm", "colocated", "1p1d")
MODEL_THREADS = {"vllm": 1, "colocated": 2, "1p1d": 2}
"""Threads running the model on 2 cores: vLLM's one; pdkv colocated's worker on both
cores; 1P1D's prefill and decode one core each."""


class Server:
    """One server of a checkpoint: started, its model id read from /v1/models, stopped."""

    def __init__(self, kind: str, checkpoint: Path, log_dir: Path) -> None:
        self.kind, self.checkpoint = kind, checkpoint
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"{kind}-{checkpoint.name}.log"
        self.proc: subprocess.Popen | None = None
        self.model_id = ""

    def start(self, timeout_s: float = 600) -> Server:
        if self.kind == "vllm":
            out = subprocess.run(["bash", str(PEER), "serve", str(self.checkpoint),
                                  str(self.port)], capture_output=True, text=True, check=True)
            self.pid = int(out.stdout.split()[-1])
        else:
            mode = ["--mode", "colocated", "--decode", "1"] if self.kind == "colocated" \
                else ["--mode", "disagg", "--prefill", "1", "--decode", "1"]
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "deploy.cli", "serve", "--model",
                     str(self.checkpoint), "--port", str(self.port), "--max-waiting", "1024",
                     *mode], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            self.pid = self.proc.pid
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as r:
                    self.model_id = json.load(r)["data"][0]["id"]
                    return self
            except OSError:
                if self.proc is not None and self.proc.poll() is not None:
                    break
                time.sleep(1)
        self.stop()
        raise RuntimeError(f"{self.kind} did not serve {self.checkpoint} (log {self.log})")

    def stop(self) -> int:
        """Stop it; pdkv's exit status says whether its free logs replayed clean."""
        try:
            os.killpg(self.pid, signal.SIGINT if self.kind != "vllm" else signal.SIGTERM)
        except ProcessLookupError:
            return 0
        if self.proc is None:
            for _ in range(60):
                if not _alive(self.pid):
                    return 0
                time.sleep(0.5)
            os.killpg(self.pid, signal.SIGKILL)
            return 0
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(self.pid, signal.SIGKILL)
            return self.proc.wait()


def client(server: Server, scenario: str, out_dir: Path, extra: list[str]) -> dict:
    """One ``vllm bench serve`` run; its saved result (figures by vLLM's names)."""
    kind, sampling = SCENARIOS[scenario]
    name = f"{server.kind}-{server.checkpoint.name}-{scenario}-{time.monotonic_ns()}.json"
    cmd = ["bash", str(PEER), kind, server.url, server.model_id, str(server.checkpoint),
           *sampling, "--ignore-eos", "--save-result", "--result-dir", str(out_dir),
           "--result-filename", name, *extra]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    path = out_dir / name
    if run.returncode or not path.exists():
        raise RuntimeError(f"vllm bench serve failed ({run.returncode}): "
                           f"{run.stdout[-2000:]}{run.stderr[-2000:]}")
    return json.loads(path.read_text())


def figures(result: dict) -> dict:
    return {"tok_s": result["output_throughput"], "ttft_ms": result["median_ttft_ms"],
            "tpot_ms": result["median_tpot_ms"], "completed": result["completed"],
            "failed": result.get("failed", 0), "prompts": result.get("num_prompts", 0)}


def measure(checkpoint: Path, args: argparse.Namespace, out_dir: Path) -> dict:
    """{deployment: {scenario: [figures of each repeat]}} for one checkpoint."""
    out: dict[str, dict[str, list[dict]]] = {}
    extra = ["--num-prompts", str(args.num_prompts)] if args.num_prompts else []
    for kind in args.deployments:
        server = Server(kind, checkpoint, out_dir).start()
        runs: dict[str, list[dict]] = {s: [] for s in args.scenarios}
        status = 1
        try:
            for rep in range(args.repeats):
                for scenario in args.scenarios:
                    runs[scenario].append(figures(client(server, scenario, out_dir, extra)))
                    f = runs[scenario][-1]
                    print(f"  {checkpoint.name} {kind} {scenario} {rep + 1}/{args.repeats}: "
                          f"{f['tok_s']:.1f} tok/s, TTFT {f['ttft_ms']:.0f} ms, TPOT "
                          f"{f['tpot_ms']:.1f} ms, {f['completed']} done", file=sys.stderr,
                          flush=True)
        finally:
            status = server.stop()
        if kind != "vllm" and status != 0:
            raise RuntimeError(f"pdkv serve ({kind}) exited {status}: free logs not clean or "
                               f"a process failed (log {server.log})")
        out[kind] = runs
    return out


def judge(name: str, runs: dict, goals: Goals) -> dict:
    med = {kind: {s: {k: statistics.median(r[k] for r in reps) for k in reps[0]}
                  for s, reps in scen.items()} for kind, scen in runs.items()}
    for kind, scen in runs.items():
        for s, reps in scen.items():
            bad = [r for r in reps if r["failed"] or r["completed"] < r["prompts"]]
            if bad:
                goals.at_least(f"{name} {kind} {s}: every request completed", 0, 1,
                               measured=f"{bad[0]['completed']} of {bad[0]['prompts']}")
    if "vllm" not in med:
        return med
    v = med["vllm"]
    for kind in ("colocated", "1p1d"):
        if kind not in med:
            continue
        p = med[kind]
        for s in ("sat-greedy", "sat-sampled"):
            if s not in p or s not in v:
                continue
            goals.at_least(f"{name} {kind} {s} output tok/s", p[s]["tok_s"] / v[s]["tok_s"],
                           1.2, measured=f"pdkv {p[s]['tok_s']:.1f}",
                           baseline=f"vLLM {v[s]['tok_s']:.1f}")
            goals.at_most(f"{name} {kind} {s} TTFT p50", p[s]["ttft_ms"] / v[s]["ttft_ms"],
                          1.0, measured=f"pdkv {p[s]['ttft_ms']:.0f} ms",
                          baseline=f"vLLM {v[s]['ttft_ms']:.0f} ms")
            if kind == "1p1d":
                goals.at_most(f"{name} 1p1d {s} TPOT p50", p[s]["tpot_ms"] / v[s]["tpot_ms"],
                              0.5, measured=f"pdkv {p[s]['tpot_ms']:.1f} ms",
                              baseline=f"vLLM {v[s]['tpot_ms']:.1f} ms")
        if "light" in p and "light" in v:
            for fig in ("ttft_ms", "tpot_ms"):
                goals.at_most(f"{name} {kind} light {fig[:4].upper()} p50",
                              p["light"][fig] / v["light"][fig], 0.8,
                              measured=f"pdkv {p['light'][fig]:.1f} ms",
                              baseline=f"vLLM {v['light'][fig]:.1f} ms")
    return med


def table(name: str, med: dict) -> str:
    lines = [f"{name}:", f"  {'deployment':10s} {'scenario':12s} {'tok/s':>8s} "
             f"{'tok/s/thread':>12s} {'TTFT p50':>9s} {'TPOT p50':>9s}"]
    for kind, scen in med.items():
        for s, f in scen.items():
            lines.append(f"  {kind:10s} {s:12s} {f['tok_s']:8.1f} "
                         f"{f['tok_s'] / MODEL_THREADS[kind]:12.1f} {f['ttft_ms']:7.0f}ms "
                         f"{f['tpot_ms']:7.1f}ms")
    return "\n".join(lines)


def build_checkpoints(where: Path) -> list[Path]:
    """The two random Llamas (2 layers hidden 128; 4 layers hidden 512) as HF directories."""
    from common.model import export_builtin
    out = []
    for name, builtin, layers in (("llama-2l-h128", "tiny", 2), ("llama-4l-h512", "small", 4)):
        path = where / name
        if not (path / "config.json").exists():
            export_builtin(builtin, path, layers=layers)
        out.append(path)
    return out


def main(args: argparse.Namespace) -> int:
    venv = Path(os.environ.get("VLLM_PEER_VENV", f"{tempfile.gettempdir()}/vllm-peer-venv"))
    if not (venv / "bin" / "vllm").exists():
        print(f"pdkv bench vllm: no vLLM peer at {venv}: run 'bash {PEER} setup' (or set "
              "VLLM_PEER_VENV)", file=sys.stderr)
        return 2
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.quick:
        args.num_prompts = args.num_prompts or 32
    checkpoints = [Path(c).resolve() for c in args.checkpoints] or build_checkpoints(
        Path(args.cache_dir).expanduser())
    goals, out = Goals("vllm"), {}
    with tempfile.TemporaryDirectory(prefix="pdkv-vllm-") as tmp:
        for ckpt in checkpoints:
            med = judge(ckpt.name, measure(ckpt, args, Path(tmp)), goals)
            out[ckpt.name] = med
            if not args.json:
                print(table(ckpt.name, med), flush=True)
    if args.json:
        print(json.dumps({"checkpoints": out, "repeats": args.repeats, **goals.to_dict()}))
    else:
        goals.print()
    return goals.exit_status(args)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def add_command(bench) -> None:
    """``pdkv bench vllm`` (registered in pyproject.toml)."""
    p = bench.add_parser(
        "vllm", help="pdkv colocated and 1P1D against vLLM's CPU build, same checkpoints "
                     "and client",
        description="Serve each checkpoint with vLLM (its CPU build, in the venv that "
                    "'bash benchmarks/vllm_peer.sh setup' makes), pdkv colocated and pdkv "
                    "1P1D; drive each with vllm bench serve at saturation (greedy and "
                    "sampled) and at 8 req/s; judge pdkv against vLLM. Run it alone on "
                    "the machine (flock /tmp/pdkv-bench.lock ...).",
        epilog=EPILOG)
    p.add_argument("checkpoints", nargs="*", metavar="DIR",
                   help="checkpoint directories (default: the 2-layer hidden-128 and "
                        "4-layer hidden-512 random Llamas, built into --cache-dir)")
    p.add_argument("--cache-dir", default="~/.cache/pdkv/bench-checkpoints",
                   help="where the default checkpoints are built (default %(default)s)")
    p.add_argument("--deployments", nargs="+", choices=DEPLOYMENTS, default=list(DEPLOYMENTS))
    p.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    p.add_argument("--num-prompts", type=int, metavar="N",
                   help="prompts per run instead of the scenario's (--quick: 32)")
    add_bench_flags(p, quick="1 repeat of 32 prompts per scenario", repeats="3")
    p.set_defaults(func=main)


if __name__ == "__main__":
    sys.exit(run_as_script(add_command))
