"""N-gram prompt lookup: draft tokens without a draft model.

The sequence's last n tokens (n from ``max_n`` down to ``min_n``) are looked up earlier in
the same sequence (prompt and output); the tokens that followed the most recent earlier
match are the proposal. Text that repeats its context (code edits, quoting, summaries,
structured output) is accepted often; other text proposes nothing and the step is a
plain decode step (the cost of a lookup is a few numpy ops).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Proposes continuations by matching the sequence's tail earlier in itself.

    Args:
        max_n: longest tail matched (>= 1); longer matches are tried first.
        min_n: shortest tail matched (1 <= min_n <= max_n).
    """

    def __init__(self, max_n: int, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"NgramProposer: need 1 <= min_n={min_n} <= max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier match of the tail."""
        if k < 1 or len(tokens) < self.min_n + 1:
            return []
        t = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, len(t) - 1), self.min_n - 1, -1):
            # windows starting at i < len - n: each has at least one token after it
            windows = sliding_window_view(t[:-1], n)  # [len - n, n]
            hits = np.flatnonzero((windows == t[-n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return t[start:start + k].tolist()
        return []
