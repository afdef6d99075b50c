"""Verifying speculative proposals on the device, greedy or sampled, without reading back.

For a sequence with proposals ``d_0 .. d_{k_s - 1}`` (drawn from the draft's
distributions ``q_j``) and the target's distributions ``p_0 .. p_{k_s}`` at the same
positions (``common.model.sampling.Dist``, each after the sequence's penalties,
temperature and truncation, counting the earlier proposals as generated):

- greedy: ``d_j`` is accepted while it is the target's most likely token; the token after
  the accepted run is the target's most likely one. This is exactly plain greedy decoding.
- sampled (rejection sampling): ``d_j`` is accepted with probability
  ``min(1, p_j(d_j) / q_j(d_j))``; at the first rejection the token is drawn from the
  normalised residual ``max(0, p_j - q_j)``; when all are accepted, a bonus token is drawn
  from ``p_{k_s}``. Each emitted token is then distributed exactly as ``p`` at its
  position, whatever the draft (tests/test_rejection.py checks it with a chi-square test).

A proposer without distributions (n-gram lookup) proposes point masses: ``q_j`` is one
at ``d_j``, so ``d_j`` is accepted with probability ``p_j(d_j)`` and the residual is
``p_j`` without ``d_j``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.model.sampling import Dist, draw_weighted


@dataclass
class Proposals:
    """A step's draft tokens on the device, padded to ``k`` per sequence, with the
    distributions they were drawn from (``x``, ``thr``, ``shift``, ``inv_t``, ``mass``,
    as ``Dist`` has them; None for point masses)."""

    tokens: torch.Tensor
    """[B, k] int64; entries past a sequence's count are padding."""
    count: torch.Tensor
    """[B] int64: proposals per sequence (k_s <= k)."""
    prob: torch.Tensor
    """[B, k] float64: q_j(d_j), 1 for point masses and greedy drafts."""
    x: torch.Tensor | None = None
    """[B, k, V]: the draft's processed logits at each position."""
    thr: torch.Tensor | None = None
    """[B, k]: its thresholds; shift [B, k]; inv_t [B]; mass [B, k] float64."""
    shift: torch.Tensor | None = None
    inv_t: torch.Tensor | None = None
    mass: torch.Tensor | None = None

    def take(self, rows: torch.Tensor) -> Proposals:
        pick = [None if t is None else t[rows]
                for t in (self.x, self.thr, self.shift, self.inv_t, self.mass)]
        return Proposals(self.tokens[rows], self.count[rows], self.prob[rows], *pick)

    def dense(self, at: torch.Tensor, vocab: int) -> torch.Tensor:
        """[B, V] float64: each sequence's q at position ``at`` ([B], clamped to k - 1)."""
        b = torch.arange(len(at), device=at.device)
        j = at.clamp(max=self.tokens.shape[1] - 1)
        if self.x is None:
            q = torch.zeros(len(at), vocab, dtype=torch.float64, device=at.device)
            return q.scatter_(1, self.tokens[b, j][:, None], 1.0)
        x = self.x[b, j].double()  # [B, V]
        w = ((x - self.shift[b, j].double()[:, None]) * self.inv_t.double()[:, None]).exp_()
        w.masked_fill_(x < self.thr[b, j].double()[:, None], 0.0)
        return w / self.mass[b, j][:, None]


def verify(target: Dist, props: Proposals, u_accept: torch.Tensor, u_draw: torch.Tensor
           ) -> torch.Tensor:
    """[B, k + 3] int64 per sequence: the number accepted ``a``, the k + 1 token slots
    (the accepted proposals, then the token drawn at position ``a``), and 1 where the
    target's distribution was not exact (an uncovered nucleus: redo on CPU).

    Args:
        target: the target's distributions, row ``b * (k + 1) + j`` at position j.
        u_accept: [B, k] uniforms of the acceptance tests; u_draw: [B, k + 1] of the draws.
    """
    num_b, k = props.tokens.shape
    tokens, count = props.tokens, props.count
    top = target.top.view(num_b, k + 1)
    greedy = target.greedy.view(num_b, k + 1)[:, 0]
    padded = torch.cat([tokens, tokens.new_zeros(num_b, 1)], 1)  # [B, k + 1]
    in_range = torch.arange(k, device=tokens.device) < count[:, None]
    same = tokens == top[:, :k]
    if target.args.sp.greedy_only:
        ok = same
    else:
        p = target.prob(padded.view(-1)).view(num_b, k + 1)[:, :k]
        ok = torch.where(greedy[:, None], same, u_accept * props.prob < p)
    accepted = (ok & in_range).long().cumprod(-1).sum(-1)  # [B]
    at = torch.arange(num_b, device=tokens.device) * (k + 1) + accepted
    final = top.view(-1)[at]
    if not target.args.sp.greedy_only:
        final = torch.where(greedy, final, _residual_draw(target, props, at, accepted,
                                                          u_draw.gather(1, accepted[:, None])))
    out = padded.scatter(1, accepted[:, None], final[:, None])
    flags = torch.zeros_like(accepted) if target.uncovered is None else \
        (target.uncovered.view(num_b, k + 1)
         & (torch.arange(k + 1, device=tokens.device) <= count[:, None])).any(-1).long()
    return torch.cat([accepted[:, None], out, flags[:, None]], 1)


def _residual_draw(target: Dist, props: Proposals, at: torch.Tensor, accepted: torch.Tensor,
                   u: torch.Tensor) -> torch.Tensor:
    """At a rejection: a draw from max(0, p - q), normalised; after a full accept (or no
    proposals): from p."""
    p = target.dense(at)  # [B, V] float64
    rejected = accepted < props.count
    if props.tokens.shape[1]:
        q = props.dense(accepted, p.shape[1]) * rejected[:, None]
        r = (p - q).clamp_(min=0)
        # a rejection where p <= q everywhere is a rounding artefact: draw from p
        r = torch.where(r.sum(-1, keepdim=True) > 0, r, p)
    else:
        r = p
    return draw_weighted(r, u[:, 0])
