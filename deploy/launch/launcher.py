"""Launching a deployment on one machine: the router and every worker as processes.

``Cluster`` starts the router, then the workers (devices round-robin), waits until the
router reports every worker ready, and tears everything down on failure or exit: a
clean shutdown through the router first, then SIGTERM, then SIGKILL, each with a
deadline. Workers also get SIGTERM if the launcher dies (``PR_SET_PDEATHSIG``) and exit on
their own when the router goes silent, so nothing is left behind. A worker that dies is
named with its exit status and the last lines of its log (``WorkerDied``).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from common.auth import Keys, create_keys
from common.config import ServeConfig
from common.sizing import split_cores
from deploy.router.client import Client

logger = logging.getLogger(__name__)


RANK = "rank"
"""Role of a tensor-parallel worker's follower ranks (rank 0 has the worker's role)."""


NOT_REGISTERED = ("router", "frontend", RANK)
"""Processes the router does not list as workers (the launcher waits only for the others)."""


class WorkerDied(RuntimeError):
    """A process of the deployment exited; the message names it and says why."""


@dataclass
class Proc:
    name: str
    role: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen | None = None
    reaped: bool = field(default=False)
    cores: list[int] | None = None
    """The CPU cores it may run on (its affinity); None: the launcher's."""

    def why(self) -> str:
        code = self.popen.returncode if self.popen else None
        if code is not None and code < 0:
            status = f"killed by signal {signal.Signals(-code).name}"
        else:
            status = f"exited with status {code}"
        tail = _tail(self.log, 8)
        return f"{self.role} {self.name} (pid {self.popen.pid}) {status}" + (
            f"; last log lines:\n{tail}" if tail else "")


def _tail(path: Path, n: int) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join("    " + line for line in lines[-n:])


def _child_setup(cores: list[int] | None) -> None:
    """In the child before exec: its cores (the affinity its torch threads follow), and
    death with its parent."""
    if cores:
        os.sched_setaffinity(0, cores)
    _die_with_parent()


def _die_with_parent() -> None:
    # Linux: SIGTERM this child when the launcher dies, even by SIGKILL.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


