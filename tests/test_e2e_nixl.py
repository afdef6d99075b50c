"""End to end over NIXL: ``pdkv run --kv-transport nixl`` serves a seeded workload with a
router, a prefill and a decode worker as real processes, the KV moving by NIXL WRITEs.

``nixl`` is required mode, so a worker pair that fell back to ZMQ would fail its
handshake and the run; float64 on CPU, so the outputs must equal the single-process
greedy reference token by token, and every free log must replay clean.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from common.config import DEFAULT
from common.model import Model, generate_greedy
from deploy.loadgen.workload import WorkloadSpec, make_workload
from transport import nixl

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(bool(nixl.import_error()),
                                 reason=f"NIXL not importable: {nixl.import_error()}")]


def test_pdkv_run_over_nixl_is_token_identical_to_the_reference(tmp_path):
    spec = WorkloadSpec(requests=6, seed=5, rate=0.0, prompt_len=(8, 90), output_len=(2, 8))
    cfg = DEFAULT.with_overrides(dtype="float64", page_size=4)
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "run", "--kv-transport", "nixl",
         "--dtype", "float64", "--page-size", "4", "--requests", "6", "--rate", "0",
         "--seed", "5", "--prompt-len", "8", "90", "--output-len", "2", "8",
         "--output", str(out), "--json", "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout)
    assert summary["ok"] == 6 and summary["freelog_violations"] == 0, summary
    assert summary["kv_bytes"] > 0
    model = Model(cfg.model_config())
    want = {r.rid: generate_greedy(model, [r.prompt], r.max_new_tokens, page_size=4)[0]
            for r in make_workload(spec, cfg.model_config().vocab_size)}
    got = {x["rid"]: x["output_ids"] for x in map(json.loads, out.read_text().splitlines())}
    assert got == want
