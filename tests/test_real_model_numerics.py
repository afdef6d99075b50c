"""The paged runner at bf16 against a float32 reference, on a trained model
(SmolLM2-135M-Instruct, tests/real_model.py) and real prompts.

Each prompt is prefilled in chunks of 24 tokens (pages of 16, so chunks straddle pages),
then transformers' own greedy continuation is fed back one token per decode step; the
logits of every position are compared with transformers' float32 forward over the whole
sequence. Stated tolerances (measured on this model: float32 max |error| 7e-5; bf16
top-1 agreement 0.977, mean |error| 0.017 of the logits' spread, worst position 0.064 of
its largest logit, and a mean |error| 0.95x transformers' own bf16 run's):

- float32 paged: max |error| <= 5e-4;
- bf16 paged: top-1 agreement >= 0.95 over all positions; mean |error| <= 0.03 std of the
  reference logits; at every position max |error| <= 0.1 of the reference's largest
  |logit|; mean |error| <= 1.25x that of transformers' bf16 forward on the same tokens.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.spec_texts import encode_workloads
from common.kv import KvCache
from common.model import BatchItem, Model, ModelRunner, Tokenizer, load_config

pytestmark = pytest.mark.timeout(600)
CHUNK, PAGE, GEN = 24, 16, 16


def _hf(real_model_dir, dtype: torch.dtype):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=dtype).eval()


@pytest.fixture(scope="module")
def reference(real_model_dir) -> tuple[list[tuple[int, list[int]]], list[torch.Tensor]]:
    """Per prompt (prompt length, prompt + transformers' float32 greedy continuation), and
    transformers' float32 logits of every position of those sequences."""
    tok = Tokenizer.from_dir(real_model_dir)
    hf = _hf(real_model_dir, torch.float32)
    sequences = []
    for p in [ps[0] for ps in encode_workloads(tok).values()]:
        full = hf.generate(torch.tensor([p]), max_new_tokens=GEN, do_sample=False,
                           eos_token_id=None, pad_token_id=2)[0].tolist()
        sequences.append((len(p), full))
    return sequences, forward_logits(hf, sequences)


def forward_logits(hf, sequences) -> list[torch.Tensor]:
    with torch.no_grad():
        return [hf(torch.tensor([full])).logits[0].float() for _, full in sequences]


def paged_logits(real_model_dir, sequences, dtype: str) -> list[torch.Tensor]:
    """Logits of every position: prompt chunks through ``forward_all``, then one decode
    step per continuation token through ``forward``."""
    model = Model(load_config(real_model_dir, dtype=dtype))
    longest = max(len(full) for _, full in sequences)
    cache = KvCache(longest // PAGE + 2, PAGE, layout=model.config.kv_layout(False))
    runner = ModelRunner(model, cache)
    out = []
    for i, (prompt_len, full) in enumerate(sequences):
        kv = cache.open_row(f"r{i}")
        cache.extend(kv, len(full))
        rows = []
        for start in range(0, prompt_len, CHUNK):
            ids = full[start:min(start + CHUNK, prompt_len)]
            rows.append(runner.forward_all([BatchItem(kv, ids, start)])[0].float())
            cache.commit(kv, len(ids))
        for pos in range(prompt_len, len(full)):
            rows.append(runner.forward([BatchItem(kv, full[pos:pos + 1], pos)]).float())
            cache.commit(kv, 1)
        out.append(torch.cat(rows))
        cache.free_kv_row(kv, [(0, kv.allocated_len)], reason="finished")
        cache.close_row(kv)
    cache.check_integrity()
    cache.close()
    return out


def test_float32_paged_runner_equals_transformers(real_model_dir, reference) -> None:
    sequences, ref = reference
    got = paged_logits(real_model_dir, sequences, "float32")
    worst = max(float((g - r).abs().max()) for g, r in zip(got, ref))
    assert worst <= 5e-4, worst


def test_bf16_paged_runner_within_stated_tolerance(real_model_dir, reference) -> None:
    sequences, ref = reference[0], torch.cat(reference[1])
    hf_bf16 = torch.cat(forward_logits(_hf(real_model_dir, torch.bfloat16), sequences))
    got = torch.cat(paged_logits(real_model_dir, sequences, "bfloat16"))
    err = (got - ref).abs()
    top1 = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    mean_err, hf_mean_err = float(err.mean()), float((hf_bf16 - ref).abs().mean())
    worst_rel = float((err.max(-1).values / ref.abs().max(-1).values).max())
    figures = dict(top1=top1, mean_err=mean_err, ref_std=float(ref.std()),
                   worst_rel=worst_rel, hf_bf16_mean_err=hf_mean_err)
    assert top1 >= 0.95, figures
    assert mean_err <= 0.03 * float(ref.std()), figures
    assert worst_rel <= 0.1, figures
    assert mean_err <= 1.25 * hf_mean_err, figures
