"""Built-in models written as checkpoint directories in the Hugging Face layout.

``export_builtin("small", DIR)`` writes the seeded weights, ``config.json`` and the
built-in tokenizer: a real checkpoint that ``pdkv run --model DIR`` and transformers'
``from_pretrained`` both load (``pdkv model export``).
"""

from __future__ import annotations

import os
from pathlib import Path

from common.model.builtin_text import write_builtin_tokenizer
from common.model.checkpoint import write_checkpoint
from common.model.config import get_config
from common.model.seeded import seeded_tensors


def export_builtin(name: str, path: str | os.PathLike, dtype: str = "", *,
                   layers: int | None = None, max_shard_bytes: int = 2 << 30) -> Path:
    """Write built-in model ``name`` (in ``dtype``, default its own) to ``path``.

    ``layers``: only the first blocks, with the same final norm and lm_head (the built-in
    layer-skip draft as a draft checkpoint of its own)."""
    full = get_config(name, **({"dtype": dtype} if dtype else {}))
    cfg = full.with_overrides(num_draft_layers=0)
    tensors = seeded_tensors(full)  # the draft-friendly late-block scale is in the weights
    if layers is not None:
        cfg = cfg.with_overrides(num_layers=layers)
        tensors = ((n, t) for n, t in tensors
                   if not n.startswith("model.layers.") or int(n.split(".")[2]) < layers)
    write_checkpoint(path, cfg.with_overrides(name=Path(path).name), tensors,
                     max_shard_bytes=max_shard_bytes, extra={"bos_token_id": 1,
                                                             "eos_token_id": [2, 4]})
    write_builtin_tokenizer(path, cfg.vocab_size)
    return Path(path)
