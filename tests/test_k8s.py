"""deploy/k8s/: every manifest is valid against the Kubernetes schemas (strict: no
unknown fields), and it means what pdkv understands: every container's arguments and
readiness command parse with pdkv's own CLI, the config map is a valid ServeConfig,
Services and probes name ports that exist, selectors select their pods. No cluster runs
here; ``pdkv probe`` is tested against a real router."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

from common.config import ServeConfig  # noqa: E402
from deploy.cli.main import build_parser  # noqa: E402
from tests.tp_helpers import free_port  # noqa: E402

K8S = Path(__file__).resolve().parents[1] / "deploy" / "k8s"
VERSION = "1.33.0"


def _docs() -> list[dict]:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return [d for f in kust["resources"] for d in yaml.safe_load_all((K8S / f).read_text())]


def _by_kind(kind: str) -> list[dict]:
    return [d for d in _docs() if d["kind"] == kind]


def _containers(dep: dict) -> list[dict]:
    spec = dep["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def test_kustomization_lists_every_manifest_and_each_is_schema_valid():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kust["resources"]) == on_disk
    for doc in _docs():
        kubernetes_validate.validate(doc, VERSION, strict=True)


def test_the_validator_would_catch_a_typo():
    dep = _by_kind("Deployment")[0]
    dep["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, VERSION, strict=True)


def test_the_config_map_is_a_valid_serve_config(tmp_path):
    from common.model import export_builtin

    (cm,) = _by_kind("ConfigMap")
    fields = json.loads(cm["data"]["serve.json"])
    # the checkpoint lives on the cluster's volume: stand in a real one of this machine
    fields["model_path"] = str(export_builtin("tiny", tmp_path / "model"))
    ServeConfig.from_dict(fields)


def _expand(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], text)


@pytest.mark.parametrize("name", ["pdkv-router", "pdkv-prefill", "pdkv-decode"])
def test_every_pdkv_command_line_parses(name):
    (dep,) = [d for d in _by_kind("Deployment") if d["metadata"]["name"] == name]
    (cm,) = _by_kind("ConfigMap")
    parser = build_parser()
    for c in dep["spec"]["template"]["spec"]["containers"]:
        env = {e["name"]: e.get("value", "x") for e in c.get("env", [])}
        env["PDKV_CONFIG"] = cm["data"]["serve.json"]
        args = parser.parse_args([_expand(a, env) for a in c["args"]])
        assert args.command == c["args"][0]
        probe = c.get("readinessProbe", {}).get("exec")
        if probe:  # sh -c '<pdkv command>'
            assert probe["command"][:2] == ["sh", "-c"]
            words = shlex.split(probe["command"][2].replace('"$POD_NAME"', "pod-0"))
            assert words[0] == "pdkv" and parser.parse_args(words[1:]).command == "probe"


def test_services_probes_and_volumes_refer_to_what_exists():
    deps = _by_kind("Deployment")
    for dep in deps:
        spec = dep["spec"]
        assert spec["selector"]["matchLabels"].items() <= \
            spec["template"]["metadata"]["labels"].items()
        volumes = {v["name"] for v in spec["template"]["spec"]["volumes"]}
        for c in _containers(dep):
            ports = {p["name"] for p in c.get("ports", [])}
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, (dep["metadata"]["name"], m["name"])
            for kind in ("readinessProbe", "livenessProbe"):
                for action in ("httpGet", "tcpSocket"):
                    port = c.get(kind, {}).get(action, {}).get("port")
                    assert port is None or port in ports, (c["name"], kind, port)
    for svc in _by_kind("Service"):
        pods = [d for d in deps if svc["spec"]["selector"].items() <=
                d["spec"]["template"]["metadata"]["labels"].items()]
        assert pods, svc["metadata"]["name"]
        names = {p["name"] for d in pods for c in _containers(d) for p in c.get("ports", [])}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= names
    (kv,) = [s for s in _by_kind("Service") if s["metadata"]["name"] == "pdkv-kv"]
    assert kv["spec"]["clusterIP"] == "None"  # headless: each decode reaches one prefill


def test_workers_ask_for_a_gpu_each_and_the_front_door_is_ready_from_health():
    for dep in _by_kind("Deployment"):
        main = dep["spec"]["template"]["spec"]["containers"]
        if dep["metadata"]["name"] in ("pdkv-prefill", "pdkv-decode"):
            assert main[0]["resources"]["limits"]["nvidia.com/gpu"] == 1
            assert "--device" in main[0]["args"]
        else:
            (door,) = [c for c in main if c["name"] == "frontend"]
            assert door["readinessProbe"]["httpGet"]["path"] == "/health"


def _pdkv(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_probe_reports_a_worker_as_the_router_sees_it(tmp_path):
    router = f"tcp://127.0.0.1:{free_port()}"
    gone = _pdkv("probe", "--router", router, "--worker", "d", "--timeout", "0.5")
    assert gone.returncode == 2 and "did not answer" in gone.stderr
    cfg = ServeConfig(dtype="float64", decode_pages=64, prefill_pages=64, offload=False,
                      transport="tcp")
    procs = [subprocess.Popen([sys.executable, "-m", "deploy.cli", "router", "--bind", router,
                               "--config-json", json.dumps(cfg.to_dict())],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        unknown = _pdkv("probe", "--router", router, "--worker", "d", "--timeout", "20")
        assert unknown.returncode == 1 and "not registered" in unknown.stdout, unknown
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", "decode", "--router", router, "--name", "d"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 90
        while (ready := _pdkv("probe", "--router", router, "--worker", "d")).returncode:
            assert time.monotonic() < deadline, ready
            time.sleep(0.5)
        assert ready.stdout.startswith("d: ready (decode")
    finally:
        for p in procs:
            p.kill()
            p.wait()
