"""flex_attention over the paged pool (CUDA): filled in by the next commit."""

from __future__ import annotations


def flex_supported(page_size: int) -> bool:
    """Whether the flex backend serves a pool of ``page_size`` (not yet: torch path)."""
    return False
