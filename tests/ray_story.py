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
import threading
import time
from pathlib import Path

from common.config import ServeConfig
from common.freelog import replay_file
from common.metrics import render_snapshot
from common.model import Model, generate_greedy
from deploy.launch.cluster.ray_launch import RayCluster
from deploy.launch.cluster.ray_plan import PlacementError
from deploy.launch.launcher import WorkerDied
from deploy.loadgen.driver import drive
from deploy.loadgen.workload import WorkloadSpec, make_workload
from tests.metrics_helpers import parse

CFG = ServeConfig(dtype="float64", page_size=4, prefill_pages=96, decode_pages=160,
                  chunk_size=24, max_prefill_tokens=48, heartbeat_s=0.2, lease_s=3.0,
                  ready_timeout_s=90.0, debug_integrity=True)
CPUS_PER_NODE = 8  # logical: both deployments at once, whatever the plans
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

    def spawn(self) -> None:
        """Start both nodes at once: the second one's ``ray start`` waits for the head's
        GCS (``wait`` starts it again if it gave up first)."""
        ray = str(Path(sys.executable).with_name("ray"))
        self._common = ["--block", "--node-ip-address", "127.0.0.1", "--num-cpus",
                        str(CPUS_PER_NODE), "--num-gpus", "0", "--object-store-memory",
                        str(80 << 20), "--disable-usage-stats"]
        self._node2 = [ray, "start", "--address", self.address, *self._common]
        self._spawn("head", [ray, "start", "--head", "--port", self.address.split(":")[1],
                             "--include-dashboard", "false", "--temp-dir", str(self.temp),
                             *self._common])
        self._spawn("node2", self._node2)

    def wait(self) -> None:
        """Until the head is up, this driver connected and both nodes alive."""
        import ray as ray_mod

        deadline = time.monotonic() + 90
        log = self.work / "ray-head.log"
        while b"Ray runtime started" not in log.read_bytes():  # slow under load
            assert time.monotonic() < deadline and self.procs[0].poll() is None, \
                "the Ray head did not come up"
            time.sleep(0.2)
        if self.procs[1].poll() is not None:  # the second node gave up waiting: again
            self.procs.pop()
            self._spawn("node2", self._node2)
        ray_mod.init(address=self.address, logging_level="warning", log_to_driver=False,
                     _node_ip_address="127.0.0.1")
        deadline = time.monotonic() + 60
        while sum(n["Alive"] for n in ray_mod.nodes()) < 2:
            assert time.monotonic() < deadline and self.procs[1].poll() is None, \
                "second Ray node did not join"
            time.sleep(0.2)

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.work / f"ray-{name}.log", "ab")
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


def _process(log: Path) -> str:
    """The process a free log belongs to (``prefill0.tp1.1.freelog`` -> ``prefill0.tp1``:
    the ``.1`` is its second incarnation)."""
    parts = log.name.removesuffix(".freelog").split(".")
    return ".".join(parts[:-1] if parts[-1].isdigit() else parts)


def _logs_clean(cluster: RayCluster, killed: tuple[str, ...] = ()) -> list[str]:
    """Problems of every free log; the logs of a killed process may end without a
    close (Ray SIGKILLs an actor's children with it), but holds no violation."""
    bad = []
    for log in cluster.freelogs():
        report = replay_file(log)
        torn = _process(log) in killed
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


def _events_batches(cluster: RayCluster) -> dict[str, float]:
    """KV event batches the router applied per worker (prefix routing follows each
    worker's events at the ports its actor picked, a restarted one's at its new ones)."""
    metrics = parse(render_snapshot(cluster.client.metrics())[0].decode())
    return {labels["publisher"]: value
            for labels, value in metrics.get("pdkv_kv_events_batches_total", [])}


def _states(cluster: RayCluster, names: list[str], deadline_s: float) -> dict:
    """Each worker's states as the router reports them (``lost``, ``building``,
    ``ready``), until every one of ``names`` is ready and the last, restarted while
    watched, was seen lost. The others may have been restarted before (prefill0's
    requests move, so the workload that killed it can end before it is back): their
    restart is the supervisor's event."""
    seen: dict[str, list[str]] = {n: [] for n in names}
    deadline = time.monotonic() + deadline_s  # a restart imports torch again: slow
    while time.monotonic() < deadline:
        cluster.check()  # the launcher's supervision brings the groups back
        workers = cluster.client.status(2.0).workers
        for n in names:
            w = workers.get(n)
            state = "gone" if w is None else "lost" if w["lost"] else \
                "ready" if w["ready"] else "building"
            if not seen[n] or seen[n][-1] != state:
                seen[n].append(state)
        if all(s[-1] == "ready" for s in seen.values()) and "lost" in seen[names[-1]]:
            break
        time.sleep(0.2)
    return seen


def _kill_mid_run(cluster: RayCluster, victim: str) -> dict:
    """SIGKILL process ``victim`` once a request of a long workload finished: what its
    group had in flight moves to the other prefill, so every request finishes."""
    procs = {p.name: p for p in cluster.procs}
    spec = WorkloadSpec(requests=10, seed=11, rate=200.0, prompt_len=(40, 60),
                        output_len=(30, 40))
    killed: list[float] = []

    def kill_once(done: int, _total: int) -> None:
        if not killed and done >= 1:
            procs[victim].popen.kill()
            killed.append(time.monotonic())

    results = drive(cluster.client, make_workload(spec, CFG.model_config().vocab_size),
                    progress=kill_once, check=cluster.check, timeout_s=120,
                    lease_s=CFG.lease_s)
    return {"killed": bool(killed), "failed": sorted(r.reason for r in results.values()
                                                     if not r.ok),
            "ok": sum(r.ok for r in results.values())}


