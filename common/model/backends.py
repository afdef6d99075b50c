"""Which attention backend a runner uses (common/model/attention.py has the interface)."""

from __future__ import annotations

import os

import torch

from common.model.attention import AttentionBackend, TorchAttention
from common.model.flex_attention import FlexAttention, flex_supported

BACKENDS = ("torch", "flex")


def select_backend(device: torch.device, page_size: int, name: str | None = None
                   ) -> AttentionBackend:
    """The backend for a pool on ``device``: ``name`` (or ``PDKV_ATTENTION``), else flex
    on CUDA where the page size suits its kernel, else the torch path."""
    name = name or os.environ.get("PDKV_ATTENTION", "") or "auto"
    if name not in (*BACKENDS, "auto"):
        raise ValueError(f"attention backend {name!r}; allowed: auto, {', '.join(BACKENDS)}")
    if name == "auto":
        name = "flex" if device.type == "cuda" and flex_supported(page_size) else "torch"
    return FlexAttention() if name == "flex" else TorchAttention()
