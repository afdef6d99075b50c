"""The shape of one KV page: what both ends of a transfer must agree on."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
"""The KV and weight dtypes pdkv serves, by name, and the bytes of one element."""


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (one of ``DTYPE_BYTES``). torch is imported here, not
    at the top: the router and the command line read layouts and configs without it."""
    import torch

    return getattr(torch, name)


@dataclass(frozen=True)
class KvLayout:
    """Layout of the KV data held for each page of a pool.

    A pool's data tensor is page-major so that a run of consecutive pages is one
    contiguous block of bytes (one transfer frame):
    ``# [num_pages, num_layers + num_draft_layers, 2, page_size, num_kv_heads, head_dim]``
    where index 0 of the third dimension is K and 1 is V.
    """

    num_layers: int = 1
    """Target-model attention layers."""
    num_kv_heads: int = 1
    """KV heads of the whole model (before any tensor-parallel split)."""
    head_dim: int = 8
    """Elements per head."""
    dtype: str = "float32"
    """One of float16, bfloat16, float32, float64."""
    num_draft_layers: int = 0
    """Draft-model layers stored in the same pages after the target's layers."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"KvLayout.dtype={self.dtype!r}; allowed: {sorted(DTYPE_BYTES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"KvLayout.{name}={getattr(self, name)} must be >= 1")
        if self.num_draft_layers < 0:
            raise ValueError(f"KvLayout.num_draft_layers={self.num_draft_layers} must be >= 0")

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_of(self.dtype)

    @property
    def total_layers(self) -> int:
        return self.num_layers + self.num_draft_layers

    def page_shape(self, page_size: int) -> tuple[int, ...]:
        return (self.total_layers, 2, page_size, self.num_kv_heads, self.head_dim)

    def page_bytes(self, page_size: int) -> int:
        n = self.total_layers * 2 * page_size * self.num_kv_heads * self.head_dim
        return n * DTYPE_BYTES[self.dtype]

    def to_dict(self) -> dict:
        return asdict(self)

    def fingerprint(self, page_size: int) -> str:
        """A short digest of everything that must match across a transfer."""
        text = repr(sorted({**self.to_dict(), "page_size": page_size}.items()))
        return hashlib.sha256(text.encode()).hexdigest()[:16]
