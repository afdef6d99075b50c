"""The model: configs, checkpoints, the Llama-style decoder, the paged runner, sampling,
the reference."""

from common.lazy import lazy_names
from common.model.builtin_text import write_builtin_tokenizer
from common.model.config import ARCHITECTURES, CONFIGS, ModelConfig, get_config
from common.model.hf_config import UnsupportedModel, load_config
from common.model.text import Detokenizer, StopStrings
from common.model.tokenizer import Tokenizer

# the modules that import torch: read on first use (common/lazy.py)
__getattr__ = lazy_names(__name__, {
    "checkpoint_tensors": "common.model.checkpoint", "write_checkpoint": "common.model.checkpoint",
    "weight_files": "common.model.checkpoint",
    "export_builtin": "common.model.export",
    "Model": "common.model.model", "load_weights": "common.model.model",
    "generate_greedy": "common.model.reference",
    "BatchItem": "common.model.runner", "ModelRunner": "common.model.runner",
    "PassPlan": "common.model.runner", "Sourced": "common.model.runner",
    "DevicePlan": "common.model.plan", "HostPlan": "common.model.plan",
    "download": "common.model.plan",
    "AttentionBackend": "common.model.attention", "TorchAttention": "common.model.attention",
    "select_backend": "common.model.backends",
    "sample": "common.model.sampling", "plan_draws": "common.model.sampling",
    "SamplingArgs": "common.model.sampling", "choose": "common.model.sampling",
    "exact_rows": "common.model.sampling", "candidates_for": "common.model.sampling",
    "draw": "common.model.sampling",
    "process": "common.model.sampling", "DRAW": "common.model.sampling",
    "REDRAW": "common.model.sampling",
    "Proposals": "common.model.rejection", "verify": "common.model.rejection",
    "verify_on_host": "common.model.rejection",
    "seeded_tensors": "common.model.seeded",
    "TpModel": "common.model.tp", "shard_config": "common.model.tp"})

__all__ = ["ARCHITECTURES", "AttentionBackend", "BatchItem", "CONFIGS", "DRAW", "REDRAW",
           "Detokenizer", "DevicePlan", "HostPlan", "Model", "ModelConfig", "ModelRunner",
           "PassPlan", "Proposals", "SamplingArgs", "Sourced", "StopStrings", "Tokenizer",
           "TorchAttention", "TpModel", "UnsupportedModel", "candidates_for",
           "checkpoint_tensors", "choose", "download", "draw", "exact_rows", "export_builtin",
           "generate_greedy", "get_config", "load_config", "load_weights", "plan_draws",
           "process", "sample", "seeded_tensors", "select_backend", "shard_config", "verify",
           "verify_on_host", "weight_files", "write_builtin_tokenizer", "write_checkpoint"]