class Cluster:
    """Router + workers on this machine.

    Args:
        config: the serving config (the router hands it to every worker).
        mode: 'disagg' (prefill and decode workers) or 'colocated'.
        num_prefill: prefill workers (disagg).
        num_decode: decode workers (disagg) or colocated workers.
        devices: devices assigned round-robin to workers (``cpu``, ``cuda:0``, ...).
        log_dir: free logs and process logs; a temporary directory when None.
        threads: torch threads per worker; 0 (default): one per core a worker may run
            on. Then CPU workers share the host's cores out in even blocks (1P1D on 2
            cores: one core each), so that two busy workers never fight for one core.
        keys_dir: the deployment's key directory; None: a fresh one for this run, made in
            the private socket directory and removed with it.
        secure: False runs without keys (no authentication; loopback only): the
            baseline that ``pdkv bench`` measures authentication against.
        metrics_port: the router serves the deployment's metrics over HTTP on this port
            of ``metrics_host`` (0: a free port; ``metrics_url`` says which); None: not.
        router_process: False: the caller runs the router at ``router_addr`` in its own
            process (``pdkv serve``: ``deploy.http.hosted``); ``start`` then only starts
            the workers, and the caller waits for them and shuts them down.

    At ``stop`` the deployment's final metrics are written to ``<log_dir>/metrics.prom``
    (Prometheus text format), next to the free logs they agree with.
    """

    def __init__(self, config: ServeConfig, mode: str = "disagg", num_prefill: int = 1,
                 num_decode: int = 1, devices: list[str] | None = None,
                 log_dir: str | None = None, threads: int = 0,
                 keys_dir: str | None = None, secure: bool = True,
                 metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
                 router_process: bool = True) -> None:
        if mode not in ("disagg", "colocated"):
            raise ValueError(f"mode={mode!r}; allowed: disagg, colocated")
        if num_decode < 1 or (mode == "disagg" and num_prefill < 1):
            raise ValueError("need at least one decode (and one prefill in disagg mode)")
        self.config, self.mode = config, mode
        self.devices = devices or ["cpu"]
        # a temporary log directory survives a failure (its path is printed); cleanup()
        # removes it after a clean run
        self._tmp_logs = log_dir is None
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="pdkv-logs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.sock_dir = Path(tempfile.mkdtemp(prefix="pdkv-sock-"))  # 0700
        self.keys_dir: Path | None = None
        if secure:
            self.keys_dir = Path(keys_dir) if keys_dir else self.sock_dir / "keys"
            if not keys_dir:
                create_keys(self.keys_dir)
        self.threads = threads
        self.metrics_port, self.metrics_host = metrics_port, metrics_host
        self.metrics_url = ""
        self.router_addr = self._address("router")
        self.router_process = router_process
        self.procs = self._plan(num_prefill, num_decode)
        self._share_cores()
        self.client: Client | None = None
        self.final_stats: dict = {}

    def _address(self, name: str) -> str:
        if self.config.transport == "ipc":
            return f"ipc://{self.sock_dir}/{name}.sock"
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return f"tcp://127.0.0.1:{s.getsockname()[1]}"

    def _plan(self, num_prefill: int, num_decode: int) -> list[Proc]:
        base = [sys.executable, "-m", "deploy.cli"]
        auth = ["--auth-keys", str(self.keys_dir)] if self.keys_dir else []
        cfg_json = json.dumps(self.config.to_dict())
        metrics = [] if self.metrics_port is None else [
            "--metrics-port", str(self.metrics_port), "--metrics-host", self.metrics_host]
        procs = [Proc("router", "router", [*base, "router", "--bind", self.router_addr,
                                           "--config-json", cfg_json, *metrics, *auth],
                      self.log_dir / "router.log")] if self.router_process else []
        roles = ([("prefill", f"prefill{i}") for i in range(num_prefill)]
                 + [("decode", f"decode{i}") for i in range(num_decode)]
                 if self.mode == "disagg" else
                 [("colocated", f"colocated{i}") for i in range(num_decode)])
        device = 0  # every rank of every worker gets the next device, round-robin
        for role, name in roles:
            tp = self.config.role_tp(role)
            check_group_devices(name, [self.devices[(device + r) % len(self.devices)]
                                        for r in range(tp)])
            ranks = [] if tp == 1 else ["--tp-size", str(tp), "--tp-address",
                                        self._tp_address(), "--tp-timeout-s",
                                        str(self.config.tp_timeout_s),
                                        "--tp-rendezvous-timeout-s",
                                        str(self.config.ready_timeout_s)]
            for rank in range(tp):
                argv = [*base, role, "--router", self.router_addr, "--name", name,
                        "--device", self.devices[device % len(self.devices)], "--log-dir",
                        str(self.log_dir), "--threads", str(self.threads), *ranks, *auth]
                device += 1
                if role == "prefill":  # every rank of a prefill group sends its own heads
                    argv += ["--kv-bind", self._address(name if not rank else
                                                        f"{name}.tp{rank}")]
                if not rank and self.config.routing == "prefix":  # rank 0 publishes
                    argv += ["--kv-events-endpoint", self._address(f"{name}.events"),
                             "--kv-events-replay-endpoint",
                             self._address(f"{name}.events-replay")]
                if rank:  # a follower rank: no router registration, a log of its own
                    procs.append(Proc(f"{name}.tp{rank}", RANK, [*argv, "--tp-rank",
                                      str(rank)], self.log_dir / f"{name}.tp{rank}.log"))
                    continue
                procs.append(Proc(name, role, argv, self.log_dir / f"{name}.log"))
        return procs

    def _share_cores(self) -> None:
        """With ``threads`` 0, pin each CPU worker process to its block of the host's
        cores (its torch threads follow its affinity); a GPU worker or a set thread
        count keeps the launcher's affinity.

        The router (and a front door in the caller's process) needs a core too: with a
        core to spare it gets one of its own, else it shares the first worker's. A
        worker's torch threads on every core beside a busy front door wait, region after
        region, for the thread the front door pushed off its core (a colocated worker on
        both of 2 cores served a 4-layer model at 100 tokens/s, docs/benchmarks)."""
        workers = [p for p in self.procs if p.role != "router"]
        on_cpu = all("--device" not in p.argv
                     or p.argv[p.argv.index("--device") + 1] == "cpu" for p in workers)
        cores = sorted(os.sched_getaffinity(0))
        if self.threads or not on_cpu or len(cores) < 2:
            return
        spare = len(cores) > len(workers)
        blocks = split_cores(len(workers), cores[1:] if spare else cores)
        self.router_cores = cores[:1] if spare else blocks[0]
        for p, block in zip(workers, blocks):
            p.cores = block
        for p in self.procs:
            if p.role == "router":
                p.cores = self.router_cores

    router_cores: list[int] | None = None
    """Where the router runs (and should a front door in the caller's process): a core of
    its own when one is spare, else the first worker's (a prefill's in a disaggregated
    deployment, idle while decodes step), so that it never takes a decode's core
    mid-step; None: unpinned."""

    def _tp_address(self) -> str:
        """A group's rendezvous: a free TCP port on loopback (gloo needs TCP)."""
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return f"tcp://127.0.0.1:{s.getsockname()[1]}"

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, progress: Callable[[dict], None] | None = None) -> Cluster:
        """Start every process and wait for every ready signal (deadline from config).

        ``progress``, if given, is called about twice a second while waiting with
        ``{"registered", "ready", "total", "elapsed_s"}`` (workers build their models
        between registering and ready)."""
        try:
            for p in self.procs:
                self._spawn(p)
            if not self.router_process:
                return self  # the caller's router waits for them (``worker_names``)
            keys = Keys(self.keys_dir) if self.keys_dir else None
            self.client = Client(self.router_addr, "launcher", keys, identity="operator")
            self._wait_ready(progress=progress)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, p: Proc) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(p.log, "ab") as log:
            p.popen = subprocess.Popen(p.argv, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, env=env,
                                       preexec_fn=partial(_child_setup, p.cores))

    def restart(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Kill process ``name`` (if it runs) with ``sig`` and start it again with the
        same command line; a worker registers again under its name, a router binds the
        same address and the workers rejoin it (faults in tests and soak runs). Call it
        from the thread that started the cluster: a child is signalled when the thread
        that started it ends (``PR_SET_PDEATHSIG``)."""
        p = next(p for p in self.procs if p.name == name)
        if p.popen is not None and p.popen.poll() is None:
            p.popen.send_signal(sig)
            p.popen.wait(30)
        self._spawn(p)

    def wait_ready(self, names: set[str] | None = None) -> None:
        """Wait until the router reports every worker (or ``names``) ready."""
        self._wait_ready(names)

    def _wait_ready(self, names: set[str] | None = None,
                    progress: Callable[[dict], None] | None = None) -> None:
        t0 = time.monotonic()
        deadline = t0 + self.config.ready_timeout_s
        want = names or self.worker_names()
        while time.monotonic() < deadline:
            self.check()
            try:
                status = self.client.status(0.5)
            except TimeoutError:
                continue
            workers, self.metrics_url = status.workers, status.metrics_url
            ready = {n for n, w in workers.items() if w["ready"] and not w["lost"]}
            if progress is not None:
                progress({"registered": len(want & set(workers)), "ready": len(want & ready),
                          "total": len(want), "elapsed_s": time.monotonic() - t0})
            if want <= ready:
                logger.info("launcher: %d workers ready", len(want))
                return
            time.sleep(0.1)
        raise TimeoutError(f"workers not ready within {self.config.ready_timeout_s}s "
                           f"(see logs in {self.log_dir})")

    def events_endpoints(self) -> dict[str, tuple[str, str]]:
        """Each worker's KV events (PUB, replay) addresses, as it was told to bind them
        (``routing = "prefix"``; docs/kv_events.md)."""
        out = {}
        for p in self.procs:
            if "--kv-events-endpoint" in p.argv:
                i, j = (p.argv.index(f) + 1 for f in ("--kv-events-endpoint",
                                                      "--kv-events-replay-endpoint"))
                out[p.name] = (p.argv[i], p.argv[j])
        return out

    def worker_names(self) -> set[str]:
        """The workers that register with the router (followers of a TP group do not)."""
        return {p.name for p in self.procs if p.role not in NOT_REGISTERED}

    def check(self) -> None:
        """Raise ``WorkerDied`` if any process has exited."""
        for p in self.procs:
            if p.popen is not None and p.popen.poll() is not None:
                raise WorkerDied(p.why())

    def check_exit_codes(self) -> None:
        """After ``stop``: raise ``WorkerDied`` naming a process that did not exit 0."""
        for p in self.procs:
            if p.popen is not None and p.popen.returncode not in (0, None):
                raise WorkerDied(p.why())

    def stop(self, timeout_s: float = 20.0) -> dict:
        """Shut down cleanly (stats per worker), then make sure every process is gone."""
        alive = all(p.popen and p.popen.poll() is None for p in self.procs)
        if self.client is None and not alive:
            self._terminate_all(signal.SIGTERM)  # one died: nothing will stop the rest
        if self.client is not None:
            if alive:
                try:
                    bye = self.client.shutdown_bye(timeout_s)
                    self.final_stats = bye.stats
                    self.write_metrics(bye.metrics)
                except TimeoutError:
                    logger.warning("launcher: router did not confirm shutdown")
            else:
                self._terminate_all(signal.SIGTERM)
            self.client.close()
            self.client = None
        self._reap(timeout_s)
        shutil.rmtree(self.sock_dir, ignore_errors=True)
        return self.final_stats

    def write_metrics(self, data: bytes) -> None:
        """The deployment's final metrics to ``<log_dir>/metrics.prom``."""
        if not data:
            return
        from common.metrics import render_snapshot

        (self.log_dir / "metrics.prom").write_bytes(render_snapshot(data)[0])

    def _terminate_all(self, sig: int) -> None:
        for p in self.procs:
            if p.popen is not None and p.popen.poll() is None:
                p.popen.send_signal(sig)

    def _reap(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if sig is not None:
                self._terminate_all(sig)
            for p in self.procs:
                if p.popen is None:
                    continue
                try:
                    p.popen.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            if all(p.popen is None or p.popen.poll() is not None for p in self.procs):
                break
            deadline = time.monotonic() + 5.0

    def freelogs(self) -> list[Path]:
        return sorted(self.log_dir.glob("*.freelog"))

    def cleanup(self) -> None:
        """Remove a temporary log directory (call after a clean run)."""
        if self._tmp_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def check_group_devices(name: str, devices: list[str]) -> None:
    """NCCL wants one GPU per rank of a tensor-parallel group: refuse, before anything
    starts, a group whose ranks the round-robin would put on one GPU.

    Raises:
        ValueError: naming the worker, its ranks' devices and what to give.
    """
    gpus = [f"cuda:{d.split(':')[1] if ':' in d else 0}" for d in devices if d != "cpu"]
    if len(set(gpus)) < len(gpus):
        raise ValueError(f"{name}'s {len(devices)} tensor-parallel ranks would share a GPU "
                         f"({', '.join(devices)}): NCCL needs one GPU per rank; give "
                         f"--devices with at least {len(devices)} distinct GPUs per group")
