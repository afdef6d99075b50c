"""A new user's walk through README and docs (issue 34, "A first user"): each item that
tripped them, as a story with real processes, files and clients. Item 9 (vLLM's client's
request fields) belongs to the HTTP edge's tests."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from common.config import ServeConfig
from common.kv import KvCache
from deploy.cli.main import build_parser
from deploy.http.process import ServerProcess

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
OPERATIONS = (REPO / "docs" / "operations.md").read_text()
pytestmark = pytest.mark.timeout(300)


def _pdkv(*args: str, timeout: float = 120, cwd: Path | None = None
          ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- 1, 8: a checkpoint's name, and watching pdkv serve ------------------------------------
def test_serve_names_a_checkpoint_by_its_directory_and_says_how_to_watch_it(tmp_path):
    """1: ``--model DIR`` is served as DIR's name (banner, /v1/models, requests naming it);
    8: the ready line gives a ``pdkv top`` command that reaches this deployment."""
    from common.model import export_builtin

    model = export_builtin("tiny", tmp_path / "my-model")
    proc = ServerProcess(["serve", "--model", str(model), "--port", "0", "--log-dir",
                          str(tmp_path / "logs")], tmp_path / "serve.log")
    url = proc.start(180.0)
    try:
        assert " my-model ready" in proc.ready_line, proc.ready_line
        models = httpx.get(f"{url}/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["my-model"]
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "my-model", "prompt": "The quick brown fox", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["model"] == "my-model", r.text
        watch = proc.proc.stdout.readline().decode()
        m = re.search(r"watch it with: pdkv (top .*)$", watch.strip())
        assert m, watch
        top = _pdkv(*m.group(1).split(), "--once", "--interval", "0.2", timeout=60)
        assert top.returncode == 0, top
        assert "2/2 workers up" in top.stdout, top.stdout
    finally:
        assert proc.stop(signal.SIGINT) == 0


# -- 2: the README's serve block, as written ------------------------------------------------
def _readme_block(after: str) -> str:
    section = README[README.index(after):]
    return re.search(r"```sh\n(.*?)```", section, re.S).group(1)


def test_the_readme_serve_block_prints_a_completion(tmp_path):
    """The block runs as printed (its port moved to a free one, ``.venv/bin/pdkv`` being
    this checkout's), and its curl prints a completion: it waits for the server first."""
    block = _readme_block("## Serve the OpenAI API")
    port = _free_port()
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    shim = tmp_path / ".venv" / "bin" / "pdkv"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m deploy.cli "$@"\n')
    shim.chmod(0o755)
    script = block.replace("8000", str(port))
    out = tmp_path / "out.txt"
    with open(out, "wb") as f:  # not a pipe: the server the block leaves running holds it
        proc = subprocess.Popen(["bash", "-c", script], cwd=tmp_path, stdout=f,
                                stderr=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert proc.wait(timeout=240) == 0  # the block's last command, curl, succeeded
    finally:
        proc.wait()  # reaped: the process group is then the server alone
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C, as the README says
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError("pdkv serve did not stop on SIGINT")
    lines = out.read_text().strip().splitlines()
    (line,) = [ln for ln in lines if ln.startswith('{"id"')]  # curl's, without a newline
    completion, _ = json.JSONDecoder().raw_decode(line)
    assert len(completion["choices"][0]["token_ids"]) == 8


# -- 3: replay --request with the ids a user has ----------------------------------------------
def test_replay_request_finds_a_request_by_the_id_its_client_knows(tmp_path):
    """The free log names a request by the router's id (``cmpl-...#run-n``, ``s0-r1#...``);
    the user has the front door's ``cmpl-...`` id or ``--output``'s rid."""
    from common.freelog.timeline import build_timeline

    log = tmp_path / "decode0.freelog"
    cache = KvCache(num_pages=16, page_size=4, log_path=str(log), node="decode0")
    for rid in ("cmpl-4f2a#9c1d-1", "s0-r00001#9c1d-2"):
        kv = cache.open_row(rid)
        cache.extend(kv, 8)
        cache.commit(kv, 8)
        cache.free_kv_row(kv, [(0, 8)], reason="finished")
        cache.close_row(kv)
    cache.close()
    for asked in ("cmpl-4f2a", "s0-r00001", "cmpl-4f2a#9c1d-1"):
        track = build_timeline(str(log), asked).request
        assert [e[1] for e in track.events] == ["full:alloc", "full:free"], asked
    assert build_timeline(str(log), "cmpl-4f").request.events == []  # no prefix match


# -- 4: replay says so when it checked nothing ---------------------------------------------------
def test_run_against_a_router_never_calls_unchecked_logs_clean(tmp_path):
    from deploy.launch.run import _free_log_line, attached_logs, replay_all

    def line(log_dir, shutdown, workers=("decode0", "prefill0")) -> tuple[str, bool]:
        logs, unchecked = attached_logs(log_dir, shutdown, list(workers))
        checked = replay_all(logs)
        checked["unchecked"] = unchecked
        return _free_log_line(checked), bool(unchecked)

    text, _ = line(str(tmp_path), shutdown=False)
    assert "clean" not in text and "NOT VERIFIED" in text and "--shutdown" in text
    text, _ = line(None, shutdown=True)
    assert "clean" not in text and "--log-dir" in text
    text, _ = line(str(tmp_path), shutdown=True)  # workers started without --log-dir
    assert "0 replayed" in text and "clean" not in text and "decode0, prefill0" in text
    for name in ("decode0", "prefill0.1"):  # prefill0 restarted once: its second log
        cache = KvCache(8, 4, log_path=str(tmp_path / f"{name}.freelog"), node=name)
        cache.close()
    text, unverified = line(str(tmp_path), shutdown=True)
    assert text.endswith("2 replayed, clean") and not unverified


# -- 5: missing or pickled weights --------------------------------------------------------------
@pytest.mark.parametrize("leave", ["none", "bin"])
def test_missing_or_pickled_weights_are_one_line_before_anything_starts(tmp_path, leave):
    from common.model import export_builtin

    model = export_builtin("tiny", tmp_path / "m")
    (model / "model.safetensors").unlink()
    if leave == "bin":
        (model / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")
    t0 = time.monotonic()
    r = _pdkv("serve", "--model", str(model), "--port", "0", "--log-dir", str(tmp_path / "l"))
    assert r.returncode == 2, r
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--model" in r.stderr and "model.safetensors" in r.stderr
    if leave == "bin":
        assert "pytorch_model.bin" in r.stderr and "convert them to safetensors" in r.stderr
    assert not (tmp_path / "l").exists()  # no worker was started
    assert time.monotonic() - t0 < 60


# -- 6: every command in the README -------------------------------------------------------------
def test_the_readme_names_every_command():
    sub = next(a for a in build_parser()._actions if getattr(a, "choices", None))
    table = README[README.index("Commands (each has complete `--help`)"):]
    for command in sub.choices:
        assert f"`pdkv {command}" in table, command
    assert "`pdkv model export NAME DIR`" in table


# -- 7: an exported small model speaks -----------------------------------------------------------
def test_an_exported_small_model_decodes_every_id_to_text(tmp_path):
    """The embedded text trains about 600 tokens; ``small`` samples from 4096 ids. Every
    one decodes to visible text, and encoding is what training made."""
    from tokenizers import Tokenizer

    from common.model import export_builtin

    model = export_builtin("small", tmp_path / "small")
    vocab = ServeConfig(model_path=str(model)).model_config().vocab_size
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    assert vocab == 4096 and tok.get_vocab_size() == vocab
    assert all(tok.decode([i]).strip() for i in range(700, vocab, 7))
    text = "The quick brown fox jumps over the lazy dog"
    ids = tok.encode(text).ids
    assert max(ids) < 700 and tok.decode(ids, skip_special_tokens=True) == text


# -- 8: a dead server is not "2/2 workers up" --------------------------------------------------
def test_top_does_not_claim_workers_up_when_its_source_stopped_answering():
    pytest.importorskip("rich")
    from prometheus_client.parser import text_string_to_metric_families
    from rich.console import Console

    from deploy.cli.top_model import Scrape
    from deploy.cli.top_view import _frame

    first = Scrape.of(text_string_to_metric_families(
        "# TYPE pdkv_worker_up gauge\n"
        'pdkv_worker_up{worker="decode0",role="decode"} 1\n'
        'pdkv_worker_up{worker="prefill0",role="prefill"} 1\n'), 1.0)

    class Screen:  # what rich's Live shows: the last picture it was given
        shown = None

        def update(self, renderable, refresh=False):
            self.shown = renderable

    def text(renderable) -> str:
        console = Console(record=True, width=200, color_system=None)
        console.print(renderable)
        return console.export_text()

    screen = Screen()
    before = _frame(screen, lambda: first, None, "router x")
    assert "2/2 workers up" in text(screen.shown)

    def dead():
        raise TimeoutError("the router at x did not answer")

    _frame(screen, dead, before, "router x")
    shown = text(screen.shown)
    assert "workers up" not in shown and "NOT ANSWERING" in shown, shown
    rows = [ln.split() for ln in shown.splitlines() if ln.startswith(("decode0", "prefill0"))]
    assert [r[2] for r in rows] == ["?", "?"], shown


# -- 10, 11: the GPU quickstart ----------------------------------------------------------------
def test_the_gpu_quickstart_says_which_torch_and_nixl_and_its_lines_parse():
    from transport.nixl import nixl_wheel

    section = README[README.index("## GPU quickstart"):]
    block = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    parser = build_parser()
    serves = []
    for line in block.splitlines():
        if line.startswith(".venv/bin/pdkv "):
            args = parser.parse_args(line.split()[1:])
            serves += [args] if args.command == "serve" else []
    assert [a.devices for a in serves] == ["cuda:0", "cuda:0,cuda:1"]
    assert "nixl-cu13" in block and "`pdkv[nixl-cu12]` for CUDA 12" in section
    assert "torch.version.cuda" in block
    assert (nixl_wheel("13.0"), nixl_wheel("12.8"), nixl_wheel("")) == \
        ("nixl-cu13", "nixl-cu12", "nixl-cu12")  # "": a CPU-only torch
    extras = (REPO / "pyproject.toml").read_text()
    for wheel in ("nixl-cu12", "nixl-cu13"):
        assert re.search(rf'^{wheel} = \["{wheel}>=', extras, re.M), wheel
    gpu = OPERATIONS[OPERATIONS.index("## GPU quickstart"):OPERATIONS.index("## Several hosts")]
    for must in ("**Install.**", "**Size the pools.**", "**Serve.**", "**What ran on a GPU.**",
                 "2026-12-04-gpu-round.md"):
        assert must in gpu, must
    assert "has run on a GPU in this\nproject's tests yet" not in OPERATIONS
    assert not re.search(r"(never|not) (yet )?(ran|run) on a GPU", OPERATIONS.replace("\n", " ")
                         .replace("Not run on a GPU yet: NCCL", ""))


def test_the_pool_sizing_example_is_what_the_command_prints(tmp_path):
    """docs/operations.md's ``pdkv model pages`` output, from a checkpoint of the same
    shape (its weights file the size of Llama-3.1-8B's, sparse: nothing is written)."""
    from common.model import get_config
    from common.model.checkpoint import hf_config_dict

    model = tmp_path / "Llama-3.1-8B-Instruct"
    model.mkdir()
    cfg = get_config("llama-8b-shape").with_overrides(num_draft_layers=0)
    (model / "config.json").write_text(json.dumps(hf_config_dict(cfg)))
    with open(model / "model.safetensors", "wb") as f:
        f.truncate(16_060_522_496)
    doc = re.search(r"\$ pdkv model pages (\S+) (.*)\n((?:.+\n)+?)```", OPERATIONS)
    r = _pdkv("model", "pages", str(model), *doc.group(2).split())
    assert r.returncode == 0, r
    assert r.stdout == doc.group(3)
