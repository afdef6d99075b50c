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
    "sample": "common.model.sampling",
    "seeded_tensors": "common.model.seeded",
    "TpModel": "common.model.tp", "shard_config": "common.model.tp"})

__all__ = ["ARCHITECTURES", "CONFIGS", "BatchItem", "Detokenizer", "Model", "ModelConfig",
           "ModelRunner", "StopStrings", "Tokenizer", "UnsupportedModel", "checkpoint_tensors",
           "export_builtin", "generate_greedy", "get_config", "load_config", "load_weights",
           "sample", "seeded_tensors", "shard_config", "TpModel",
           "weight_files", "write_builtin_tokenizer", "write_checkpoint"]
