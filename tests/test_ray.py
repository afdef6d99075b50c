"""pdkv on a local two-node Ray cluster (tests/ray_story.py), every address on loopback:
the story runs in a network namespace with nothing but ``lo``, Ray's token
authentication on. ``pdkv serve --cluster ray`` of a colocated worker of two ranks (one
placement group) through the front door's actor; 2P1D with tensor-parallel prefills of
two ranks (each group on one node, the groups spread over both nodes), token-identical
to the reference; then a prefill rank SIGKILLed mid-run (its group comes back as a
whole, new rendezvous, same placement group) while the decode's actor is killed and
restarted by Ray, both serving token-identical again; a second kill finds the group's
restarts spent and is reported; every free log of every incarnation clean (the killed
ones may lack their close); a deployment that cannot be placed is refused up front. The
placement planner and the group supervisor's give-up path are unit-tested without Ray.

Budget: two deployments on one Ray cluster, side by side (the ``pdkv serve`` story in a
thread beside the 2P1D one), Ray's nodes booting together while the references are
computed: 104 s at load 10-13, against 176 s for the earlier four deployments one after
the other (load 6-8); docs/cluster.md has the phases. CI installs Ray
(the README's test command) and runs it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from common.config import ServeConfig
from deploy.launch.cluster.ray_groups import GroupSupervisor
from deploy.launch.cluster.ray_launch import RayCluster
from deploy.launch.cluster.ray_plan import NodeInfo, PlacementError, WorkerSpec, bundles, plan
from deploy.launch.launcher import WorkerDied

pytestmark = pytest.mark.timeout(960)


def _netns_ok() -> bool:
    if not shutil.which("unshare") or not shutil.which("ip"):
        return False
    probe = subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"],
                           capture_output=True)
    return probe.returncode == 0


def test_ray_deployments_on_two_nodes_all_on_loopback(tmp_path):
    pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'pdkv[ray]' "
                        "(the README's test command installs it)")
    if not _netns_ok():
        pytest.skip("needs unshare -n (a loopback-only network namespace)")
    out = tmp_path / "result.json"
    cmd = (f"ip link set lo up && exec {sys.executable} -m tests.ray_story {out} {tmp_path}")
    proc = subprocess.Popen(["unshare", "-n", "sh", "-c", cmd], start_new_session=True,
                            stdout=open(tmp_path / "story.log", "wb"), stderr=subprocess.STDOUT)
    try:
        proc.wait(900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log = (tmp_path / "story.log").read_text(errors="replace")[-4000:]
    assert proc.returncode == 0 and out.exists(), log
    r = json.loads(out.read_text())
    print(json.dumps({"ray_start_s": r["ray_start_s"], "total_s": r["total_s"],
                      "serve_startup_s": r["serve"].get("startup_s"),
                      "tp2_2p1d_startup_s": r["tp2_disagg"].get("startup_s"),
                      "restarts_back_s": r["tp2_disagg"].get("back_s"), **r["phases"]}))
    assert r["unplaceable"].startswith("cannot place router") or \
        "cannot place prefill 'prefill0'" in r["unplaceable"], r["unplaceable"]
    assert "GPU: 1" in r["unplaceable"] and "GPU: 0" in r["unplaceable"], r["unplaceable"]
    serve = r["serve"]  # pdkv serve --cluster ray, colocated TP2: HTTP through the door
    assert serve.get("identical") and serve["exit"] == 0, serve
    assert "free logs replayed, clean" in serve["stdout"], serve
    assert serve["logs"] == ["colocated0.freelog", "colocated0.host.freelog",
                             "colocated0.tp1.freelog", "colocated0.tp1.host.freelog"], serve["logs"]
    tpd = r["tp2_disagg"]  # 2P1D, each prefill a TP2 group: its ranks on one node
    assert tpd["identical"] and not tpd["log_problems"], tpd
    assert tpd["nodes"]["prefill0"] == tpd["nodes"]["prefill0.tp1"] != \
        tpd["nodes"]["prefill1"] == tpd["nodes"]["prefill1.tp1"], tpd["nodes"]
    assert tpd["nodes"]["decode0"] in (tpd["nodes"]["prefill0"], tpd["nodes"]["prefill1"])
    # prefill0's rank 1 SIGKILLed mid-run: what its group held moves to prefill1
    mid = tpd["mid_run"]
    assert mid["killed"] and not mid["failed"] and mid["ok"] == 10, mid
    # rank 0 left on its own (1); both came back on their placement group's node, and
    # the decode's actor (killed meanwhile) was restarted by Ray; both re-registered
    [event] = tpd["events"]
    assert event["worker"] == "prefill0" and event["restart"] == 1, event
    assert event["exits"] == {"prefill0": 1, "prefill0.tp1": -9}, event
    assert tpd["nodes_after"]["prefill0"] == tpd["nodes"]["prefill0"], tpd["nodes_after"]
    assert tpd["nodes_after"]["prefill0.tp1"] == tpd["nodes"]["prefill0"]
    # prefill0's requests moved, so it may be back before the states are watched
    assert tpd["states"]["prefill0"][-1] == "ready", tpd["states"]
    assert "lost" in tpd["states"]["decode0"] and tpd["states"]["decode0"][-1] == "ready", \
        tpd["states"]
    assert tpd["decode_restarted"] and tpd["identical_after_restart"], tpd
    # the router follows every worker's KV events, the restarted ones' at their new ports
    assert set(tpd["events_batches"]) == {"prefill0", "prefill1", "decode0"}, tpd
    assert all(n > 0 for n in tpd["events_batches"].values()), tpd["events_batches"]
    # the second kill finds the one restart spent: reported, not retried
    assert tpd["gave_up"].startswith("prefill0: its tensor-parallel group of 2 ranks went "
                                     "down after 1 restart(s)"), tpd["gave_up"]
    # every incarnation wrote new logs; all replay clean (the killed ones may lack a close)
    assert tpd["logs"] == [
        "decode0.1.freelog", "decode0.freelog", "prefill0.1.freelog", "prefill0.freelog",
        "prefill0.tp1.1.freelog", "prefill0.tp1.freelog", "prefill1.freelog",
        "prefill1.tp1.freelog"], tpd["logs"]


def _nodes(*cpus: float, gpus: float = 0) -> list[NodeInfo]:
    return [NodeInfo(f"n{i}" + "0" * 8, f"10.0.0.{i}", {"CPU": c, "GPU": gpus})
            for i, c in enumerate(cpus)]


def _specs(p: int, d: int, tp: int = 1) -> list[WorkerSpec]:
    return [WorkerSpec("router", "router"),
            *(WorkerSpec(f"prefill{i}", "prefill", tp) for i in range(p)),
            *(WorkerSpec(f"decode{i}", "decode", tp) for i in range(d))]


def test_spread_alternates_nodes_and_pack_fills_the_first():
    spread = plan(_specs(2, 2), _nodes(8, 8), "spread", gpus=False)
    assert [spread[n].address for n in ("prefill0", "prefill1", "decode0", "decode1")] == \
        ["10.0.0.1", "10.0.0.0", "10.0.0.1", "10.0.0.0"]
    assert spread["router"].address == "10.0.0.0"
    pack = plan(_specs(2, 2), _nodes(8, 8), "pack", gpus=False)
    assert {n.address for n in pack.values()} == {"10.0.0.0"}


def test_a_tp_group_needs_one_node_with_a_gpu_per_rank():
    assert bundles(WorkerSpec("p", "prefill", 2), gpus=True) == [{"CPU": 1.0, "GPU": 1.0}] * 2
    assert bundles(WorkerSpec("r", "router"), gpus=True) == [{"CPU": 1.0}]
    where = plan(_specs(1, 1, tp=2), _nodes(8, 8, gpus=2), "spread", gpus=True)
    assert where["prefill0"] is not where["decode0"]
    with pytest.raises(PlacementError, match=r"cannot place decode 'decode0' \(2 rank\(s\), "
                       r"\{CPU: 2, GPU: 2\} on one node\).*asks for \{CPU: 5, GPU: 4\}.*"
                       r"10.0.0.0 \(n0000000\): \{CPU: 8, GPU: 2\}"):
        plan(_specs(1, 1, tp=2), _nodes(8, gpus=2), "spread", gpus=True)
    with pytest.raises(ValueError, match="allowed"):
        plan(_specs(1, 1), _nodes(8), "random", gpus=False)


class _LocalActors(RayCluster):
    """A ``RayCluster`` whose processes are local children, not actors: what the group
    supervisor kills is recorded (no Ray needed)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.killed: list[str] = []

    def kill_actors(self, names: list[str]) -> None:
        self.killed.extend(names)


