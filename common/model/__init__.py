"""The model: configs, the Llama-style decoder, the paged runner, sampling, the reference."""

from common.model.config import CONFIGS, ModelConfig, get_config
from common.model.model import Model
from common.model.reference import generate_greedy
from common.model.runner import BatchItem, ModelRunner
from common.model.sampling import sample

__all__ = ["CONFIGS", "BatchItem", "Model", "ModelConfig", "ModelRunner", "generate_greedy",
           "get_config", "sample"]
