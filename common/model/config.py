"""Model configurations: the shape of a Llama-style decoder, its options, where its weights
come from (a checkpoint directory or a seed) and the built-in configs."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from common.kv import DTYPE_BYTES, KvLayout, dtype_of

if TYPE_CHECKING:
    import torch

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
"""Hugging Face architectures pdkv serves (all Llama-style decoders)."""
ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
"""RoPE variants, named as in a Hugging Face config's ``rope_type``."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape, options and weights of a Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU).

    Weights come from ``path`` (a local checkpoint in the Hugging Face layout, see
    ``common.model.hf_config.load_config``) or, when ``path`` is empty, are drawn from
    ``seed`` (built-in models), so two processes with equal configs hold identical weights.
    Weights are never downloaded.
    """

    name: str = "tiny"
    """Label used in logs and the transfer handshake."""
    vocab_size: int = 512
    """Number of token ids; valid ids are [0, vocab_size)."""
    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 4
    """Transformer blocks of the target model."""
    num_heads: int = 4
    """Query heads per block."""
    num_kv_heads: int = 2
    """Key/value heads per block (grouped-query attention); divides num_heads."""
    head_dim: int = 32
    """Elements per attention head; even (rotary embeddings rotate pairs)."""
    intermediate_size: int = 384
    """Width of the SwiGLU feed-forward layer."""
    rope_theta: float = 10000.0
    """Base of the rotary-embedding frequencies."""
    rms_eps: float = 1e-5
    """Epsilon inside RMSNorm."""
    max_position: int = 4096
    """Positions [0, max_position) are valid; longer rows are rejected."""
    dtype: str = "float32"
    """Weights, activations and KV: one of float16, bfloat16, float32, float64."""
    seed: int = 0
    """Seed of the weights."""
    num_draft_layers: int = 1
    """Blocks of the self-speculative draft model: the first num_draft_layers blocks of the
    target plus its final norm and lm_head; 0 means no draft. In [0, num_layers)."""
    architecture: str = "LlamaForCausalLM"
    """The Hugging Face architecture (one of ``ARCHITECTURES``); built-ins are Llamas."""
    qkv_bias: bool = False
    """q/k/v projections carry a bias (Qwen2; Llama with ``attention_bias``)."""
    o_bias: bool = False
    """The output projection carries a bias (Llama with ``attention_bias``)."""
    tie_word_embeddings: bool = False
    """lm_head is the embedding matrix (no separate ``lm_head.weight``)."""
    sliding_window: int = 0
    """Each query attends to at most this many keys, itself included (Mistral); 0 = all."""
    rope_type: str = "default"
    """RoPE variant (one of ``ROPE_TYPES``): default, linear (positions / factor),
    dynamic (NTK base stretched once a sequence passes rope_original_max_position),
    llama3 (Llama 3.1 wavelength-dependent scaling)."""
    rope_factor: float = 1.0
    """Scaling factor of linear, dynamic and llama3 RoPE."""
    rope_low_freq_factor: float = 1.0
    """llama3 RoPE: wavelengths past original / low_freq_factor are divided by factor."""
    rope_high_freq_factor: float = 4.0
    """llama3 RoPE: wavelengths below original / high_freq_factor are kept."""
    rope_original_max_position: int = 0
    """llama3: the pretraining context; dynamic: the context past which the base grows.
    0 for the other types."""
    path: str = ""
    """Checkpoint directory the weights load from; empty: drawn from ``seed``."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"ModelConfig.dtype={self.dtype!r}; allowed: {sorted(DTYPE_BYTES)}")
        for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                      "head_dim", "intermediate_size", "max_position"):
            if getattr(self, field) < 1:
                raise ValueError(f"ModelConfig.{field}={getattr(self, field)} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig.num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even (RoPE)")
        if not 0 <= self.num_draft_layers < self.num_layers:
            raise ValueError(f"ModelConfig.num_draft_layers={self.num_draft_layers}; allowed: "
                             f"0 (no draft) to num_layers-1={self.num_layers - 1}")
        if self.rope_theta <= 0 or self.rms_eps <= 0:
            raise ValueError(f"ModelConfig.rope_theta={self.rope_theta} and "
                             f"rms_eps={self.rms_eps} must be > 0")
        self._check_options()

    def _check_options(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"ModelConfig.architecture={self.architecture!r}; allowed: "
                             f"{list(ARCHITECTURES)}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"ModelConfig.rope_type={self.rope_type!r}; allowed: "
                             f"{list(ROPE_TYPES)}")
        if self.rope_type != "default" and not self.rope_factor >= 1.0:
            raise ValueError(f"ModelConfig.rope_factor={self.rope_factor} must be >= 1 for "
                             f"rope_type={self.rope_type!r}")
        if self.rope_type in ("dynamic", "llama3") and self.rope_original_max_position < 1:
            raise ValueError(f"ModelConfig.rope_original_max_position="
                             f"{self.rope_original_max_position} must be >= 1 for "
                             f"rope_type={self.rope_type!r}")
        if self.rope_type == "llama3" and not (
                0 < self.rope_low_freq_factor < self.rope_high_freq_factor):
            raise ValueError(f"ModelConfig: need 0 < rope_low_freq_factor="
                             f"{self.rope_low_freq_factor} < rope_high_freq_factor="
                             f"{self.rope_high_freq_factor}")
        if self.sliding_window < 0:
            raise ValueError(f"ModelConfig.sliding_window={self.sliding_window} must be >= 0 "
                             "(0 = full attention)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_of(self.dtype)

    def kv_layout(self, with_draft: bool = True) -> KvLayout:
        """The KV pool layout this model reads and writes; draft layers follow the target's."""
        return KvLayout(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                        head_dim=self.head_dim, dtype=self.dtype,
                        num_draft_layers=self.num_draft_layers if with_draft else 0)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Elements of one token's K (or V) in one layer."""
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict:
        """Plain fields (msgpack/JSON-safe); ``ModelConfig(**d)`` rebuilds and validates."""
        return asdict(self)

    def with_overrides(self, **changes: object) -> ModelConfig:
        """A copy with some fields changed (validated again), e.g. ``dtype="float64"``."""
        return replace(self, **changes)


CONFIGS: dict[str, ModelConfig] = {
    # Serves on 2 CPU cores; the default everywhere.
    "tiny": ModelConfig(),
    # Still CPU-friendly, wide enough that batching shows in benchmarks.
    "small": ModelConfig(name="small", vocab_size=4096, hidden_size=512, num_layers=8,
                         num_heads=8, num_kv_heads=4, head_dim=64, intermediate_size=1536,
                         num_draft_layers=2),
    # GPU shapes of real models (Llama 3.2 1B / Llama 3 8B with a 32k vocabulary).
    "llama-1b-shape": ModelConfig(name="llama-1b-shape", vocab_size=32000, hidden_size=2048,
                                  num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                                  intermediate_size=8192, rope_theta=500000.0,
                                  max_position=8192, dtype="bfloat16", num_draft_layers=4),
    "llama-8b-shape": ModelConfig(name="llama-8b-shape", vocab_size=32000, hidden_size=4096,
                                  num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                                  intermediate_size=14336, rope_theta=500000.0,
                                  max_position=8192, dtype="bfloat16", num_draft_layers=4),
}


def get_config(name: str = "tiny", **overrides: object) -> ModelConfig:
    """A built-in config by name, optionally with fields overridden."""
    if name not in CONFIGS:
        raise ValueError(f"unknown model config {name!r}; allowed: {sorted(CONFIGS)}")
    return CONFIGS[name].with_overrides(**overrides) if overrides else CONFIGS[name]