def test_a_group_without_restarts_left_is_reported_and_a_stuck_rank_stopped(tmp_path):
    """A follower exits; rank 0 hangs past the drain deadline: the supervisor stops it
    (SIGTERM), kills the group's actors, and with no restart left raises WorkerDied naming
    the worker and why its rank left."""
    cfg = ServeConfig(prefill_tp=2, offload=False)
    cluster = _LocalActors(cfg, "disagg", 1, 1, str(tmp_path), max_restarts=0)
    try:
        procs = {p.name: p for p in cluster.procs}
        procs["prefill0.tp1"].popen = subprocess.Popen([sys.executable, "-c", "exit(3)"])
        procs["prefill0"].popen = subprocess.Popen(["sleep", "60"])  # never leaves
        groups = GroupSupervisor(cluster, max_restarts=0, drain_s=0.3, place_s=5.0)
        assert list(groups.groups) == ["prefill0"]  # the one-rank decode is Ray's
        procs["prefill0.tp1"].popen.wait(10)
        groups.check()
        assert groups.groups["prefill0"].phase == "draining" and not cluster.killed
        time.sleep(0.4)
        with pytest.raises(WorkerDied, match=r"prefill0: its tensor-parallel group of 2 "
                           r"ranks went down after 0 restart\(s\) \(--ray-max-restarts 0\) "
                           r"and is not brought back; rank prefill0.tp1 \(pid \d+\) exited "
                           r"with status 3"):
            groups.check()
        assert procs["prefill0"].popen.wait(10) == -signal.SIGTERM
        assert cluster.killed == ["prefill0", "prefill0.tp1"]
        assert groups.groups["prefill0"].exits == {"prefill0.tp1": 3, "prefill0": "stopped"}
        with pytest.raises(WorkerDied, match="down for good"):
            groups.check()  # and stays reported
    finally:
        for p in cluster.procs:
            if p.popen is not None and p.popen.poll() is None:
                p.popen.kill()
                p.popen.wait()
        shutil.rmtree(cluster.sock_dir, ignore_errors=True)
