"""deploy/k8s/: every manifest is valid against the Kubernetes schemas (strict: no
unknown fields), means what pdkv understands, and runs as written.

The run (``test_the_manifests_serve_a_request_as_written``) makes the Secrets with the
commands docs/cluster.md gives, lays them out as the kubelet mounts them, reads every
container's command, arguments, environment and mounts from the YAML, runs the init
containers and then one pod of each Deployment on loopback (tests/k8s_pods.py lists the
few rewrites a machine without a cluster needs), waits until every probe of the YAML
passes, and serves a completion through the front door with the API key from its
Secret. No cluster runs here. ``pdkv probe`` is also tested against a router with keys."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

from common.auth import Keys, create_keys  # noqa: E402
from common.config import ServeConfig  # noqa: E402
from common.freelog import replay_file  # noqa: E402
from deploy.cli.main import build_parser  # noqa: E402
from deploy.http.access import access_from_args  # noqa: E402
from tests import k8s_pods  # noqa: E402
from tests.tp_helpers import free_port  # noqa: E402

K8S = k8s_pods.K8S
DOCS = k8s_pods.REPO / "docs" / "cluster.md"
VERSION = "1.33.0"


def _docs() -> list[dict]:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return [d for f in kust["resources"] for d in yaml.safe_load_all((K8S / f).read_text())]


def _by_kind(kind: str) -> list[dict]:
    return [d for d in _docs() if d["kind"] == kind]


def _deployment(name: str) -> dict:
    (dep,) = [d for d in _by_kind("Deployment") if d["metadata"]["name"] == name]
    return dep


def _containers(dep: dict) -> list[dict]:
    spec = dep["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def _volume(dep: dict, name: str) -> dict:
    (v,) = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == name]
    return v


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


@pytest.mark.parametrize("name", ["pdkv-router", "pdkv-prefill", "pdkv-decode"])
def test_every_pdkv_command_line_parses(name):
    (cm,) = _by_kind("ConfigMap")
    parser = build_parser()
    for c in _deployment(name)["spec"]["template"]["spec"]["containers"]:
        env = {e["name"]: e.get("value", "x") for e in c.get("env", [])}
        env["PDKV_CONFIG"] = cm["data"]["serve.json"]
        args = parser.parse_args([k8s_pods.expand(a, env) for a in c["args"]])
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
    pod_ports = {d["metadata"]["labels"]["app.kubernetes.io/name"]:
                 {p["name"] for c in _containers(d) for p in c.get("ports", [])} for d in deps}
    for svc in _by_kind("Service"):
        pods = [d for d in deps if svc["spec"]["selector"].items() <=
                d["spec"]["template"]["metadata"]["labels"].items()]
        assert pods, svc["metadata"]["name"]
        names = {p["name"] for d in pods for c in _containers(d) for p in c.get("ports", [])}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= names
    for policy in _by_kind("NetworkPolicy"):
        pod = policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
        for rule in policy["spec"]["ingress"]:
            assert {p["port"] for p in rule.get("ports", [])} <= pod_ports[pod], policy
    (kv,) = [s for s in _by_kind("Service") if s["metadata"]["name"] == "pdkv-kv"]
    assert kv["spec"]["clusterIP"] == "None"  # headless: each decode reaches one prefill


def test_workers_ask_for_a_gpu_each_and_the_pools_are_sized_from_its_memory():
    for name in ("pdkv-prefill", "pdkv-decode"):
        (main,) = _deployment(name)["spec"]["template"]["spec"]["containers"]
        assert main["resources"]["requests"]["nvidia.com/gpu"] == 1
        assert main["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert "--device" in main["args"]
    # the sizing note's arithmetic is pdkv's own: an 8B model's page is 2 MiB
    page = ServeConfig(model="llama-8b-shape", spec_k=0).kv_layout().page_bytes(16)
    assert page == 2 << 20
    note = (K8S / "config.yaml").read_text()
    assert "2 MiB a page of\n# 16 tokens" in note
    pages = int((79.6 * 0.9 - 15 - 4) * (1 << 30) / page)
    assert "about 27,000 pages" in note and 26_900 <= pages < 27_100


def test_each_container_holds_only_its_own_identity_and_metrics_stay_inside():
    router = _deployment("pdkv-router")
    spec = router["spec"]["template"]["spec"]
    (door,) = [c for c in spec["containers"] if c["name"] == "frontend"]
    assert door["readinessProbe"]["httpGet"]["path"] == "/health"
    assert door["args"][door["args"].index("--identity") + 1].startswith("client-")
    # the front door's key volume is filled only from its own Secret
    keys_volume = next(m["name"] for m in door["volumeMounts"]
                       if m["mountPath"] == "/etc/pdkv/keys")
    (init,) = [c for c in spec["initContainers"]
               if any(m["name"] == keys_volume for m in c["volumeMounts"])]
    secret_volume = next(m["name"] for m in init["volumeMounts"] if m["name"] != keys_volume)
    assert _volume(router, secret_volume)["secret"]["secretName"] == "pdkv-keys-frontend"
    api_key = {e["name"]: e for e in door["env"]}["PDKV_API_KEY"]
    assert api_key["valueFrom"]["secretKeyRef"] == {"name": "pdkv-api-key", "key": "api-key"}
    public = [s for s in _by_kind("Service") if s["metadata"]["name"] == "pdkv-http"]
    assert [p["targetPort"] for p in public[0]["spec"]["ports"]] == ["http"]
    for svc in _by_kind("Service"):
        if any(p["targetPort"] == "metrics" for p in svc["spec"]["ports"]):
            assert svc["spec"].get("type", "ClusterIP") == "ClusterIP"
            assert [p["targetPort"] for p in svc["spec"]["ports"]] == ["metrics"]
    (policy,) = [p for p in _by_kind("NetworkPolicy") if p["metadata"]["name"] == "pdkv-router"]
    (metrics_rule,) = [r for r in policy["spec"]["ingress"]
                       if {p["port"] for p in r.get("ports", [])} == {"metrics"}]
    assert metrics_rule["from"] == [{"namespaceSelector": {}}]  # pods of the cluster only
    # as written, with the API key its Secret gives, the front door may listen on 0.0.0.0
    args = build_parser().parse_args(door["args"])
    assert access_from_args(args, env={"PDKV_API_KEY": "k"}).api_key == "k"


def _pdkv(*args: str, timeout: float = 60, env: dict | None = None
          ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_probe_authenticates_and_a_refusal_reads_as_one(tmp_path):
    router = f"tcp://127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if k != "PDKV_AUTH_KEYS"}
    gone = _pdkv("probe", "--router", router, "--worker", "d", "--timeout", "0.5", env=env)
    assert gone.returncode == 2 and "did not answer" in gone.stderr, gone
    create_keys(tmp_path / "keys")
    keys = str(tmp_path / "keys")
    create_keys(tmp_path / "other")  # another deployment's keys
    cfg = ServeConfig(dtype="float64", decode_pages=64, prefill_pages=64, offload=False,
                      transport="tcp")
    procs = [subprocess.Popen([sys.executable, "-m", "deploy.cli", "router", "--bind", router,
                               "--config-json", json.dumps(cfg.to_dict()), "--auth-keys",
                               keys], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        unknown = _pdkv("probe", "--router", router, "--worker", "d", "--timeout", "20",
                        "--auth-keys", keys, env=env)
        assert unknown.returncode == 1 and "not registered" in unknown.stdout, unknown
        no_keys = _pdkv("probe", "--router", router, "--worker", "d", env=env)
        assert no_keys.returncode == 3, no_keys
        assert "refused" in no_keys.stderr and "--auth-keys" in no_keys.stderr, no_keys.stderr
        foreign = _pdkv("probe", "--router", router, "--worker", "d", "--auth-keys",
                        str(tmp_path / "other"), env=env)
        assert foreign.returncode == 3, foreign
        assert "its key is not the one our key directory names" in foreign.stderr, foreign
        # an identity made after the router started: the router does not know its key
        assert _pdkv("keys", "add", keys, "probe-late").returncode == 0
        late = _pdkv("probe", "--router", router, "--worker", "d", "--auth-keys", keys,
                     "--identity", "probe-late", env=env)
        assert late.returncode == 3 and "refused our key" in late.stderr, late
        # a worker identity may not ask the router's status: refused, not "no answer"
        as_worker = _pdkv("probe", "--router", router, "--worker", "d", "--auth-keys", keys,
                          "--identity", "worker", env=env)
        assert as_worker.returncode == 3 and "refused identity 'worker'" in as_worker.stderr
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", "decode", "--router", router, "--name", "d",
             "--auth-keys", keys], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 90
        # the environment's key directory, as the manifests' probes have it
        while (ready := _pdkv("probe", "--router", router, "--worker", "d",
                              env={**env, "PDKV_AUTH_KEYS": keys})).returncode:
            assert time.monotonic() < deadline, ready
            time.sleep(0.5)
        assert ready.stdout.startswith("d: ready (decode")
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert Keys(keys).names() == ["client", "operator", "probe", "probe-late", "router",
                                  "worker"]


# -- the manifests, run ------------------------------------------------------------------
def _docs_block() -> str:
    """docs/cluster.md's commands that make the Secrets and apply the manifests."""
    text = DOCS.read_text()
    section = text[text.index("## Kubernetes"):]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.S)
    (block,) = [b for b in blocks if "kubectl create secret" in b]
    return block


