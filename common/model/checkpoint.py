"""Checkpoint directories in the Hugging Face layout: reading tensors one at a time, and
writing one (built-in models are exported this way).

A directory holds ``config.json``, ``model.safetensors`` or shards
``model-0000X-of-0000N.safetensors`` listed in ``model.safetensors.index.json``, and for
text ``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from common.model.config import ModelConfig

logger = logging.getLogger(__name__)
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                "MistralForCausalLM": "mistral"}


def weight_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint directory, in load order.

    Raises:
        FileNotFoundError: no safetensors weights, or a shard the index names is missing.
    """
    d = Path(path)
    index = d / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise FileNotFoundError(f"{index} has no weight_map")
        files = [d / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shards missing from {d}: {missing}")
        return files
    if (d / SINGLE).is_file():
        return [d / SINGLE]
    others = sorted(p.name for p in d.glob("*.bin")) + sorted(p.name for p in d.glob("*.pt"))
    hint = f" (found {others[:3]}: pickled PyTorch weights are not loaded; convert them to " \
        "safetensors)" if others else ""
    raise FileNotFoundError(f"{d} has neither {SINGLE} nor {INDEX}{hint}")


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
              "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
              "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file, not read yet: ``read_into`` fills a tensor the
    caller owns straight from the file (no memory map, no intermediate copy)."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Byte offset of the data in the file."""
    nbytes: int

    def read_into(self, out: torch.Tensor) -> None:
        """Read the bytes into ``out`` (contiguous, CPU, this dtype and shape)."""
        assert out.is_contiguous() and out.device.type == "cpu" and out.dtype == self.dtype, \
            (self.name, out.dtype, out.device)
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        with open(self.file, "rb", buffering=0) as f:
            f.seek(self.offset)
            done = 0
            while done < self.nbytes:
                n = f.readinto(view[done:])
                if not n:
                    raise ValueError(f"{self.file}: tensor {self.name!r} is truncated")
                done += n

    def load(self) -> torch.Tensor:
        """A new CPU tensor holding this tensor."""
        out = torch.empty(self.shape, dtype=self.dtype)
        self.read_into(out)
        return out


def stored_tensors(file: Path) -> list[StoredTensor]:
    """The tensors of one safetensors file, from its header (8-byte length + JSON)."""
    with open(file, "rb") as f:
        raw = f.read(8)
        size = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if not 0 < size <= _MAX_HEADER:
            raise ValueError(f"{file} is not a safetensors file (header size {size})")
        header = json.loads(f.read(size))
    base, out = 8 + size, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _ST_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ValueError(f"{file}: tensor {name!r} has dtype {info.get('dtype')!r}; "
                             f"supported: {sorted(_ST_DTYPES)} (quantized checkpoints are not)")
        start, end = info["data_offsets"]
        shape = tuple(int(d) for d in info["shape"])
        expect = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if end - start != expect:
            raise ValueError(f"{file}: tensor {name!r} spans {end - start} bytes, its shape "
                             f"{shape} needs {expect}")
        out.append(StoredTensor(name, file, dtype, shape, base + start, end - start))
    return out


def checkpoint_tensors(path: str | os.PathLike) -> Iterator[tuple[str, StoredTensor]]:
    """Every tensor of the checkpoint, not read yet (``StoredTensor``), file by file.

    The consumer reads each straight into its destination (``WeightLoader`` does), so
    loading holds one copy of the weights and no memory-mapped file pages.
    """
    for file in weight_files(path):
        for t in stored_tensors(file):
            yield t.name, t


def hf_config_dict(cfg: ModelConfig) -> dict:
    """The ``config.json`` of ``cfg`` as transformers writes it (``rope_parameters`` form)."""
    rope: dict = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
    max_pos = cfg.max_position
    if cfg.rope_type != "default":
        rope["factor"] = cfg.rope_factor
    if cfg.rope_type == "llama3":
        rope.update(low_freq_factor=cfg.rope_low_freq_factor,
                    high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_max_position)
    if cfg.rope_type == "dynamic":
        max_pos = cfg.rope_original_max_position
    out = {"architectures": [cfg.architecture], "model_type": _MODEL_TYPES[cfg.architecture],
           "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
           "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
           "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
           "head_dim": cfg.head_dim, "hidden_act": "silu", "max_position_embeddings": max_pos,
           "rms_norm_eps": cfg.rms_eps, "rope_parameters": rope,
           "tie_word_embeddings": cfg.tie_word_embeddings, "dtype": cfg.dtype}
    if cfg.architecture == "LlamaForCausalLM":
        out["attention_bias"] = cfg.o_bias
        out["mlp_bias"] = False
    if cfg.architecture == "MistralForCausalLM":
        out["sliding_window"] = cfg.sliding_window or None
    return out


def write_checkpoint(path: str | os.PathLike, cfg: ModelConfig,
                     tensors: Iterable[tuple[str, torch.Tensor]], *,
                     max_shard_bytes: int = 2 << 30, extra: dict | None = None) -> Path:
    """Write ``tensors`` (in ``cfg.dtype``) and ``config.json`` as a checkpoint directory.

    Tensors are written shard by shard (at most ``max_shard_bytes`` each), so memory holds
    one shard; more than one shard also writes ``model.safetensors.index.json``.
    ``extra`` adds keys to ``config.json`` (``bos_token_id``, ``eos_token_id``...).
    """
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, files = 0, []
    for name, t in tensors:
        t = t.to(cfg.torch_dtype).contiguous().clone()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            files.append(_flush(d, shards[-1], len(files)))
            shards[-1], size = {}, 0
        shards[-1][name] = t
        size += nbytes
    files.append(_flush(d, shards[-1], len(files)))
    _name_shards(d, files)
    (d / "config.json").write_text(json.dumps({**hf_config_dict(cfg), **(extra or {})},
                                              indent=2) + "\n")
    logger.info("wrote checkpoint %s (%d shard(s))", d, len(files))
    return d


def _flush(d: Path, shard: dict[str, torch.Tensor], index: int) -> tuple[Path, list[str]]:
    file = d / f"shard-{index:05d}.tmp"
    save_file(shard, str(file), metadata={"format": "pt"})
    return file, sorted(shard)


def _name_shards(d: Path, files: list[tuple[Path, list[str]]]) -> None:
    """Rename temporary shards to the Hugging Face names and write the index if sharded."""
    if len(files) == 1:
        files[0][0].replace(d / SINGLE)
        (d / INDEX).unlink(missing_ok=True)
        return
    weight_map, total = {}, 0
    for i, (file, names) in enumerate(files):
        final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        total += file.stat().st_size
        file.replace(d / final)
        weight_map.update({name: final for name in names})
    (d / SINGLE).unlink(missing_ok=True)
    (d / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                       "weight_map": weight_map}, indent=2) + "\n")
