"""Run deploy/k8s/'s pods as the kubelet would, on this machine, on loopback.

Everything a container runs comes from the YAML: its command (or the Dockerfile's
ENTRYPOINT) and arguments, its environment (values, ``fieldRef``, ``configMapKeyRef``,
``secretKeyRef``, with ``$(VAR)`` expanded as Kubernetes does), its volume mounts and
its probes. Secrets are laid out as the kubelet mounts them: each key a symlink to
``..data/KEY``, ``..data`` a symlink to a timestamped directory holding the files with
the volume's ``defaultMode``.

What must change to run on one machine without a cluster, and nothing else, is
rewritten in every string a container or probe uses (``Rewrites``):

- a mount path becomes the pod's directory for that volume (no container filesystem);
- a Service name (``pdkv-router``), ``0.0.0.0`` and the pod IP become ``127.0.0.1``
  (every pod shares this machine's loopback; nothing binds beyond it);
- every container port becomes a free port of this machine (pods here share one port
  space; the manifests' ports may be taken), wherever the port appears;
- ``--device cuda:N`` becomes ``cpu`` (no GPU here);
- the pod's user and group (``runAsUser``/``runAsGroup``, 1000) become the test's own in
  the init containers' ``chown`` (the test is not root).

Probes run as soon as a container started and then every 0.5 s (not every
``periodSeconds``): the test waits for what they say, not for the kubelet's pace.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "k8s"


def entrypoint() -> list[str]:
    """The image's ENTRYPOINT (the Dockerfile's JSON form)."""
    for line in (K8S / "Dockerfile").read_text().splitlines():
        if line.startswith("ENTRYPOINT"):
            return json.loads(line[len("ENTRYPOINT"):])
    raise AssertionError("the Dockerfile has no ENTRYPOINT")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_shims(bin_dir: Path, kubectl_log: Path) -> None:
    """``pdkv``: this checkout's CLI, as the image installs it. ``kubectl``: records the
    Secrets and applies the docs' commands ask for (``create secret generic`` with
    ``--from-file=DIR`` or ``--from-literal=K=V``; ``apply -k DIR``), as JSON lines."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    pdkv = bin_dir / "pdkv"
    pdkv.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m deploy.cli "$@"\n')
    kubectl = bin_dir / "kubectl"
    kubectl.write_text(f"#!{sys.executable}\n" + _KUBECTL.format(log=str(kubectl_log)))
    for f in (pdkv, kubectl):
        f.chmod(0o755)


_KUBECTL = '''
import base64, json, os, sys
args = sys.argv[1:]
if args[:3] == ["create", "secret", "generic"]:
    data = {{}}
    for a in args[4:]:
        if a.startswith("--from-file="):
            d = a.split("=", 1)[1]
            for name in sorted(os.listdir(d)):
                with open(os.path.join(d, name), "rb") as f:
                    data[name] = base64.b64encode(f.read()).decode()
        elif a.startswith("--from-literal="):
            k, v = a.split("=", 1)[1].split("=", 1)
            data[k] = base64.b64encode(v.encode()).decode()
        else:
            sys.exit("kubectl stand-in: unknown argument " + a)
    rec = {{"kind": "Secret", "name": args[3], "data": data}}
elif args[:2] == ["apply", "-k"]:
    rec = {{"kind": "apply", "dir": os.path.realpath(args[2])}}
else:
    sys.exit("kubectl stand-in: only 'create secret generic' and 'apply -k' " + str(args))
with open({log!r}, "a") as f:
    f.write(json.dumps(rec) + "\\n")
'''


def read_kubectl_log(path: Path) -> tuple[dict[str, dict[str, bytes]], list[str]]:
    """(Secrets by name: key -> bytes, the directories applied)."""
    import base64

    secrets, applied = {}, []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "Secret":
            secrets[rec["name"]] = {k: base64.b64decode(v) for k, v in rec["data"].items()}
        else:
            applied.append(rec["dir"])
    return secrets, applied


