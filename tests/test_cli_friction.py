"""First-hour friction: what a new user hits in the first hour, each fixed and kept fixed.

`pdkv --version`; one-line errors naming the field for bad flags and config files;
devices checked before anything starts; `--config` and `--config-json` on run and router
alike; a progress line while workers build; `--output` kept when a worker dies; summaries
of an attached run that cover that run only; every bench module runs with `python -m`.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from common.config import ServeConfig
from common.freelog import FreeLogReader
from deploy.cli import main
from deploy.launch.launcher import Cluster

REPO = Path(__file__).resolve().parents[1]


def pdkv(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy.cli", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == "pdkv 0.1.0"


def test_a_config_file_with_a_string_page_size_names_the_field(tmp_path):
    cfg = tmp_path / "serve.json"
    cfg.write_text('{"page_size": "32"}')
    out = pdkv("run", "--config", str(cfg))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip() == ("pdkv run: error: config field 'page_size' must be an "
                                  "integer, not '32' (str)")


@pytest.mark.parametrize("argv, words", [
    (["--config-json", '{"spec_k": 40}'], "spec_k=40; allowed: 0 (off) to 16"),
    (["--config-json", '{"pagesize": 32}'], "unknown config keys ['pagesize']; allowed:"),
    (["--config-json", "[1, 2]"], "--config-json: must be a JSON object"),
    (["--config-json", "{page_size: 32}"], "--config-json: not JSON"),
    (["--config", "/nonexistent/serve.json"], "--config /nonexistent/serve.json: cannot read"),
    (["--page-size", "0"], "page_size=0 must be >= 1 (from --page-size)"),
    (["--spec-k", "17"], "spec_k=17; allowed: 0 (off) to 16 (from --spec-k)"),
    (["--prefix-load-timeout-s", "99"], "prefix_load_timeout_s=99.0 < lease_s=10.0 "
                                        "(from --prefix-load-timeout-s)"),
    (["--config-json", '{"offload": "yes"}'], "'offload' must be true or false"),
])
def test_bad_values_are_one_line_errors_naming_the_field(capsys, argv, words):
    err = one_line_error(capsys, ["run", *argv])
    assert err.startswith("pdkv run: error: ") and words in err, err


def test_config_and_config_json_together_are_refused(capsys, tmp_path):
    (tmp_path / "c.json").write_text("{}")
    err = one_line_error(capsys, ["run", "--config", str(tmp_path / "c.json"),
                                  "--config-json", "{}"])
    assert "not both" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("argv", [["run", "--devices", "cpu,cuda:0"],
                                  ["decode", "--router", "ipc:///nonexistent", "--device",
                                   "cuda:0"],
                                  ["bench", "transfer", "--device", "cuda:0",
                                   "--transports", "tcp"],
                                  ["bench", "spec", "--device", "cuda:0"],
                                  ["bench", "serve", "--devices", "cuda:0"]])
def test_cuda_devices_are_checked_before_anything_starts(capsys, argv):
    t0 = time.monotonic()
    err = one_line_error(capsys, argv)
    assert "device 'cuda:0': this machine has no usable CUDA device" in err
    assert time.monotonic() - t0 < 60  # refused up front, not after a startup deadline


@pytest.mark.parametrize("devices, shared", [
    (["cuda:0", "cuda:0"], True), (["cuda", "cuda:0"], True), (["cuda:0", "cuda:1"], False),
    (["cpu", "cpu"], False)])
def test_ranks_of_a_tensor_parallel_group_never_share_a_gpu(devices, shared):
    from deploy.launch.launcher import check_group_devices
    if not shared:
        check_group_devices("decode0", devices)
        return
    with pytest.raises(ValueError, match="decode0's 2 tensor-parallel ranks would share a "
                                         "GPU .*NCCL needs one GPU per rank"):
        check_group_devices("decode0", devices)


def test_bench_spec_names_the_model_configs_it_knows(capsys):
    err = one_line_error(capsys, ["bench", "spec", "--model", "bogus"])
    assert "--model 'bogus' is neither a directory nor a built-in model (" in err
    assert "tiny" in err


def test_bench_transfer_refuses_shared_memory_for_gpu_pools(capsys):
    err = one_line_error(capsys, ["bench", "transfer", "--device", "cuda:0", "--transports",
                                  "tcp", "shm"])
    assert "--transports shm needs CPU pools" in err


@pytest.mark.parametrize("device, words", [("tpu", "allowed: cpu, cuda, cuda:N"),
                                           ("cuda:x", "is not a device")])
def test_devices_that_are_no_devices(capsys, device, words):
    assert words in one_line_error(capsys, ["run", "--devices", device])


def test_router_takes_config_and_config_json_like_run(tmp_path):
    cfg = tmp_path / "serve.json"
    cfg.write_text('{"page_size": 32}')
    bad = pdkv("router", "--config", str(tmp_path / "missing.json"))
    assert bad.returncode == 2 and "cannot read" in bad.stderr and "Traceback" not in bad.stderr
    for flag, value in (("--config", str(cfg)), ("--config-json", '{"page_size": 32}')):
        addr = f"ipc://{tmp_path}/router{flag}.sock"
        proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "router", "--bind",
                                 addr, flag, value], cwd=REPO, stderr=subprocess.PIPE)
        try:
            from deploy.router.client import Client

            client = Client(addr, "test")
            try:
                status = client.status(60.0)
            finally:
                client.close()
            assert ServeConfig.from_dict(status.config).page_size == 32
        finally:
            proc.terminate()
            proc.communicate(timeout=30)


def _finished(path: Path) -> int:
    """Requests whose row the worker already freed (``finished``), from its free log."""
    try:
        with FreeLogReader(path) as reader:
            return sum(1 for ev in reader.records
                       if ev.get("op") == "free" and ev.get("reason") == "finished")
    except Exception:  # still being written: a torn last record
        return 0


def _pid_of(log_dir: Path, name: str) -> int | None:
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if name.encode() in argv and str(log_dir).encode() in argv and b"--name" in argv:
            return int(entry.name)
    return None


def test_progress_while_building_and_output_kept_when_a_worker_dies(tmp_path):
    log_dir, output = tmp_path / "logs", tmp_path / "out.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "run", "--mode", "colocated", "--requests", "40",
         "--rate", "2", "--no-offload", "--progress", "--log-dir", str(log_dir),
         "--output", str(output)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        deadline = time.monotonic() + 300
        while _finished(log_dir / "colocated0.freelog") < 3:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
        subprocess.run(["kill", "-KILL", str(_pid_of(log_dir, "colocated0"))], check=True)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 2, err
    assert "starting: 1/1 workers registered" in err and "(building models)" in err
    assert "killed by signal SIGKILL" in err
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(lines) >= 3 and all(r["reason"] for r in lines), lines
    assert sum(r["reason"] in ("stop", "length") for r in lines) >= 3
    assert f"{len(lines)} finished request(s) written to {output}" in err


def test_an_attached_run_reports_itself_only(tmp_path):
    cfg = ServeConfig(offload=False)
    log_dir = tmp_path / "logs"
    cluster = Cluster(cfg, "colocated", 0, 1, log_dir=str(log_dir)).start()
    try:
        argv = ["run", "--router", cluster.router_addr, "--auth-keys", str(cluster.keys_dir),
                "--requests", "4", "--rate", "0", "--json"]
        first = pdkv(*argv, "--seed", "1")
        second = pdkv(*argv, "--seed", "2", "--shutdown", "--log-dir", str(log_dir))
    finally:
        cluster.stop()
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    for out in (first, second):
        s = json.loads(out.stdout.strip().splitlines()[-1])
        assert s["requests"] == s["ok"] == 4 and s["this_run_only"] is True
        assert s["kv_gb_per_s"] is None and s["acceptance_rate"] is None
        assert 4 <= s["output_tokens"] <= 4 * 48  # this run's 4 requests, not lifetime
    last = json.loads(second.stdout.strip().splitlines()[-1])
    assert last["freelogs"] == 1 and last["freelog_violations"] == 0


def test_attached_summary_text_says_n_a():
    from deploy.loadgen.summary import format_summary, summarize

    s = summarize({}, {"w": {"spec_proposed": 10, "spec_accepted": 9, "bytes_sent": 99}},
                  1.0, this_run_only=True)
    text = format_summary(s, "disagg", "2 workers at tcp://h:5555")
    assert "n/a" in text and "GB/s" not in text and s["kv_bytes"] == 0


@pytest.mark.parametrize("module", ["benchmarks.allocator", "benchmarks.replay",
                                    "benchmarks.serve", "benchmarks.transfer",
                                    "benchmarks.sampling", "benchmarks.step"])
def test_every_bench_module_runs_with_python_m(module):
    out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--quick" in out.stdout and "--report-only" in out.stdout