def _port_map() -> dict[int, int]:
    """Every container port of the manifests, and every Service port (through its
    targetPort), to a free port of this machine."""
    deps = _by_kind("Deployment")
    by_name = {(d["metadata"]["labels"]["app.kubernetes.io/name"], p["name"]): p["containerPort"]
               for d in deps for c in _containers(d) for p in c.get("ports", [])}
    ports = {n: free_port() for n in sorted(set(by_name.values()))}
    for svc in _by_kind("Service"):
        pod = svc["spec"]["selector"]["app.kubernetes.io/name"]
        for p in svc["spec"]["ports"]:
            ports.setdefault(p["port"], ports[by_name[(pod, p["targetPort"])]])
    return ports


def test_the_manifests_serve_a_request_as_written(tmp_path):
    httpx = pytest.importorskip("httpx")
    from common.model import export_builtin

    if shutil.which("openssl") is None:
        pytest.skip("docs/cluster.md makes the API key with openssl")
    bin_dir, kubectl_log = tmp_path / "bin", tmp_path / "kubectl.jsonl"
    k8s_pods.write_shims(bin_dir, kubectl_log)
    base_env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(k8s_pods.REPO),
                "HOME": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    # the operator's steps, line by line, from a checkout (its deploy/ is this one's; the
    # key directories they make land in the test's folder)
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "deploy").symlink_to(k8s_pods.REPO / "deploy")
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", _docs_block()], env=base_env,
                         cwd=checkout, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    secrets, applied = k8s_pods.read_kubectl_log(kubectl_log)
    assert applied == [str(K8S)]
    (cm,) = _by_kind("ConfigMap")
    claims = {c["metadata"]["name"]: tmp_path / "claims" / c["metadata"]["name"]
              for c in _by_kind("PersistentVolumeClaim")}
    for where in claims.values():
        where.mkdir(parents=True)
    # the checkpoint the config names, on the models volume (tiny, made here)
    model_path = json.loads(cm["data"]["serve.json"])["model_path"]
    export_builtin("tiny", claims["pdkv-models"] / Path(model_path).relative_to("/models"))
    rw = k8s_pods.Rewrites([s["metadata"]["name"] for s in _by_kind("Service")], _port_map())
    maps = {cm["metadata"]["name"]: cm}
    running: list[k8s_pods.Container] = []
    try:
        for name in ("pdkv-router", "pdkv-prefill", "pdkv-decode"):
            pod = k8s_pods.Pod(f"{name}-0", _deployment(name)["spec"]["template"],
                               tmp_path / "pods" / name, rw, maps, secrets, claims, base_env)
            pod.run_init()
            running += pod.start()
        passed = k8s_pods.wait_ready(running, rw, timeout_s=240)
        probes = [(c["name"], kind) for d in _by_kind("Deployment")
                  for c in d["spec"]["template"]["spec"]["containers"]
                  for kind in ("readinessProbe", "livenessProbe") if kind in c]
        assert len(passed) == len(probes) == 5, passed  # every probe of the YAML passed
        url = f"http://127.0.0.1:{rw.port(8000)}"
        key = secrets["pdkv-api-key"]["api-key"].decode()
        auth = {"Authorization": f"Bearer {key}"}
        models = httpx.get(f"{url}/v1/models", headers=auth, timeout=30).json()
        assert [m["id"] for m in models["data"]] == [Path(model_path).name]
        body = {"model": Path(model_path).name, "prompt": "The quick brown fox",
                "max_tokens": 8, "temperature": 0}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 401
        r = httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        assert httpx.get(f"{url}/metrics", timeout=30).status_code == 401
        inside = httpx.get(f"http://127.0.0.1:{rw.port(9090)}/metrics", timeout=30)
        assert inside.status_code == 200 and "pdkv_kv_pages" in inside.text
    finally:
        k8s_pods.stop(running)
    logs = sorted((claims["pdkv-freelogs"]).glob("*.freelog"))
    assert {p.name for p in logs} == {f"pdkv-{role}-0{tier}.freelog" for role in
                                      ("prefill", "decode") for tier in ("", ".host")}
    for log in logs:  # every worker shut down on SIGTERM and its log replays clean
        report = replay_file(log)
        assert report.ok and report.closed, report.format()