@dataclass
class Rewrites:
    """What changes between the cluster and this machine (see the module docstring)."""

    services: list[str]               # Service names (DNS names in the manifests)
    ports: dict[int, int]             # manifest port (container or Service) -> this machine's
    uid: int = field(default_factory=os.getuid)
    gid: int = field(default_factory=os.getgid)

    def port(self, manifest_port: int | str) -> int:
        return self.ports[int(manifest_port)]

    def text(self, s: str, mounts: dict[str, Path]) -> str:
        for path in sorted(mounts, key=len, reverse=True):
            s = re.sub(rf"(?<![\w/]){re.escape(path)}(?=/|\b|$)", str(mounts[path]), s)
        hosts = "|".join(["0\\.0\\.0\\.0", "127\\.0\\.0\\.1", *map(re.escape, self.services)])
        s = re.sub(rf"\b(?:{hosts}):(\d+)\b",  # one pass: a new port is never mapped again
                   lambda m: f"127.0.0.1:{self.ports.get(int(m.group(1)), m.group(1))}", s)
        return s.replace("0.0.0.0", "127.0.0.1")

    def args(self, argv: list[str], mounts: dict[str, Path]) -> list[str]:
        out: list[str] = []
        for a in argv:
            prev = out[-1] if out else ""
            if prev.endswith("port") and a.isdigit() and int(a) in self.ports:
                a = str(self.ports[int(a)])
            elif prev == "--device" and a.startswith("cuda"):
                a = "cpu"
            out.append(self.text(a, mounts))
        return out


def expand(s: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion (an unknown VAR stays as written)."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), s)


def lay_out_secret(data: dict[str, bytes], where: Path, mode: int) -> None:
    """A Secret volume as the kubelet writes it (atomic writer layout)."""
    stamp = where / "..2026_01_01_00_00_00.000000001"
    stamp.mkdir(parents=True)
    for key, value in data.items():
        (stamp / key).write_bytes(value)
        (stamp / key).chmod(mode)
    (where / "..data").symlink_to(stamp.name)
    for key in data:
        (where / key).symlink_to(f"..data/{key}")


@dataclass
class Container:
    pod: str
    name: str
    argv: list[str]
    env: dict[str, str]
    spec: dict
    mounts: dict[str, Path]
    log: Path
    proc: subprocess.Popen | None = None


class Pod:
    """One replica of a Deployment's pod template, its volumes in ``root``."""

    def __init__(self, name: str, template: dict, root: Path, rw: Rewrites,
                 config_maps: dict[str, dict], secrets: dict[str, dict[str, bytes]],
                 claims: dict[str, Path], base_env: dict[str, str]) -> None:
        self.name, self.spec, self.root, self.rw = name, template["spec"], root, rw
        self.volumes = self._volumes(secrets, claims)
        self.config_maps, self.secrets, self.base_env = config_maps, secrets, base_env

    def _volumes(self, secrets: dict, claims: dict[str, Path]) -> dict[str, Path]:
        out = {}
        for v in self.spec["volumes"]:
            where = self.root / "volumes" / v["name"]
            if "secret" in v:
                lay_out_secret(secrets[v["secret"]["secretName"]], where,
                               v["secret"].get("defaultMode", 0o644))
            elif "emptyDir" in v:
                where.mkdir(parents=True)
            elif "persistentVolumeClaim" in v:
                where = claims[v["persistentVolumeClaim"]["claimName"]]
            else:
                raise AssertionError(f"volume kind not handled here: {v}")
            out[v["name"]] = where
        return out

    def container(self, c: dict) -> Container:
        mounts = {m["mountPath"]: self.volumes[m["name"]] for m in c.get("volumeMounts", [])}
        env = dict(self.base_env)
        for e in c.get("env", []):
            env[e["name"]] = self.rw.text(self._env_value(e, env), mounts)
        argv = [expand(a, env) for a in (c.get("command") or entrypoint()) + c.get("args", [])]
        if c.get("command") is None:  # the image's pdkv with the container's arguments
            argv = argv[:1] + self.rw.args(argv[1:], mounts)
        else:
            argv = [self._init_text(a, mounts) for a in argv]
        return Container(self.name, c["name"], argv, env, c, mounts,
                         self.root / f"{c['name']}.log")

    def _env_value(self, e: dict, env: dict[str, str]) -> str:
        if "value" in e:
            return expand(e["value"], env)
        ref = e["valueFrom"]
        if "fieldRef" in ref:
            path = ref["fieldRef"]["fieldPath"]
            return {"metadata.name": self.name, "status.podIP": "127.0.0.1"}[path]
        if "configMapKeyRef" in ref:
            r = ref["configMapKeyRef"]
            return self.config_maps[r["name"]]["data"][r["key"]]
        r = ref["secretKeyRef"]
        return self.secrets[r["name"]][r["key"]].decode()

    def _init_text(self, s: str, mounts: dict[str, Path]) -> str:
        ctx = self.spec.get("securityContext", {})
        user = f"{ctx.get('runAsUser')}:{ctx.get('runAsGroup')}"
        return self.rw.text(s.replace(user, f"{self.rw.uid}:{self.rw.gid}"), mounts)

    def run_init(self) -> None:
        for c in self.spec.get("initContainers", []):
            ct = self.container(c)
            r = subprocess.run(ct.argv, env=ct.env, capture_output=True, text=True,
                               timeout=60)
            assert r.returncode == 0, (self.name, c["name"], ct.argv, r.stderr)

    def start(self) -> list[Container]:
        out = []
        for c in self.spec["containers"]:
            ct = self.container(c)
            with open(ct.log, "wb") as log:
                ct.proc = subprocess.Popen(ct.argv, env=ct.env, stdout=log,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           start_new_session=True)
            out.append(ct)
        return out


def probe_passes(ct: Container, probe: dict, rw: Rewrites) -> bool:
    """One run of a probe from the YAML (exec, httpGet or tcpSocket)."""
    ports = {p["name"]: p["containerPort"] for p in ct.spec.get("ports", [])}
    if "exec" in probe:
        argv = [rw.text(a, ct.mounts) for a in probe["exec"]["command"]]
        return subprocess.run(argv, env=ct.env, capture_output=True,
                              timeout=60).returncode == 0
    action = probe.get("httpGet") or probe["tcpSocket"]
    port = rw.port(ports.get(action["port"], action["port"]))
    if "tcpSocket" in probe:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            return True
        except OSError:
            return False
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{action['path']}",
                                    timeout=5) as r:
            return 200 <= r.status < 400
    except (urllib.error.URLError, OSError):
        return False


