"""The Ray actor that hosts one pdkv process, and the launcher's handle on it.

Each process of a deployment (router, front door, every worker rank) runs inside its own
Ray actor, placed on its placement-group bundle. The actor starts the same command line
``pdkv run`` starts on one machine (``python -m deploy.cli prefill ...``) as its child, on
its node, with the devices Ray gave it, and dies with it both ways: the child gets SIGTERM
when the actor dies (``PR_SET_PDEATHSIG``, set by ``deathsig.py``: the worker aborts its
requests and closes its free log), and a child that exits is reported by ``poll``. A
process per actor, rather than the worker's loop on an actor thread, keeps one code path
for every launcher (the signals, logs, exit statuses and GPU binding of ``pdkv
prefill``) and leaves the actor's own thread free to answer.

When Ray restarts an actor (``max_restarts``), the new incarnation waits for the old
one's lease to run out (the router must declare it lost before the name is free again),
then starts the command again; the worker registers anew and serves.

``{ip}`` and ``{port}`` in the command line become the node's address and a free port
there (``{port2}``: a second one, for a process that binds two; ``{eport}`` and
``{eport2}``: a worker's KV events and their replay socket), so addresses are
advertised with the node's address: same node means shared memory between prefill and
decode, different nodes ZMQ frames. ``{lport}`` is a free loopback port (a
tensor-parallel group's rendezvous: its ranks share the node).
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import struct
import subprocess
import sys
import time

TP_PLACEHOLDER = "{tp}"
"""A follower's ``--tp-address`` until its rank 0 chose the rendezvous (``launch``)."""


class ProcHost:
    """Actor body (wrapped with ``ray.remote`` by the launcher): one child process.

    ``launch=False`` only reserves the node's address and ports (``info`` says them) and
    waits for ``launch``: a tensor-parallel follower's command line needs its rank 0's
    rendezvous, which rank 0's actor picks on its node."""

    def __init__(self, argv: list[str], log_path: str, restart_delay_s: float,
                 launch: bool = True) -> None:
        import ray

        ctx = ray.get_runtime_context()
        self.restarted = bool(ctx.was_current_actor_reconstructed)
        if self.restarted:
            time.sleep(restart_delay_s)
        ip = ray.util.get_node_ip_address()
        port = _free_port(ip)
        taken = {port}
        more = []  # {port2}; {eport} and {eport2}: a worker's KV events and their replay
        for _ in range(3):
            more.append(next(p for p in iter(lambda: _free_port(ip), None) if p not in taken))
            taken.add(more[-1])
        port2, eport, eport2 = more
        lport = _free_port("127.0.0.1")
        self.argv = [a.replace("{ip}", ip).replace("{port}", str(port))
                     .replace("{port2}", str(port2)).replace("{lport}", str(lport))
                     .replace("{eport}", str(eport)).replace("{eport2}", str(eport2))
                     for a in argv]
        self.node = {"ip": ip, "node_id": ctx.get_node_id()}
        self.log_path = log_path
        self.popen: subprocess.Popen | None = None
        if launch:
            self.launch({})

    def launch(self, subs: dict[str, str]) -> dict:
        """Start the child, each key of ``subs`` in its command line replaced by its
        value; returns ``info``."""
        assert self.popen is None, f"launched twice: {self.argv[:4]}"
        for key, value in subs.items():
            self.argv = [a.replace(key, value) for a in self.argv]
        shim = [sys.executable, "-m", "deploy.launch.cluster.deathsig", str(os.getpid())]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if not env.get("UCX_NET_DEVICES"):  # NIXL between nodes: the interface Ray reaches
            # (unset, transport.nixl holds UCX to loopback)
            env["UCX_NET_DEVICES"] = interface_of(self.node["ip"]) or "lo"
        with open(self.log_path, "ab") as log:  # no preexec_fn: see deathsig.py
            self.popen = subprocess.Popen(
                [*shim, *self.argv], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=env)
        return self.info()

    def info(self) -> dict:
        return {"pid": self.popen.pid if self.popen else 0, "argv": self.argv,
                "restarted": self.restarted, **self.node}

    def poll(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def wait(self, timeout_s: float) -> int | None:
        if self.popen is None:
            time.sleep(timeout_s)
            return None
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def signal(self, sig: int) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(sig)


def interface_of(ip: str) -> str:
    """The name of this host's IPv4 interface holding ``ip`` ('' when none does)."""
    if ip.startswith("127."):
        return "lo"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
            except OSError:  # an interface without an IPv4 address
                continue
            if addr == ip:
                return name
    return ""


_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def _free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


class RemotePopen:
    """What the launcher needs of a ``subprocess.Popen``, over a ``ProcHost`` actor.

    A call that fails because the actor is restarting reads as "still running": Ray
    brings it back and the router sees the worker return. Only an actor that Ray gave up
    on (``DEAD``) reads as a process killed by SIGKILL.
    """

    def __init__(self, actor, info: dict) -> None:
        self.actor, self.info = actor, info
        self.pid = info["pid"]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._call("poll")
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.poll() is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(str(self.info["argv"][:4]), timeout)
            self.returncode = self._call("wait", min(left, 1.0))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self._call("signal", int(sig))

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _call(self, method: str, *args):
        import ray

        try:
            return ray.get(getattr(self.actor, method).remote(*args), timeout=30)
        except ray.exceptions.GetTimeoutError:
            return None
        except ray.exceptions.RayActorError:
            return -signal.SIGKILL if actor_dead(self.actor) else None


def actor_dead(actor) -> bool:
    """True when Ray will not bring ``actor`` back (no restarts left, or it was killed
    for good)."""
    from ray._private import state  # the GCS actor table: no dashboard needed

    try:
        entry = state.actors(actor._actor_id.hex())
    except Exception:  # the GCS itself is gone: nothing will come back
        return True
    return entry.get("State") == "DEAD"
