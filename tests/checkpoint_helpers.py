"""Tiny random Hugging Face checkpoints built with transformers (test-only dependency).

``hf_checkpoint(kind)`` builds a checkpoint directory once per test process (cached by
kind) with ``save_pretrained``: random weights with randomised norm weights and biases, so
that a mapping mistake (a swapped projection, a missing bias, an untied head) cannot hide
behind ones and zeros. ``hf_generate`` is transformers' own greedy output.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import cache
from pathlib import Path

import torch

_ROOT = Path(tempfile.mkdtemp(prefix="pdkv-ckpt-"))
atexit.register(shutil.rmtree, _ROOT, True)

_BASE = dict(vocab_size=384, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)

KINDS: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),
    "llama3-rope": ("llama", {"max_position_embeddings": 512, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}, "rope_theta": 500000.0}),
    "linear-rope": ("llama", {"rope_scaling": {"type": "linear", "factor": 4.0}}),
    "dynamic-rope": ("llama", {"max_position_embeddings": 24,
                               "rope_scaling": {"type": "dynamic", "factor": 4.0}}),
    "llama-bias-headdim": ("llama", {"attention_bias": True, "head_dim": 24}),
    "tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2": ("qwen2", {"num_key_value_heads": 1}),
    "mistral": ("mistral", {"sliding_window": 8}),
    "sharded": ("llama", {"num_hidden_layers": 4}),
    # a draft for "llama": one layer, narrower KV rows (1 head of 16 vs 2 of 16)
    "llama-draft": ("llama", {"num_hidden_layers": 1, "hidden_size": 32,
                              "intermediate_size": 64, "num_attention_heads": 2,
                              "num_key_value_heads": 1}),
    # a draft for "llama" that splits over two ranks: KV heads 2 of 8 (vs 2 of 16)
    "llama-draft-tp2": ("llama", {"num_hidden_layers": 1, "hidden_size": 32,
                                  "intermediate_size": 64, "num_attention_heads": 4,
                                  "num_key_value_heads": 2}),
}
"""Checkpoint kinds: (model type, config overrides)."""


def _config(kind: str):
    import transformers

    model_type, overrides = KINDS[kind]
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": transformers.MistralConfig}[model_type]
    return cls(**{**_BASE, **overrides})


@cache
def hf_model(kind: str, dtype: str = "float64"):
    """The transformers model of ``kind`` (seeded), randomised norms and biases."""
    import transformers

    torch.manual_seed(sum(map(ord, kind)))
    cfg = _config(kind)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 * (2.0 if "embed" in name
                                                                     else 1.0))
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.generation_config.pad_token_id = 0
    return model.to(getattr(torch, dtype)).eval()


@cache
def hf_checkpoint(kind: str, dtype: str = "float64") -> Path:
    """A checkpoint directory of ``kind`` written by ``save_pretrained``."""
    from common.model import write_builtin_tokenizer

    path = _ROOT / f"{kind}-{dtype}"
    shard = "20KB" if kind == "sharded" else "1GB"
    hf_model(kind, dtype).save_pretrained(path, max_shard_size=shard)
    write_builtin_tokenizer(path, _BASE["vocab_size"])  # the same tokenizer in every kind
    return path


def hf_generate(kind: str, prompt: list[int], max_new_tokens: int, dtype: str = "float64"
                ) -> list[int]:
    """transformers' greedy output (new tokens only), dynamic RoPE state reset first."""
    model = _fresh(kind, dtype)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()


def hf_logits(kind: str, tokens: list[int], dtype: str = "float64") -> torch.Tensor:
    """transformers' logits of every position of one sequence [n, vocab]."""
    with torch.no_grad():
        return _fresh(kind, dtype)(torch.tensor([tokens])).logits[0]


def _fresh(kind: str, dtype: str):
    """The model with dynamic RoPE's frequency cache reset (it survives calls)."""
    model = hf_model(kind, dtype)
    rotary = model.model.rotary_emb
    if getattr(rotary, "rope_type", "") == "dynamic":
        rotary.register_buffer("inv_freq", rotary.original_inv_freq.clone(), persistent=False)
        rotary.max_seq_len_cached = rotary.original_max_seq_len
    return model