def wait_ready(containers: list[Container], rw: Rewrites, timeout_s: float) -> list[str]:
    """Run every readiness and liveness probe until each passed once; returns what
    passed, in order. Raises with the containers' logs when a process exits or time is up.
    """
    pending = [(ct, kind) for ct in containers for kind in ("readinessProbe", "livenessProbe")
               if kind in ct.spec]
    passed: list[str] = []
    deadline = time.monotonic() + timeout_s
    while pending:
        for ct in containers:
            if ct.proc.poll() is not None:
                raise AssertionError(f"{ct.pod}/{ct.name} exited {ct.proc.returncode}:\n"
                                     f"{ct.log.read_text()[-3000:]}")
        for item in list(pending):
            ct, kind = item
            if probe_passes(ct, ct.spec[kind], rw):
                pending.remove(item)
                passed.append(f"{ct.pod}/{ct.name} {kind}")
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {ct.pod}/{ct.name}\n{ct.log.read_text()[-1500:]}"
                             for ct in containers)
            raise AssertionError(f"probes never passed: {[(c.name, k) for c, k in pending]}"
                                 f"\n{logs}")
        time.sleep(0.5)
    return passed


def stop(containers: list[Container], timeout_s: float = 60.0) -> None:
    """SIGTERM (as the kubelet), then SIGKILL past the grace period, every process."""
    for ct in containers:
        if ct.proc is not None and ct.proc.poll() is None:
            ct.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for ct in containers:
        if ct.proc is None:
            continue
        try:
            ct.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(ct.proc.pid, signal.SIGKILL)
            ct.proc.wait()
