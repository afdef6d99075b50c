"""Reading a Hugging Face ``config.json`` into a ``ModelConfig``, refusing what pdkv cannot
serve before any process starts.

Accepted: ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``MistralForCausalLM`` with SiLU MLPs,
RoPE of type default, linear, dynamic or llama3 (in the older ``rope_theta`` +
``rope_scaling`` form or the newer ``rope_parameters`` form), tied or separate embeddings,
``head_dim`` given or derived, and Mistral's sliding window. Everything else raises
``UnsupportedModel`` naming the field and its value.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

from common.model.config import ARCHITECTURES, ROPE_TYPES, ModelConfig

_DTYPE_NAMES = {"float16": "float16", "fp16": "float16", "half": "float16",
                "bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32",
                "fp32": "float32", "float": "float32", "float64": "float64"}


class UnsupportedModel(ValueError):
    """A checkpoint pdkv refuses to serve; the message names the field and the value."""


def load_config(path: str | os.PathLike, dtype: str = "") -> ModelConfig:
    """The ``ModelConfig`` of the checkpoint directory ``path`` (``dtype`` overrides).

    Raises:
        FileNotFoundError: ``path`` is not a directory or has no ``config.json``.
        UnsupportedModel: an architecture, option or value pdkv does not serve.
    """
    d = Path(path).expanduser().resolve()
    if not d.is_dir():
        raise FileNotFoundError(f"model path {str(path)!r} is not a directory (pdkv never "
                                "downloads: give a local checkpoint directory)")
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{d} has no config.json: not a Hugging Face checkpoint "
                                "directory")
    cfg = _cached(str(d), cfg_file.stat().st_mtime_ns)
    return cfg.with_overrides(dtype=dtype) if dtype else cfg


@lru_cache(maxsize=32)
def _cached(path: str, _mtime_ns: int) -> ModelConfig:
    try:
        raw = json.loads(Path(path, "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UnsupportedModel(f"{path}/config.json is unreadable: {exc}") from None
    if not isinstance(raw, dict):
        raise UnsupportedModel(f"{path}/config.json is not a JSON object")
    return config_from_hf(raw, path)


def config_from_hf(raw: dict, path: str = "") -> ModelConfig:
    """A ``ModelConfig`` from a parsed ``config.json``; see the module docstring."""
    arch = _architecture(raw)
    _refuse_unsupported(raw, arch)
    hidden, heads = _int(raw, "hidden_size"), _int(raw, "num_attention_heads")
    head_dim = raw.get("head_dim") or hidden // heads
    if not raw.get("head_dim") and hidden % heads:
        raise UnsupportedModel(f"hidden_size={hidden} is not a multiple of "
                               f"num_attention_heads={heads} and head_dim is not given")
    max_pos = _int(raw, "max_position_embeddings")
    rope = _rope(raw, max_pos)
    bias = bool(raw.get("attention_bias", False))
    return ModelConfig(
        name=Path(path).name if path else str(raw.get("_name_or_path", arch)),
        vocab_size=_int(raw, "vocab_size"), hidden_size=hidden,
        num_layers=_int(raw, "num_hidden_layers"), num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads), head_dim=int(head_dim),
        intermediate_size=_int(raw, "intermediate_size"),
        rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position=rope.pop("max_position"), dtype=_dtype(raw), num_draft_layers=0,
        architecture=arch, qkv_bias=arch == "Qwen2ForCausalLM" or bias, o_bias=bias,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        sliding_window=_sliding_window(raw, arch), path=path, **rope)


def _architecture(raw: dict) -> str:
    archs = raw.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1:
        raise UnsupportedModel(f"architectures={archs!r}; need exactly one of "
                               f"{list(ARCHITECTURES)}")
    if archs[0] not in ARCHITECTURES:
        raise UnsupportedModel(f"architectures={archs!r}: {archs[0]!r} is not supported; "
                               f"supported: {list(ARCHITECTURES)}")
    return archs[0]


def _refuse_unsupported(raw: dict, arch: str) -> None:
    quant = raw.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise UnsupportedModel(f"quantization_config.quant_method={method!r}: quantized "
                               "weights are not supported; use an unquantized checkpoint")
    checks = {"hidden_act": ("silu",), "mlp_bias": (False, None),
              "partial_rotary_factor": (1.0, None)}
    for field, allowed in checks.items():
        if raw.get(field) not in allowed:
            raise UnsupportedModel(f"{field}={raw.get(field)!r} is not supported; allowed: "
                                   f"{[a for a in allowed if a is not None]}")
    if arch == "Qwen2ForCausalLM" and raw.get("use_sliding_window"):
        raise UnsupportedModel("use_sliding_window=True is not supported for Qwen2 "
                               "(per-layer windows); use a checkpoint with full attention")
    layer_types = raw.get("layer_types")
    if arch != "MistralForCausalLM" and layer_types and set(layer_types) != {"full_attention"}:
        raise UnsupportedModel(f"layer_types={sorted(set(layer_types))!r}: only "
                               "full_attention layers are supported for " + arch)


def _rope(raw: dict, max_pos: int) -> dict:
    """RoPE fields of ``ModelConfig`` from either form, and the longest servable row."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise UnsupportedModel(f"rope_scaling={params!r} must be an object or null")
    field = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModel(f"{field}.rope_type={rope_type!r} is not supported; "
                               f"supported: {list(ROPE_TYPES)}")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    out = {"rope_theta": float(theta), "rope_type": rope_type, "max_position": max_pos}
    if rope_type == "default":
        return out
    factor = params.get("factor")
    if not isinstance(factor, (int, float)) or factor < 1:
        raise UnsupportedModel(f"{field}.factor={factor!r} must be a number >= 1")
    out["rope_factor"] = float(factor)
    if rope_type == "dynamic":
        # transformers grows the base past max_position_embeddings; the row may reach
        # factor times it (as vLLM and sglang derive their context for this type).
        out["rope_original_max_position"] = max_pos
        out["max_position"] = int(max_pos * factor)
    elif rope_type == "llama3":
        out["rope_original_max_position"] = int(params.get(
            "original_max_position_embeddings", raw.get("original_max_position_embeddings",
                                                        max_pos)))
        out["rope_low_freq_factor"] = float(params.get("low_freq_factor", 1.0))
        out["rope_high_freq_factor"] = float(params.get("high_freq_factor", 4.0))
    return out


def _sliding_window(raw: dict, arch: str) -> int:
    if arch != "MistralForCausalLM":
        return 0
    window = raw.get("sliding_window")
    if window is None:
        return 0
    if not isinstance(window, int) or window < 1:
        raise UnsupportedModel(f"sliding_window={window!r} must be a positive integer or null")
    layer_types = raw.get("layer_types")
    if layer_types and set(layer_types) != {"sliding_attention"}:
        raise UnsupportedModel(f"layer_types={sorted(set(layer_types))!r}: mixed full and "
                               "sliding layers are not supported")
    return window


def _dtype(raw: dict) -> str:
    name = raw.get("dtype", raw.get("torch_dtype")) or "float32"
    if name not in _DTYPE_NAMES:
        raise UnsupportedModel(f"dtype={name!r} is not supported; allowed: "
                               f"{sorted(set(_DTYPE_NAMES.values()))}")
    return _DTYPE_NAMES[name]


def _int(raw: dict, field: str) -> int:
    value = raw.get(field)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UnsupportedModel(f"config.json field {field}={value!r} must be a positive "
                               "integer")
    return value
