"""Tensor-parallel head mapping between a prefill group and a decode group.

KV heads are split evenly and in order across TP ranks: rank ``r`` of ``size`` holds
global heads ``[r * H / size, (r + 1) * H / size)``. Prefill and decode may use different
TP sizes; each (prefill rank, decode rank) pair whose head ranges overlap forms one
transfer leg that carries exactly the overlap.

    prefill TP2 -> decode TP1   p0 heads [0,4) -> d0 [0,4);  p1 [4,8) -> d0 [4,8)
    prefill TP1 -> decode TP2   p0 [0,4) -> d0,  p0 [4,8) -> d1
    prefill TP2 -> decode TP4   p0 [0,2) -> d0, [2,4) -> d1;  p1 [4,6) -> d2, [6,8) -> d3

Replicated heads (TP size larger than the head count) are not supported: the handshake
rejects them.
"""

from __future__ import annotations


def rank_heads(total_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """Global head range ``[start, end)`` held by one rank.

    Raises:
        ValueError: heads do not split evenly, or the rank is out of range.
    """
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} must be in [0, tp_size={tp_size})")
    if total_heads % tp_size:
        raise ValueError(f"total_kv_heads={total_heads} does not split evenly over "
                         f"tp_size={tp_size}")
    per_rank = total_heads // tp_size
    return tp_rank * per_rank, (tp_rank + 1) * per_rank


def overlap(total_heads: int, a_size: int, a_rank: int, b_size: int,
            b_rank: int) -> tuple[int, int] | None:
    """Global heads that rank ``a_rank`` of group A and ``b_rank`` of group B share, if any."""
    a0, a1 = rank_heads(total_heads, a_size, a_rank)
    b0, b1 = rank_heads(total_heads, b_size, b_rank)
    start, end = max(a0, b0), min(a1, b1)
    return (start, end) if start < end else None


def peer_ranks(total_heads: int, my_size: int, my_rank: int, peer_size: int) -> list[int]:
    """Ranks of the peer group whose heads overlap this rank's, in rank order."""
    return [r for r in range(peer_size)
            if overlap(total_heads, my_size, my_rank, peer_size, r) is not None]


def local_slice(heads: tuple[int, int], total_heads: int, tp_size: int,
                tp_rank: int) -> slice:
    """Where the global head range ``heads`` lies in this rank's own head axis."""
    start, _ = rank_heads(total_heads, tp_size, tp_rank)
    return slice(heads[0] - start, heads[1] - start)
