"""The model: configs, checkpoints, the Llama-style decoder, the paged runner, sampling,
the reference."""

from common.model.builtin_text import write_builtin_tokenizer
from common.model.checkpoint import checkpoint_tensors, write_checkpoint
from common.model.config import ARCHITECTURES, CONFIGS, ModelConfig, get_config
from common.model.export import export_builtin
from common.model.hf_config import UnsupportedModel, load_config
from common.model.model import Model, load_weights
from common.model.reference import generate_greedy
from common.model.runner import BatchItem, ModelRunner
from common.model.sampling import sample
from common.model.seeded import seeded_tensors
from common.model.text import Detokenizer, StopStrings
from common.model.tokenizer import Tokenizer
from common.model.tp import TpModel, shard_config
from common.model.tp_lockstep import (
    TAG_CONFIG,
    TAG_STEP,
    LeaderKvCache,
    LeaderRunner,
    Lockstep,
    RankPins,
    RankReport,
)
from common.model.tp_mirror import Mirror, RankTransfer

__all__ = ["ARCHITECTURES", "CONFIGS", "BatchItem", "Detokenizer", "LeaderKvCache",
           "LeaderRunner", "Lockstep", "Mirror", "RankPins", "RankReport", "RankTransfer",
           "TAG_CONFIG", "TAG_STEP", "Model", "ModelConfig",
           "ModelRunner", "StopStrings", "Tokenizer", "UnsupportedModel", "checkpoint_tensors",
           "export_builtin", "generate_greedy", "get_config", "load_config", "load_weights",
           "sample", "seeded_tensors", "shard_config", "TpModel", "write_builtin_tokenizer",
           "write_checkpoint"]
