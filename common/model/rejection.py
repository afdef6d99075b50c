"""Verifying speculative proposals on the device, greedy or sampled, without reading back.

Every position of a verification gets the target's own draw there: the token a plain
step would choose at that output index (``common.model.sampling.choose``, with the
sequence's uniform for that step, after its penalties, which count the earlier proposals
as generated). A proposal ``d_j`` is accepted while it equals the target's draw at
position j; the token after the accepted run is the target's draw at its position. Greedy
rows draw their most likely token, so for them this is plain greedy acceptance.

Every emitted token is therefore exactly the token plain decoding emits at its output
index: its distribution is the target's, and a seeded request's tokens are a function of
its seed and its tokens so far only. Leviathan et al.'s rejection sampling (accept ``d_j``
with probability ``min(1, p/q)``, at a rejection draw from the residual ``max(0, p - q)``,
after a full accept a bonus token from ``p``) keeps the distribution too, but which
token it emits at an output index depends on where that index fell in a step (a tested
proposal, a residual draw, a bonus draw), so a seeded request would yield other tokens
when its steps are cut elsewhere: a neighbour taking the pages of its lookahead, or a
move to another decode, whose first token a prefill draws plainly (``Req.prior``).

A draft proposes its own draw with the same uniform the target's draw at that position
uses (``decode_node.speculative``): inverse transforms of one number over the vocabulary
in one order, so a draft close to the target proposes the target's token often. An n-gram
proposal is accepted when the target draws it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Proposals:
    """A step's draft tokens on the device, padded to ``k`` per sequence."""

    tokens: torch.Tensor
    """[B, k] int64; entries past a sequence's count are padding."""
    count: torch.Tensor
    """[B] int64: proposals per sequence (k_s <= k)."""


def verify(chosen: torch.Tensor, props: Proposals) -> torch.Tensor:
    """[B, k + 3] int64 per sequence: the number accepted ``a``, the k + 1 token slots
    (the accepted proposals, then the target's draw at position ``a``), and 1 where a draw
    up to its count must be done again exactly (``choose``'s flag: CPU only).

    Args:
        chosen: [2, B * (k + 1)] as ``choose`` returns it: column ``b * (k + 1) + j`` is
            the target's draw at position j of sequence b, and its flag.
    """
    num_b, k = props.tokens.shape
    draws = chosen[0].view(num_b, k + 1)
    in_range = torch.arange(k, device=draws.device) < props.count[:, None]
    accepted = ((props.tokens == draws[:, :k]) & in_range).long().cumprod(-1).sum(-1)
    padded = torch.cat([props.tokens, props.tokens.new_zeros(num_b, 1)], 1)  # [B, k + 1]
    out = padded.scatter(1, accepted[:, None], draws.gather(1, accepted[:, None]))
    flags = (chosen[1].view(num_b, k + 1).bool()
             & (torch.arange(k + 1, device=draws.device) <= props.count[:, None])).any(-1)
    return torch.cat([accepted[:, None], out, flags.long()[:, None]], 1)


def verify_on_host(tokens: np.ndarray, count: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """``verify`` of host arrays whose draws are final (after ``exact_rows``): tokens
    [n, k], count [n], draws [n, k + 1]; returns [n, k + 3] with no flags."""
    n, k = tokens.shape
    same = (tokens == draws[:, :k]) & (np.arange(k) < count[:, None])
    accepted = np.cumprod(same, axis=1).sum(1) if k else np.zeros(n, np.int64)
    out = np.concatenate([tokens, np.zeros((n, 1), tokens.dtype)], 1)
    out[np.arange(n), accepted] = draws[np.arange(n), accepted]
    return np.concatenate([accepted[:, None], out, np.zeros((n, 1), out.dtype)], 1)
