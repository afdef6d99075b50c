"""Reference distributions and a chi-square check for the sampling tests."""

from __future__ import annotations

import math

import numpy as np
import torch

from common.request import SamplingParams


def reference_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """What one row draws from, written out with a full sort (float64): temperature,
    then min_p, top_k (ties kept), top_p (the nucleus, ties at its edge kept)."""
    x = np.asarray(logits, np.float64) / p.temperature
    w = np.exp(x - x.max())
    keep = w >= p.min_p * w.max()
    order = np.argsort(-x, kind="stable")
    if 0 < p.top_k < len(x):
        keep &= x >= x[order[p.top_k - 1]]
    if p.top_p < 1:
        kept = np.where(keep, w, 0.0)
        ranked = kept[order]
        before = np.cumsum(ranked) - ranked
        inside = order[(before < p.top_p * kept.sum()) & (ranked > 0)]
        keep &= x >= x[inside].min()
    w = np.where(keep, w, 0.0)
    return w / w.sum()


def chi_square_ok(counts: np.ndarray, probs: np.ndarray, alpha_z: float = 3.72) -> tuple:
    """(passes, statistic, critical value): counts against ``probs`` at about
    alpha = 1e-4 (``alpha_z``: the normal quantile), cells with expected count < 5 pooled;
    a draw outside the support fails at once."""
    n = counts.sum()
    if counts[probs == 0].sum():
        return False, math.inf, 0.0
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = max(len(obs) - 1, 1)
    # Wilson-Hilferty: the chi-square quantile from the normal one
    crit = dof * (1 - 2 / (9 * dof) + alpha_z * math.sqrt(2 / (9 * dof))) ** 3
    return stat <= crit, stat, crit


def logits_of(probs: list[float], dtype=torch.float64) -> torch.Tensor:
    return torch.log(torch.tensor(probs, dtype=dtype))
