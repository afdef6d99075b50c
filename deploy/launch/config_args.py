"""A deployment's ``ServeConfig`` from the command line: the embedded default, then
``--config FILE.json`` or ``--config-json JSON``, then individual flags.

Its own module (not ``deploy/launch/run.py``): the router reads its config here without
importing the launcher, the driver and the rest of ``pdkv run``.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from common.config import DEFAULT, ConfigError, ServeConfig, resolve_model

_FLAG_FIELDS = ("dtype", "page_size", "prefill_pages", "decode_pages", "chunk_size",
                "max_running", "transport", "debug_integrity", "spec_k", "offload",
                "host_pages", "overcommit", "prefix_load_timeout_s", "prefill_tp",
                "decode_tp", "tp_timeout_s", "kv_transport", "kv_security", "kv_memory_mib",
                "gpu_memory_utilization", "host_memory_mib", "routing", "local_prefill_tokens")
_FLAG_OF = {"model": "--model", "model_path": "--model", "draft_model_path": "--draft-model"}


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The embedded default, then ``--config FILE.json`` or ``--config-json JSON``, then
    individual flags.

    Raises:
        ConfigError: a one-line message naming the file, field or flag and what is allowed.
    """
    cfg = DEFAULT
    path, text = getattr(args, "config", None), getattr(args, "config_json", None)
    if path and text:
        raise ConfigError("give --config FILE.json or --config-json JSON, not both")
    if path or text:
        cfg = ServeConfig.from_dict({**DEFAULT.to_dict(), **load_config(path, text)})
    flags = {name: getattr(args, name, None) for name in _FLAG_FIELDS}
    try:
        flags.update(resolve_model(getattr(args, "model", None)))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    draft = getattr(args, "draft_model", None)
    flags.update(draft_model_path=str(Path(draft).expanduser().resolve()) if draft else None,
                 spec_ngram=getattr(args, "spec_ngram", None))
    try:
        return cfg.with_overrides(**flags)
    except ConfigError as exc:
        given = [n for n, v in flags.items()
                 if v is not None and re.search(rf"\b{n}=", str(exc))]
        flag = f" (from {_FLAG_OF.get(given[0], '--' + given[0].replace('_', '-'))})" \
            if given else ""
        raise ConfigError(f"{exc}{flag}") from None


def check_weights(cfg: ServeConfig) -> None:
    """Before launching: each checkpoint directory holds weights pdkv loads (safetensors),
    so that missing or pickled-only weights are one line now, not a traceback from every
    worker once it started.

    Raises:
        ConfigError: a checkpoint without safetensors weights (names the flag and what
            was found instead).
    """
    from common.model import weight_files

    for field in ("model_path", "draft_model_path"):
        path = getattr(cfg, field)
        if not path:
            continue
        try:
            weight_files(path)
        except FileNotFoundError as exc:
            raise ConfigError(f"{_FLAG_OF[field]} {path}: {exc}") from None


def load_config(path: str | None, text: str | None) -> dict:
    """The JSON object of ``--config FILE.json`` or ``--config-json JSON``."""
    where = f"--config {path}" if path else "--config-json"
    try:
        raw = Path(path).read_text() if path else text
        obj = json.loads(raw)
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not JSON ({exc.msg} at line {exc.lineno} column "
                          f"{exc.colno})") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: must be a JSON object of ServeConfig fields, not "
                          f"{type(obj).__name__}")
    return obj