def story_tp_disagg(work: Path, reference: dict, reference_after: dict) -> dict:
    """2P1D with tensor-parallel prefills of two ranks each: each group in its own
    placement group on one node, spread across the nodes; every prefill rank binds its
    node's address, the decode streams each half of the heads from the rank holding it;
    token identity. Then the restarts: prefill0's rank 1 SIGKILLed mid-run (its group
    leaves, the launcher brings all of it back with a new rendezvous) and, while it comes
    back, the decode's actor killed (Ray restarts it); both re-register under their names
    and serve token-identical. A second kill of prefill0's rank 1 finds its one restart
    spent: the launcher reports the group that cannot come back. Every log clean."""
    cfg = CFG.with_overrides(offload=False, prefill_tp=2, tp_timeout_s=20.0)
    t0 = time.monotonic()
    cluster = RayCluster(cfg, "disagg", 2, 1, str(work / "tp2-2p1d"), placement="spread",
                         max_restarts=1)
    out: dict = {}
    try:
        cluster.start()
        out["startup_s"] = time.monotonic() - t0
        out["nodes"] = _nodes(cluster)
        reqs = make_workload(_spec(3), CFG.model_config().vocab_size)
        out["identical"] = _outputs(drive(cluster.client, reqs, check=cluster.check,
                                          timeout_s=60)) == reference
        t1 = time.monotonic()
        out["mid_run"] = _kill_mid_run(cluster, "prefill0.tp1")
        cluster.restart("decode0")
        out["states"] = _states(cluster, ["prefill0", "decode0"], 180)
        out["back_s"] = time.monotonic() - t1
        out["events"] = cluster.supervisor.events
        out["decode_restarted"] = cluster.procs[-1].popen._call("info")["restarted"]
        out["nodes_after"] = _nodes(cluster)
        reqs = make_workload(_spec(5), CFG.model_config().vocab_size)
        out["identical_after_restart"] = _outputs(drive(
            cluster.client, reqs, check=cluster.check, timeout_s=60)) == reference_after
        out["events_batches"] = _events_batches(cluster)
        out["gave_up"] = _kill_for_good(cluster, "prefill0.tp1")
    finally:
        cluster.stop()
    out["log_problems"] = _logs_clean(cluster, ("prefill0.tp1", "decode0"))
    out["logs"] = sorted(p.name for p in cluster.freelogs())
    return out


def _kill_for_good(cluster: RayCluster, victim: str) -> str:
    """SIGKILL ``victim`` once more: its group's restarts are spent, so the launcher's
    check raises, naming it (the message), within the group's drain deadline."""
    next(p for p in cluster.procs if p.name == victim).popen.kill()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            cluster.check()
        except WorkerDied as exc:
            return str(exc)
        time.sleep(0.2)
    return "still running"


def story_serve_cli(work: Path, address: str, seed: int, reference: dict) -> dict:
    """``pdkv serve --cluster ray`` of one colocated worker of two ranks (one placement
    group of two bundles, the ranks' rendezvous on that node's address): the front door
    is an actor too; completions over HTTP equal the reference; SIGINT shuts everything
    down and replays the free logs (both ranks' device and host pools)."""
    import httpx

    cfg_file = work / "serve.json"
    cfg = CFG.with_overrides(decode_tp=2, tp_timeout_s=20.0)  # each rank its host tier
    cfg_file.write_text(json.dumps(cfg.to_dict()))
    proc = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "serve", "--cluster", "ray", "--ray-address",
         address, "--config", str(cfg_file), "--log-dir", str(work / "serve"),
         "--placement", "spread", "--mode", "colocated"], stdout=subprocess.PIPE,
        stderr=open(work / "serve.log", "wb"), text=True)
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
    out["logs"] = sorted(p.name for p in (work / "serve").glob("*.freelog"))
    out["total_s"] = time.monotonic() - t0
    return out


def main(out_path: str, workdir: str) -> None:
    """Ray's nodes boot while the references are computed; the ``pdkv serve`` story (a
    process of its own, its own deployment) runs beside the TP2 2P1D story."""
    work = Path(workdir)
    result: dict = {"phases": {}}
    nodes = RayNodes(work)
    t0 = time.monotonic()
    serve: list[dict] = []
    side = None
    try:
        nodes.spawn()
        model = Model(CFG.model_config())
        ref3, ref5 = _reference(model, 3), _reference(model, 5)
        result["phases"]["reference_s"] = time.monotonic() - t0
        nodes.wait()
        result["ray_start_s"] = time.monotonic() - t0
        result["unplaceable"] = story_unplaceable(work)
        side = threading.Thread(target=lambda: serve.append(
            story_serve_cli(work, nodes.address, 3, ref3)), name="serve-story")
        side.start()
        t1 = time.monotonic()
        result["tp2_disagg"] = story_tp_disagg(work, ref3, ref5)
        result["phases"]["tp2_disagg_s"] = time.monotonic() - t1
    finally:
        if side is not None:
            side.join(300)
        result["serve"] = serve[0] if serve else {"error": "the serve story did not end"}
        result["phases"]["serve_s"] = result["serve"].get("total_s")
        t2 = time.monotonic()
        nodes.stop()
        result["phases"]["ray_stop_s"] = time.monotonic() - t2
        result["total_s"] = time.monotonic() - t0
        Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
