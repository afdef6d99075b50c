"""The Ray stories, run by tests/test_ray.py inside a network namespace that has only
loopback (so Ray, which rewrites 127.0.0.1 to the machine's external address, finds no
other): a two-node Ray cluster on this machine (``ray start --head`` plus a second
node, token authentication on), then pdkv deployments placed on it. Prints one JSON
object; every process it starts is stopped before it exits.

    python -m tests.ray_story OUT.json WORKDIR
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from common.config import ServeConfig
from common.freelog import replay_file
from common.model import Model, generate_greedy
from deploy.cluster.ray_launch import RayCluster
from deploy.cluster.ray_plan import PlacementError
from deploy.driver import drive
from deploy.workload import WorkloadSpec, make_workload

CFG = ServeConfig(dtype="float64", page_size=4, prefill_pages=96, decode_pages=160,
                  chunk_size=24, max_prefill_tokens=48, heartbeat_s=0.2, lease_s=3.0,
                  ready_timeout_s=90.0, debug_integrity=True)
CPUS_PER_NODE = 3
# Ray reads its auth mode when it is imported: set before anything imports it. Every
# node, the driver and the actors share the token.
_AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
         "RAY_USAGE_STATS_ENABLED": "0"}
os.environ.update(_AUTH)


def _spec(seed: int) -> WorkloadSpec:
    return WorkloadSpec(requests=6, seed=seed, rate=40.0, prompt_len=(1, 60),
                        output_len=(1, 10))


def _reference(model: Model, seed: int) -> dict[str, list[int]]:
    reqs = make_workload(_spec(seed), CFG.model_config().vocab_size)
    return {r.rid: generate_greedy(model, [r.prompt], r.max_new_tokens, page_size=4)[0]
            for r in reqs}


class RayNodes:
    """A head and a second node, each a ``ray start --block`` child: SIGTERM to it stops
    that node's processes, and nothing else on the machine."""

    def __init__(self, work: Path) -> None:
        self.env = {**os.environ, **_AUTH}
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.address = f"127.0.0.1:{s.getsockname()[1]}"
        self.temp = Path(f"/tmp/pdkvray{os.getpid()}")  # socket paths must stay short
        self.work, self.procs = work, []

    def start(self) -> None:
        ray = str(Path(sys.executable).with_name("ray"))
        common = ["--block", "--node-ip-address", "127.0.0.1", "--num-cpus",
                  str(CPUS_PER_NODE), "--num-gpus", "0", "--object-store-memory",
                  str(80 << 20), "--disable-usage-stats"]
        self._spawn("head", [ray, "start", "--head", "--port", self.address.split(":")[1],
                             "--include-dashboard", "false", "--temp-dir", str(self.temp),
                             *common])
        import ray as ray_mod

        deadline = time.monotonic() + 90
        log = self.work / "ray-head.log"
        while b"Ray runtime started" not in log.read_bytes():  # slow under load
            assert time.monotonic() < deadline and self.procs[0].poll() is None, \
                "the Ray head did not come up"
            time.sleep(0.2)
        ray_mod.init(address=self.address, logging_level="warning", log_to_driver=False,
                     _node_ip_address="127.0.0.1")
        self._spawn("node2", [ray, "start", "--address", self.address, *common])
        deadline = time.monotonic() + 60
        while sum(n["Alive"] for n in ray_mod.nodes()) < 2:
            assert time.monotonic() < deadline, "second Ray node did not join"
            time.sleep(0.2)

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.work / f"ray-{name}.log", "wb")
        self.procs.append(subprocess.Popen(argv, env=self.env, stdout=log,
                                           stderr=subprocess.STDOUT))

    def stop(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        for p in reversed(self.procs):
            p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(40)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(self.temp, ignore_errors=True)


def _nodes(cluster: RayCluster) -> dict[str, str]:
    return {p.name: p.popen.info["node_id"] for p in cluster.procs}


def _logs_clean(cluster: RayCluster, killed: tuple[str, ...] = ()) -> list[str]:
    """Problems of every free log; a killed process's log may end without a close
    (Ray SIGKILLs an actor's children with it), but holds no violation."""
    bad = []
    for log in cluster.freelogs():
        report = replay_file(log)
        torn = log.name.split(".")[0] in killed
        if not report.ok or (report.warnings and not torn):
            bad.append(f"{log.name}: {report.format()}")
    return bad


def _outputs(results) -> dict[str, list[int]]:
    return {rid: r.output_ids for rid, r in results.items()}


def story_unplaceable(work: Path) -> str:
    """GPU bundles on a CPU cluster: refused before any placement group exists."""
    cluster = RayCluster(CFG, "disagg", 1, 1, str(work / "gpu"), gpus=True)
    try:
        cluster.start()
    except PlacementError as exc:
        return str(exc)
    cluster.stop()
    return "started"


def story_serve(work: Path, num_prefill: int, reference: dict, restart: dict | None) -> dict:
    """``num_prefill``P1D spread over both nodes; token identity; optionally the decode's
    actor killed, seen lost by the router, restarted by Ray, serving again."""
    out: dict = {}
    t0 = time.monotonic()
    cluster = RayCluster(CFG, "disagg", num_prefill, 1, str(work / f"{num_prefill}p1d"),
                         placement="spread", max_restarts=1)
    try:
        cluster.start()
        out["startup_s"] = time.monotonic() - t0
        out["nodes"] = _nodes(cluster)
        reqs = make_workload(_spec(3), CFG.model_config().vocab_size)
        out["identical"] = _outputs(drive(cluster.client, reqs, check=cluster.check,
                                          timeout_s=60)) == reference
        if restart is not None:
            out.update(_kill_and_return(cluster, restart))
    finally:
        cluster.stop()
    out["log_problems"] = _logs_clean(cluster, ("decode0",) if restart is not None else ())
    out["num_logs"] = len(cluster.freelogs())
    return out


def _kill_and_return(cluster: RayCluster, reference: dict) -> dict:
    seen: list[str] = []
    cluster.restart("decode0")
    deadline = time.monotonic() + 180  # a restart imports torch again: slow under load
    while time.monotonic() < deadline:
        w = cluster.client.status(2.0).workers["decode0"]
        state = "lost" if w["lost"] else "ready" if w["ready"] else "building"
        if not seen or seen[-1] != state:
            seen.append(state)
        if "lost" in seen and state == "ready":
            break
        time.sleep(0.2)
    reqs = make_workload(_spec(5), CFG.model_config().vocab_size)
    after = _outputs(drive(cluster.client, reqs, check=cluster.check, timeout_s=60))
    restarted = cluster.procs[-1].popen._call("info")["restarted"]
    return {"states": seen, "identical_after_restart": after == reference,
            "restarted": restarted}


def story_tp(work: Path, reference: dict) -> dict:
    """A colocated worker of two ranks: one placement group of two bundles on one node,
    the ranks' rendezvous on that node's address; token identity; both logs clean."""
    cfg = CFG.with_overrides(offload=False, decode_tp=2, tp_timeout_s=20.0)
    cluster = RayCluster(cfg, "colocated", 0, 1, str(work / "tp2"), placement="spread")
    out: dict = {}
    try:
        cluster.start()
        out["nodes"] = _nodes(cluster)
        out["bundles"] = [list(b) for b in cluster.groups["colocated0"].bundle_specs]
        reqs = make_workload(_spec(3), CFG.model_config().vocab_size)
        out["identical"] = _outputs(drive(cluster.client, reqs, check=cluster.check,
                                          timeout_s=60)) == reference
    finally:
        cluster.stop()
    out["log_problems"] = _logs_clean(cluster)
    out["logs"] = sorted(p.name for p in cluster.freelogs())
    return out


def story_tp_disagg(work: Path, reference: dict) -> dict:
    """2P1D with tensor-parallel prefills of two ranks each: each group in its own
    placement group on one node, spread across the nodes; every prefill rank binds its
    node's address, the decode streams each half of the heads from the rank holding it;
    token identity; every rank's log clean."""
    cfg = CFG.with_overrides(offload=False, prefill_tp=2, tp_timeout_s=20.0)
    t0 = time.monotonic()
    cluster = RayCluster(cfg, "disagg", 2, 1, str(work / "tp2-2p1d"), placement="spread")
    out: dict = {}
    try:
        cluster.start()
        out["startup_s"] = time.monotonic() - t0
        out["nodes"] = _nodes(cluster)
        reqs = make_workload(_spec(3), CFG.model_config().vocab_size)
        out["identical"] = _outputs(drive(cluster.client, reqs, check=cluster.check,
                                          timeout_s=60)) == reference
    finally:
        cluster.stop()
    out["log_problems"] = _logs_clean(cluster)
    out["logs"] = sorted(p.name for p in cluster.freelogs())
    return out


def story_serve_cli(work: Path, address: str, seed: int, reference: dict) -> dict:
    """``pdkv serve --cluster ray``: the front door is an actor too; completions over
    HTTP equal the reference; SIGINT shuts everything down and replays the free logs."""
    import httpx

    cfg_file = work / "serve.json"
    cfg_file.write_text(json.dumps(CFG.to_dict()))
    proc = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "serve", "--cluster", "ray", "--ray-address",
         address, "--config", str(cfg_file), "--log-dir", str(work / "serve"),
         "--placement", "spread"], stdout=subprocess.PIPE, stderr=open(work / "serve.log", "wb"),
        text=True)
    out: dict = {}
    t0 = time.monotonic()
    try:
        line = proc.stdout.readline()  # "... ready on Ray; OpenAI API at http://...:P/v1"
        out["startup_s"] = time.monotonic() - t0
        out["ready_line"] = line
        url = line.strip().rsplit(" ", 1)[-1]
        got = {}
        for r in make_workload(_spec(seed), CFG.model_config().vocab_size) \
                if url.startswith("http://") else []:  # else serve failed: stderr says why
            body = {"model": "tiny", "prompt": r.prompt, "max_tokens": r.max_new_tokens,
                    "temperature": 0, "return_token_ids": True, "ignore_eos": True}
            resp = httpx.post(f"{url}/completions", json=body, timeout=60)
            got[r.rid] = resp.json()["choices"][0]["token_ids"]
        out["identical"] = got == reference
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out["exit"] = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out["exit"] = proc.wait()
        out["stdout"] = proc.stdout.read()[-500:]
        out["stderr"] = (work / "serve.log").read_text(errors="replace")[-1500:]
    return out


def main(out_path: str, workdir: str) -> None:
    work = Path(workdir)
    model = Model(CFG.model_config())
    ref3, ref5 = _reference(model, 3), _reference(model, 5)
    result: dict = {}
    nodes = RayNodes(work)
    t0 = time.monotonic()
    try:
        nodes.start()
        result["ray_start_s"] = time.monotonic() - t0
        result["unplaceable"] = story_unplaceable(work)
        result["serve"] = story_serve_cli(work, nodes.address, 3, ref3)
        result["2p1d"] = story_serve(work, 2, ref3, ref5)
        result["tp2"] = story_tp(work, ref3)
        result["tp2_disagg"] = story_tp_disagg(work, ref3)
    finally:
        nodes.stop()
        result["total_s"] = time.monotonic() - t0
        Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
