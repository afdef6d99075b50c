"""The layer-skip draft of a checkpoint, written as a draft checkpoint of its own.

The built-in models speculate with their own first ``num_draft_layers`` blocks (plus the
final norm and the head). A Hugging Face checkpoint has no such draft; this writes its
first ``layers`` blocks, its embedding, final norm and head as a checkpoint directory, so
that ``--draft-model DIR`` runs exactly the layer-skip draft on a trained model. Its
proposals are the built-in kind's at that depth; its KV is its own (as the built-in
draft's is: draft layers come after the target's in each page).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

_TEXT_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
               "generation_config.json", "special_tokens_map.json")


def write_layer_draft(src: str | os.PathLike, layers: int, dst: str | os.PathLike) -> Path:
    """Write the first ``layers`` blocks of checkpoint ``src`` to the new directory
    ``dst`` (written under a temporary name, then renamed). Returns ``dst``.

    Raises:
        ValueError: ``layers`` is not in [1, the checkpoint's layers).
        FileExistsError: ``dst`` exists.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    total = int(config["num_hidden_layers"])
    if not 1 <= layers < total:
        raise ValueError(f"layers={layers}: a layer-skip draft of {src.name} needs 1 to "
                         f"{total - 1} of its {total} blocks")
    if dst.exists():
        raise FileExistsError(f"{dst} exists")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".draft-", dir=dst.parent))
    try:
        kept = {}
        for file in sorted(src.glob("*.safetensors")):
            with safe_open(file, "pt") as f:
                kept.update({k: f.get_tensor(k) for k in f.keys() if _kept(k, layers)})
        save_file(kept, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers},
                                                    indent=2))
        for name in _TEXT_FILES:
            if (src / name).is_file():
                shutil.copy(src / name, tmp / name)
        tmp.chmod(0o755)
        os.rename(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def _kept(name: str, layers: int) -> bool:
    """Tensors of blocks below ``layers``, and every tensor outside the blocks."""
    if not name.startswith("model.layers."):
        return True
    return int(name.split(".")[2]) < layers
