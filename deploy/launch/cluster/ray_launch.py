"""``--cluster ray``: the deployment's processes as Ray actors, one placement group per worker.

``RayCluster`` is the one-machine ``Cluster`` with a different way to start a process:
the same command lines, each run by a ``ProcHost`` actor on its placement-group bundle
(``ray_host.py``), so readiness, shutdown through the router, reaping and the free-log
replay are the launcher's own code. What Ray adds:

- placement decided up front (``ray_plan.plan``: spread or pack, one node per worker)
  and refused before anything starts when it does not fit, naming what was asked and what
  the cluster has; placement groups that do not become ready in time are refused the same
  way;
- workers restart (``max_restarts``): a one-rank worker's killed actor comes back (Ray's
  restart), waits out its lease and registers again; a tensor-parallel group that loses a
  rank comes back as a whole, new actors and a new rendezvous on its placement group
  (``ray_groups``); the router counts the old incarnation lost meanwhile (its requests end
  with an error the client may retry), never the deployment;
- free logs of every process in one directory the user names (it must be shared by the
  nodes, e.g. NFS, when they are several hosts): ``pdkv replay DIR`` checks them all.

Ray is optional (``pip install 'pdkv[ray]'``); nothing here imports it at module level.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from common.auth import Keys
from common.config import ServeConfig
from deploy.launch.cluster.ray_actors import RayActors
from deploy.launch.cluster.ray_groups import DRAIN_GRACE_S, GroupSupervisor
from deploy.launch.cluster.ray_host import TP_PLACEHOLDER, RemotePopen, actor_dead
from deploy.launch.cluster.ray_plan import NodeInfo, WorkerSpec, plan
from deploy.launch.launcher import RANK, Cluster, Proc, WorkerDied
from deploy.router.client import Client

logger = logging.getLogger(__name__)

_ROUTER = "{router}"


def import_ray():
    """The ``ray`` module, or an actionable error."""
    try:
        import ray
    except ImportError:
        raise RuntimeError("--cluster ray needs Ray on this machine and every node: pip "
                           "install 'pdkv[ray]'") from None
    return ray


class RayCluster(Cluster):
    """A deployment on a Ray cluster (see the module docstring).

    Args (beyond ``Cluster``'s):
        ray_address: the cluster to join (``HOST:PORT`` of its head, or ``auto``); empty
            starts a Ray instance on this machine for the run.
        placement: ``spread`` or ``pack`` (``ray_plan``).
        gpus: one GPU per worker rank; None: when the cluster has GPUs.
        max_restarts: how often Ray restarts a worker's actor (the router's: never).
        frontend: also run the HTTP front door as an actor (``pdkv serve``), with these
            flags; its URL is ``frontend_url`` once started.
        frontend_env: the front door's extra environment (``PDKV_API_KEY``: never argv).
    """

    def __init__(self, config: ServeConfig, mode: str = "disagg", num_prefill: int = 1,
                 num_decode: int = 1, log_dir: str | None = None, threads: int = 0, *,
                 ray_address: str = "", placement: str = "spread", gpus: bool | None = None,
                 max_restarts: int = 3, frontend: list[str] | None = None,
                 frontend_env: dict[str, str] | None = None,
                 metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
                 keys_dir: str | None = None) -> None:
        self.ray_address, self.placement, self.gpus = ray_address, placement, gpus
        self.max_restarts, self.frontend_args = max_restarts, frontend
        self.frontend_env = dict(frontend_env or {})
        self.frontend_url = ""
        self.placed: RayActors | None = None
        """Placement groups and actors, once ``start`` made them."""
        self._ray = None
        self._started_ray = False
        self._next_check = 0.0
        self._templates: dict[str, list[str]] = {}
        self.supervisor: GroupSupervisor | None = None
        """Restarts tensor-parallel groups once the deployment is ready (ray_groups)."""
        # the key directory is read where each process runs: one machine, or a directory
        # every node mounts at the same path (docs/security.md)
        super().__init__(config, mode, num_prefill, num_decode, None, log_dir, threads,
                         keys_dir=keys_dir, metrics_port=metrics_port,
                         metrics_host=metrics_host)

    # -- command lines ---------------------------------------------------------------------
    def _address(self, name: str) -> str:
        # the node's address and a free port there, filled in by the actor on its node
        return _ROUTER if name == "router" else "tcp://{ip}:{port}"

    def _plan(self, num_prefill: int, num_decode: int) -> list[Proc]:
        procs = super()._plan(num_prefill, num_decode)
        procs[0].argv[procs[0].argv.index("--bind") + 1] = "tcp://{ip}:{port}"
        for p in procs:  # KV events on the worker's node, at ports its actor picks
            for flag, port in (("--kv-events-endpoint", "{eport}"),
                               ("--kv-events-replay-endpoint", "{eport2}")):
                if flag in p.argv:
                    p.argv[p.argv.index(flag) + 1] = f"tcp://{{ip}}:{port}"
        # A group's rendezvous is on its rank 0's node, which all its ranks share
        # (STRICT_PACK), so it binds loopback: the group's connection authenticates
        # nothing and no other host needs to reach it.
        for p in procs:
            if "--tp-address" in p.argv:
                p.argv[p.argv.index("--tp-address") + 1] = \
                    TP_PLACEHOLDER if p.role == RANK else "tcp://127.0.0.1:{lport}"
                if "--kv-bind" in p.argv and p.role != RANK:  # rank 0 binds its KV too
                    p.argv[p.argv.index("--kv-bind") + 1] = "tcp://{ip}:{port2}"
        if self.metrics_port is not None:
            procs[0].argv[procs[0].argv.index("--metrics-host") + 1] = "{ip}"
        if self.frontend_args is not None:
            procs.insert(1, Proc("frontend", "frontend", [
                sys.executable, "-m", "deploy.cli", "frontend", "--router", _ROUTER,
                "--host", "{ip}", "--port", "{port}", *self.frontend_args,
                *(["--auth-keys", str(self.keys_dir)] if self.keys_dir else [])],
                self.log_dir / "frontend.log"))
        return procs

    # -- life ------------------------------------------------------------------------------
    def start(self, progress=None) -> RayCluster:
        """Plan, place, start the router, then every other process at once; wait until
        the router reports every worker ready (``ready_timeout_s``; ``progress`` as in
        ``Cluster.start``). From then on a tensor-parallel group that goes down is
        restarted as a whole (``ray_groups``)."""
        ray = self._ray = import_ray()
        try:
            self._connect(ray)
            gpus = self._use_gpus(ray)
            for p in self.procs:  # Ray shows each actor only the GPU it was given
                if gpus and "--device" in p.argv:
                    p.argv[p.argv.index("--device") + 1] = "cuda:0"
            where = plan(self._specs(), self._nodes(ray), self.placement, gpus)
            self.placed = RayActors(ray, gpus, f"{id(self):x}", self.config.lease_s + 1.0)
            self.placed.place(self._specs(), where, self.config.ready_timeout_s)
            router = self.procs[0]
            self._start_all([router])
            self.router_addr = router.argv[router.argv.index("--bind") + 1]
            for p in self.procs[1:]:
                p.argv = [a.replace(_ROUTER, self.router_addr) for a in p.argv]
            self._start_all(self.procs[1:])
            self.client = Client(self.router_addr, "launcher", Keys(self.keys_dir)
                                 if self.keys_dir else None, identity="operator")
            self._wait_ready(progress=progress)
            self._find_frontend()
            self.supervisor = GroupSupervisor(
                self, self.max_restarts, self.config.tp_timeout_s + DRAIN_GRACE_S,
                self.config.ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_all(self, procs: list[Proc]) -> None:
        """Start ``procs``' actors in parallel: each picks its node's address and ports;
        a follower rank starts once its rank 0 has chosen the group's rendezvous."""
        self._templates.update({p.name: list(p.argv) for p in procs})
        actors = {p.name: self.create_actor(p, launch=p.role != RANK) for p in procs}
        infos = self.placed.get({n: a.info.remote() for n, a in actors.items()},
                             self.config.ready_timeout_s)
        tp = {p.name: {TP_PLACEHOLDER: self.rendezvous(infos[p.name]["argv"])}
              for p in procs if "--tp-size" in p.argv and p.role != RANK}
        infos.update(self.placed.get({p.name: actors[p.name].launch.remote(tp[_worker(p)])
                                      for p in procs if p.role == RANK},
                                     self.config.ready_timeout_s))
        for p in procs:
            self.bind(p, actors[p.name], infos[p.name])

    def create_actor(self, p: Proc, launch: bool):
        """A new actor for ``p`` on its bundle (its command line as planned, addresses
        still to pick); ``launch``: start the process at once."""
        return self.placed.create(p.name, p.role, _worker(p), _rank(p),
                                  self._templates[p.name], str(p.log), launch,
                                  self._restarts(p),
                                  self.frontend_env if p.role == "frontend" else None)

    def bind(self, p: Proc, actor, info: dict) -> None:
        """``p`` is now the process ``actor`` started (``info``: its ``ProcHost.info``)."""
        p.argv, p.popen = info["argv"], RemotePopen(actor, info)
        logger.info("ray: %s on %s (pid %d)", p.name, info["ip"], info["pid"])

    @staticmethod
    def rendezvous(argv: list[str]) -> str:
        """A rank 0's ``--tp-address`` (its node's address, the port its actor chose)."""
        return argv[argv.index("--tp-address") + 1]

    def kill_actors(self, names: list[str]) -> None:
        """Kill the actors of ``names`` for good (their processes get SIGTERM)."""
        self.placed.kill(names)

    def _specs(self) -> list[WorkerSpec]:
        """One spec per process group: a worker's ranks share one placement group."""
        ranks: dict[str, int] = {}
        for p in self.procs:
            ranks[_worker(p)] = ranks.get(_worker(p), 0) + 1
        return [WorkerSpec(p.name, p.role, ranks[p.name]) for p in self.procs
                if p.role != RANK]

    def _restarts(self, p: Proc) -> int:
        """Ray restarts a one-rank worker's actor; a tensor-parallel group's actors have
        none (a rank cannot rejoin a group whose others left): ``GroupSupervisor``
        restarts the whole group. The front door is not restarted."""
        if p.role == "frontend" or "--tp-size" in p.argv:
            return 0
        return self.max_restarts

    def _connect(self, ray) -> None:
        if ray.is_initialized():
            return
        if self.ray_address:
            ray.init(address=self.ray_address, logging_level="warning",
                     log_to_driver=False)
        else:
            ray.init(logging_level="warning", log_to_driver=False, include_dashboard=False)
        self._started_ray = True

    def _use_gpus(self, ray) -> bool:
        if self.gpus is not None:
            return self.gpus
        return ray.cluster_resources().get("GPU", 0) > 0

    def _nodes(self, ray) -> list[NodeInfo]:
        return [NodeInfo(n["NodeID"], n["NodeManagerAddress"], dict(n["Resources"]))
                for n in ray.nodes() if n["Alive"]]

    def _find_frontend(self) -> None:
        """The front door's URL, once its ``/health`` says 200 (``ready_timeout_s``)."""
        fe = next((p for p in self.procs if p.role == "frontend"), None)
        if fe is None:
            return
        host = fe.argv[fe.argv.index("--host") + 1]
        scheme = "https" if "--ssl-certfile" in fe.argv else "http"
        url = f"{scheme}://{host}:{fe.argv[fe.argv.index('--port') + 1]}"
        deadline = time.monotonic() + self.config.ready_timeout_s
        while not _healthy(url):
            self.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the front door at {url} not healthy within "
                                   f"{self.config.ready_timeout_s:g} s (see {fe.log})")
            time.sleep(0.2)
        self.frontend_url = url

    def check(self) -> None:
        """Raise ``WorkerDied`` for the router or front door gone, a one-rank worker Ray
        will not bring back, or a tensor-parallel group that cannot come back (before
        the deployment is ready: any rank gone); a worker that is restarting is not an
        error. Asks the actors at most twice a second (the driver calls this every
        loop)."""
        if time.monotonic() < self._next_check:
            return
        self._next_check = time.monotonic() + 0.5
        groups = self.supervisor
        for p in self.procs:
            if p.popen is None or (groups is not None and groups.owns(p)):
                continue
            code = p.popen.poll()
            if code is not None and (p.role in ("router", "frontend") or "--tp-size" in p.argv
                                     or actor_dead(self.placed.actors[p.name])):
                raise WorkerDied(p.why())
        if groups is not None:
            groups.check()

    def stop(self, timeout_s: float = 20.0) -> dict:
        """The launcher's clean shutdown, then every actor and placement group removed
        (and the Ray instance this run started, if any)."""
        try:
            stats = super().stop(timeout_s)
        finally:
            self._release()
        return stats

    def _release(self) -> None:
        ray = self._ray
        if ray is None or not ray.is_initialized():
            return
        if self.placed is not None:
            self.placed.release()
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def restart(self, name: str) -> None:
        """Kill ``name``'s actor the way a node failure would; Ray restarts it (tests,
        drills)."""
        self._ray.kill(self.placed.actors[name], no_restart=False)

    def freelogs(self) -> list[Path]:
        return sorted(self.log_dir.glob("*.freelog"))


def _worker(p: Proc) -> str:
    """The worker a process belongs to (``colocated0.tp1`` -> ``colocated0``)."""
    return p.name.split(".tp")[0] if p.role == RANK else p.name


def _rank(p: Proc) -> int:
    return int(p.name.rsplit(".tp", 1)[1]) if p.role == RANK else 0


def _healthy(url: str) -> bool:
    import ssl
    import urllib.error
    import urllib.request

    # our own front door's liveness, over its TLS if it has one: the certificate names
    # the host clients use, not necessarily the node address asked here
    ctx = ssl._create_unverified_context() if url.startswith("https") else None
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2, context=ctx) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False
