"""Speculation on a trained model (SmolLM2-135M-Instruct, tests/real_model.py): its outputs
are plain greedy's, token for token, at float64 where the comparison is exact.

- through ``pdkv serve`` 1P1D with n-gram lookup (``--spec-ngram 3``): completions and
  chats equal transformers' float64 ``generate``, n-gram proposals are made and accepted
  on an editing prompt, and the free logs replay clean;
- in process, on the real-text workloads of ``benchmarks.spec_texts`` as one batch: n-gram
  lookup and the layer-skip draft (the first 8 of 30 blocks, ``benchmarks.layer_draft``)
  give exactly the plain batch's outputs, which equal the single-request reference.
"""

from __future__ import annotations

import time

import httpx
import pytest
import torch

from benchmarks.spec_texts import encode_workloads
from benchmarks.speculative import _decode_once
from common.config import ServeConfig
from common.model import Model, Tokenizer, generate_greedy, load_config
from decode_node.batch import greedy_step
from decode_node.ngram import NgramProposer
from decode_node.speculative import SpeculativeStep
from tests.http_helpers import assert_logs_clean
from tests.metrics_helpers import parse
from tests.real_model import layer_draft_dir, serve_config, start_serve

pytestmark = pytest.mark.timeout(600)
MAX_NEW = 24
PROMPTS = {
    "natural": "The history of the Roman Empire began",
    "code": "import json\n\ndef load_config(path):\n    ",
    "multi-turn": [{"role": "user", "content": "Name a fruit that is yellow."},
                   {"role": "assistant", "content": "A banana is yellow."},
                   {"role": "user", "content": "And one that is red?"}],
    "edit": [{"role": "user", "content": "Fix the spelling in this sentence and write it "
              "again: The keeper climbed the narow stairs to light the lamp every nigth."}],
}


@pytest.fixture(scope="module")
def served64(real_model_dir, tmp_path_factory):
    """(url, tokenizer, log dir, process): float64 1P1D with n-gram speculation."""
    tmp = tmp_path_factory.mktemp("real-spec")
    proc, url = start_serve(tmp, serve_config(real_model_dir, dtype="float64", spec_ngram=3))
    try:
        yield url, Tokenizer.from_dir(real_model_dir), tmp, proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def hf64(real_model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        real_model_dir, dtype=torch.float64).eval()


def _spec_counts(url: str) -> tuple[float, float]:
    samples = parse(httpx.get(f"{url}/metrics", timeout=30).text)
    return tuple(sum(v for _, v in samples.get(name, ())) for name in (
        "pdkv_spec_draft_tokens_total", "pdkv_spec_accepted_tokens_total"))


@pytest.mark.parametrize("name", list(PROMPTS))
def test_float64_with_ngram_equals_transformers(served64, hf64, name) -> None:
    url, tok = served64[0], served64[1]
    prompt = PROMPTS[name]
    chat = isinstance(prompt, list)
    ids = tok.encode_chat(prompt) if chat else tok.encode(prompt)
    body = {"messages": prompt} if chat else {"prompt": prompt}
    r = httpx.post(f"{url}/v1/{'chat/' if chat else ''}completions", timeout=300, json={
        **body, "max_tokens": MAX_NEW, "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    want = hf64.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                         eos_token_id=2, pad_token_id=2)[0, len(ids):].tolist()
    assert r.json()["choices"][0]["token_ids"] == want


def test_ngram_proposals_accepted_through_serve(served64) -> None:
    """The editing prompt above repeats its context: the decode worker's counters (on
    /metrics, reported on its heartbeat) show proposals and accepted tokens."""
    deadline = time.monotonic() + 30
    while (counts := _spec_counts(served64[0]))[1] == 0:
        assert time.monotonic() < deadline, f"no accepted draft tokens in /metrics: {counts}"
        time.sleep(0.5)
    assert counts[0] >= counts[1] > 0


def test_zz_free_logs_replay_clean(served64) -> None:
    _, _, tmp, proc = served64
    assert proc.stop() == 0, (tmp / "serve.log").read_text()[-3000:]
    assert_logs_clean(tmp)


def test_a_checkpoint_does_not_speculate_by_default(real_model_dir) -> None:
    """Neither kind pays on this CPU across real text (docs/benchmarks.md), so a
    checkpoint speculates only when asked (``--spec-ngram`` or ``--draft-model``)."""
    cfg = ServeConfig(model_path=str(real_model_dir))
    assert cfg.spec_k == 3 and cfg.spec_kind == "" and not cfg.with_draft


@pytest.fixture(scope="module")
def model64(real_model_dir) -> Model:
    return Model(load_config(real_model_dir, dtype="float64"))


@pytest.mark.parametrize("kind", ["ngram3", "layers8"])
def test_speculation_equals_plain_greedy_on_real_text(real_model_dir, model64, kind) -> None:
    tok = Tokenizer.from_dir(real_model_dir)
    prompts = [ps[0] for ps in encode_workloads(tok).values()]  # one of each workload
    stop = tuple(tok.eos_token_ids)
    _, plain = _decode_once(model64, prompts, MAX_NEW, greedy_step, 16, stop_ids=stop)
    if kind == "ngram3":
        step, draft = SpeculativeStep(3, NgramProposer(3)), None
    else:
        step = SpeculativeStep(3)
        draft = Model(load_config(layer_draft_dir(8), dtype="float64"))
    _, got = _decode_once(model64, prompts, MAX_NEW, step, 16, draft, stop)
    assert got == plain
    assert step.stats.num_proposed > 0
    if kind == "ngram3":  # editing and quoting repeat the prompt
        assert step.stats.num_accepted > 0
        # and the batch equals the one-request-at-a-time reference
        assert plain == generate_greedy(model64, prompts, MAX_NEW, stop_token_ids=stop)
