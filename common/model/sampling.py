"""Choosing tokens on the device: one call per step for the whole batch.

Every row of a step's logits is a draw: a request at one output index (its ``step``).
What a row draws from (``Dist``) is, in order, as vLLM defines it:

1. the logits in float32 (float64 logits stay float64: the CPU proofs),
2. the penalties: ``repetition_penalty`` divides a positive logit and multiplies a
   negative one of every token in the prompt or the output so far;
   ``frequency_penalty`` is subtracted once per time a token was generated,
   ``presence_penalty`` once if it was (greedy requests get them too),
3. greedy (``temperature == 0``): the first most likely token, as ``argmax`` picks it;
   otherwise ``softmax(x / temperature)`` truncated to the tokens at least ``min_p``
   times as likely as the most likely one, then to the ``top_k`` most likely (ties
   kept), then to the nucleus: the most likely tokens until their mass reaches ``top_p``
   of what is left (ties at its edge kept).

A draw takes one uniform number, a pure function of the request's seed (or, without one,
its label), its step and the draw's purpose (``DRAW``, or ``REDRAW`` for a draw done
again), computed on the host and uploaded with the step's plan; the token
is the inverse of the kept mass's cumulative sum (float64) at that number. A request's
tokens therefore depend on its seed and steps only, never on its batch neighbours, and
no draw uses a device random generator (CUDA graphs can replay a step).

Truncation: ``top_k`` reads each row's ``top_k`` most likely tokens (``torch.topk``).
``top_p`` on CUDA sorts the vocabulary (cheap there). On CPU, where a sort of 64 x 49k
logits costs about 20 passes over them, a plain draw goes by rejection (``choose``): a
token drawn before top-p is kept when it is inside the nucleus, else the row is marked
and ``exact_rows`` draws it again from the nucleus with a fresh number, the only case
where a step reads the device twice, on CPU only. Where the nucleus itself is needed (a
redraw, a speculative verification's probabilities) its edge comes from a histogram of
the row's mass over log-probability bins and a sort of the one bin the edge falls in
(``_nucleus_edge``); a bin too full to sort marks the row for a sort. Every way finds the
same nucleus, and every sampled row draws over its whole vocabulary in vocabulary order.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from common.model.plan import DevicePlan, HostPlan, Slot, download
from common.request import Request, SamplingParams

DRAW, REDRAW = 0, 3
"""Purposes of a uniform: a token drawn for the output (a speculative draft's proposal
for a position uses the same number as the target's draw there), an output token drawn
again (``exact_rows``)."""
HISTOGRAM = -1
"""``candidates`` value for the CPU's top-p: a mass histogram, not sorted candidates."""
CPU_CANDIDATES = HISTOGRAM
"""How truncation reads each row on CPU (``HISTOGRAM``, or a number of sorted
candidates); on CUDA it sorts the whole vocabulary."""
HIST_BINS, HIST_RANGE = 8192, 48.0
"""The histogram's bins: the row's log-probabilities below its most likely token, down to
its least likely or ``HIST_RANGE`` (the last bin takes everything past it)."""
EDGE_TOKENS = 256
"""Tokens of the bin the nucleus ends in that are sorted (more: the row is redrawn)."""

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def seed_key(params: SamplingParams, label: str) -> int:
    """What a request's draws derive from: its seed, else its label."""
    base = zlib.crc32(label.encode()) * 131 if params.seed is None else params.seed * 1_000_003
    return base % (1 << 64)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping arithmetic)."""
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def uniforms(keys: Sequence[int], steps: Sequence[int], purpose: int) -> np.ndarray:
    """One number in [0, 1) per (key, step) for ``purpose`` (float64, 53 random bits)."""
    k = np.asarray(keys, dtype=np.uint64)
    s = np.asarray(steps, dtype=np.uint64) * np.uint64(8) + np.uint64(purpose)
    with np.errstate(over="ignore"):
        z = _mix(_mix(k) ^ s)
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def candidates_for(device: torch.device) -> int:
    """How many tokens truncation reads per row on ``device`` (0: the whole vocabulary)."""
    return 0 if device.type == "cuda" else CPU_CANDIDATES


# -- the host side: a step's draws, planned ------------------------------------------------
@dataclass
class SamplingPlan:
    """The draws of one step as planned on the host: what they need, and their slots."""

    num_rows: int
    num_seqs: int
    greedy_only: bool
    sampled_only: bool
    penalties: bool
    min_p: bool
    top_p: bool
    max_top_k: int
    """Largest ``top_k`` of a sampled row (0: none)."""
    slots: dict[str, Slot] = field(default_factory=dict)


def plan_sampling(host: HostPlan, params: Sequence[SamplingParams], keys: Sequence[int],
                  steps: Sequence[int], *, vocab_size: int,
                  purposes: Sequence[int] = (DRAW, REDRAW),
                  seq_of: Sequence[int] | None = None,
                  history: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None
                  ) -> SamplingPlan:
    """Adds the parameters of ``len(params)`` draws to ``host``.

    Args:
        keys, steps: each draw's ``seed_key`` and output index (its uniforms' inputs).
        purposes: the uniforms each draw gets, one array per purpose (``u<purpose>``).
        seq_of: the sequence (index into ``history``) of each draw; default: draw i is
            sequence i.
        history: per sequence, its prompt and output so far (what the penalties count);
            None when no draw has penalties.
    """
    n = len(params)
    seq_of = np.arange(n) if seq_of is None else np.asarray(seq_of, np.int64)
    greedy = np.array([p.is_greedy for p in params], dtype=bool)
    sampled = [p for p in params if not p.is_greedy]
    top_k = np.array([p.top_k if 0 < p.top_k < vocab_size and not p.is_greedy else 0
                      for p in params], np.int64)
    sp = SamplingPlan(n, len(history) if history is not None else n, bool(greedy.all()),
                      not greedy.any(), any(p.has_penalties for p in params),
                      any(p.min_p > 0 for p in sampled), any(p.top_p < 1 for p in sampled),
                      int(top_k.max(initial=0)))
    inv_t = [1.0 if p.is_greedy else 1.0 / p.temperature for p in params]
    minp_off = [p.temperature * math.log(p.min_p) if p.min_p > 0 and not p.is_greedy
                else -math.inf for p in params]
    rows = np.array([greedy, inv_t, minp_off, [p.top_p for p in params],
                     [p.presence_penalty for p in params], [p.frequency_penalty for p in params],
                     [p.repetition_penalty for p in params]], np.float64)
    sp.slots["rows"] = host.add(rows)  # [7, n]
    sp.slots["top_k"] = host.add(top_k)
    sp.slots["seq_of"] = host.add(seq_of)
    for purpose in purposes:
        sp.slots[f"u{purpose}"] = host.add(uniforms(keys, steps, purpose))
    if sp.penalties:
        _plan_history(host, sp, params, seq_of, history, vocab_size)
    return sp


def plan_draws(host: HostPlan, reqs: Sequence[Request], vocab_size: int, *,
               rows: Sequence[tuple[int, int]] | None = None,
               purposes: Sequence[int] = (DRAW, REDRAW)) -> SamplingPlan:
    """``plan_sampling`` for requests: draw ``(i, j)`` is request i's step
    ``sample_step + j`` (default: one draw per request at j = 0). A migrated request's
    prompt ends with the outputs an earlier worker generated (``num_prior``): its steps
    count on from them, and its penalties count them as outputs."""
    rows = [(i, 0) for i in range(len(reqs))] if rows is None else rows
    seq_of = [i for i, _ in rows]
    params = [reqs[i].params for i in seq_of]
    keys = [seed_key(r.params, r.label) for r in reqs]
    history = [(r.prompt, [*r.prompt[len(r.prompt) - r.num_prior:], *r.output])
               for r in reqs] if any(r.params.has_penalties for r in reqs) else None
    return plan_sampling(host, params, [keys[i] for i in seq_of],
                         [reqs[i].sample_step + j for i, j in rows], vocab_size=vocab_size,
                         purposes=purposes, seq_of=seq_of, history=history)


def _plan_history(host: HostPlan, sp: SamplingPlan, params: Sequence[SamplingParams],
                  seq_of: np.ndarray, history, vocab_size: int) -> None:
    """Flat indices ``seq * vocab + token`` of the outputs (counted) and prompts (seen) of
    the sequences with penalties."""
    if history is None:
        raise ValueError("draws with penalties need their sequences' history")
    penalized = sorted({int(seq_of[i]) for i, p in enumerate(params) if p.has_penalties})
    outs = [np.asarray(history[s][1], np.int64) + s * vocab_size for s in penalized]
    prompts = [np.asarray(history[s][0], np.int64) + s * vocab_size for s in penalized
               if any(params[i].repetition_penalty != 1.0
                      for i in np.flatnonzero(seq_of == s))]
    sp.slots["counted"] = host.add(np.concatenate(outs or [np.zeros(0, np.int64)]))
    sp.slots["seen"] = host.add(np.concatenate(prompts or [np.zeros(0, np.int64)]))


# -- the device side ---------------------------------------------------------------------
class SamplingArgs:
    """A plan's per-draw tensors on the device (``take`` keeps some draws)."""

    def __init__(self, sp: SamplingPlan, t: dict[str, torch.Tensor]) -> None:
        self.sp, self.t = sp, t

    @classmethod
    def bind(cls, sp: SamplingPlan, dev: DevicePlan) -> SamplingArgs:
        return cls(sp, {name: dev[slot] for name, slot in sp.slots.items()})

    def take(self, rows: torch.Tensor) -> SamplingArgs:
        """These draws only (a device index); the sequences' histories stay whole."""
        t = dict(self.t)
        t["rows"] = t["rows"][:, rows]
        for name in ("top_k", "seq_of", *[k for k in t if k.startswith("u")]):
            t[name] = t[name][rows]
        return SamplingArgs(self.sp, t)

    def row(self, i: int, dtype: torch.dtype) -> torch.Tensor:
        return self.t["rows"][i].to(dtype)

    @property
    def greedy(self) -> torch.Tensor:
        return self.t["rows"][0] != 0

    def u(self, purpose: int) -> torch.Tensor:
        return self.t[f"u{purpose}"]


class Dist:
    """What each row draws from (see the module doc); greedy rows are point masses.

    ``thr`` is in logit space: a sampled row keeps the tokens with ``x >= thr`` and
    weighs them by ``exp((x - shift) * inv_t)``; ``mass`` is their sum. Every sampled row
    draws over its whole vocabulary in vocabulary order, however its threshold was found,
    so a request's tokens do not depend on the device or the truncation's method.
    """

    def __init__(self, x: torch.Tensor, top: torch.Tensor, shift: torch.Tensor,
                 args: SamplingArgs, thr: torch.Tensor | None = None,
                 uncovered: torch.Tensor | None = None,
                 full: torch.Tensor | None = None) -> None:
        self.x, self.top, self.shift, self.args = x, top, shift, args
        self.thr, self.uncovered = thr, uncovered
        self._full = full
        self._mass: torch.Tensor | None = None

    @property
    def greedy(self) -> torch.Tensor:
        return self.args.greedy

    def _weights(self, x: torch.Tensor, rows: torch.Tensor | slice = slice(None)
                 ) -> torch.Tensor:
        """Kept weights of ``x`` (the rows ``rows`` of this Dist), float32 or float64."""
        inv_t = self.args.row(1, x.dtype)[rows][:, None]
        w = torch.addcmul(-self.shift[rows][:, None] * inv_t, x, inv_t).exp_()
        if self.thr is not None:
            w.masked_fill_(x < self.thr[rows][:, None], 0.0)
        return w

    def weights(self) -> torch.Tensor:
        """[N, V] kept weights of every row (computed once)."""
        if self._full is None:
            self._full = self._weights(self.x)
        return self._full

    @property
    def mass(self) -> torch.Tensor:
        """[N] float64: each sampled row's kept weight."""
        if self._mass is None:
            self._mass = self.weights().sum(-1).double()
        return self._mass

    def prob(self, tokens: torch.Tensor) -> torch.Tensor:
        """[N] float64: each row's probability of ``tokens`` ([N])."""
        hit = (tokens == self.top).double()
        if self.args.sp.greedy_only:
            return hit
        xt = self.x.gather(1, tokens[:, None])  # [N, 1]
        p = self._weights(xt)[:, 0].double() / self.mass
        return torch.where(self.greedy, hit, p)

    def dense(self, rows: torch.Tensor) -> torch.Tensor:
        """[len(rows), V] float64 probabilities of those rows (one-hot for greedy ones)."""
        one_hot = torch.zeros(len(rows), self.x.shape[1], dtype=torch.float64,
                              device=self.x.device)
        one_hot.scatter_(1, self.top[rows][:, None], 1.0)
        if self.args.sp.greedy_only:
            return one_hot
        w = self._weights(self.x[rows], rows).double()
        return torch.where(self.greedy[rows][:, None], one_hot, w / w.sum(-1, keepdim=True))

    def draw(self, u: torch.Tensor) -> torch.Tensor:
        """[N] token ids: greedy rows their ``top``, sampled ones the inverse cumulative
        kept mass at ``u``."""
        if self.args.sp.greedy_only:
            return self.top
        return torch.where(self.greedy, self.top, draw_weighted(self.weights(), u))


def draw_weighted(weights: torch.Tensor, u: torch.Tensor, blocks: bool = True,
                  total: bool = False):
    """[N] indices: row i's token where its cumulative weight passes ``u[i]`` of its total
    (a zero weight is never chosen); with ``total``, also the totals ([N] float64).

    Sums run in float64. Over a whole vocabulary the row is cut into blocks: block sums,
    a cumulative sum over blocks, then one over the chosen block (a float64 cumulative sum
    of the whole row costs several times a pass over it).
    """
    n, width = weights.shape
    block = next((b for b in (256, 128, 64) if width % b == 0 and width >= 16 * b), 0)
    if not blocks or not block:
        cum = weights.cumsum(-1, dtype=torch.float64)  # [N, width]
        target = (u.double() * cum[:, -1])[:, None]
        at = torch.searchsorted(cum, target, right=True)[:, 0].clamp_(max=width - 1)
        return (at, cum[:, -1]) if total else at
    parts = weights.view(n, width // block, block)
    cum = parts.sum(-1).double().cumsum(-1)  # [N, blocks]
    target = u.double() * cum[:, -1]
    b = torch.searchsorted(cum, target[:, None], right=True)[:, 0].clamp_(
        max=width // block - 1)
    before = torch.where(b > 0, cum.gather(1, (b - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    inner = parts.gather(1, b[:, None, None].expand(n, 1, block))[:, 0]  # [N, block]
    j = torch.searchsorted(inner.cumsum(-1, dtype=torch.float64),
                           (target - before)[:, None], right=True)[:, 0]
    # rounding between the block's sum and its own cumulative sum may point past its last
    # kept token: never past it
    last = block - 1 - (inner.flip(-1) > 0).to(torch.int32).argmax(-1)
    at = b * block + torch.minimum(j, last)
    return (at, cum[:, -1]) if total else at


def process(logits: torch.Tensor, args: SamplingArgs, *, candidates: int,
            extra: tuple[torch.Tensor, torch.Tensor] | None = None,
            nucleus: bool = True) -> Dist:
    """The distributions of a step's draws (one call for every row of ``logits``).

    Args:
        logits: [N, V], one row per draw.
        candidates: how top-k/top-p read a row: 0, the whole vocabulary sorted;
            ``HISTOGRAM``; n > 0, its n most likely tokens.
        extra: (ids [N, E], weights [N, E]) tokens to count as generated on top of the
            plan's history (a speculative position's earlier proposals).
        nucleus: False: leave top_p out (``choose``'s rejection draw applies it).
    """
    sp = args.sp
    x = logits if logits.dtype == torch.float64 else logits.float()
    if sp.penalties:
        x = _penalise(x, args, extra)
    shift, top = x.max(-1)  # the first maximum, as argmax picks it
    if sp.greedy_only:
        return Dist(x, top, shift, args)
    thr = shift + args.row(2, x.dtype) if sp.min_p else None  # x - shift >= T * log(min_p)
    if not sp.top_p and not sp.max_top_k:
        return Dist(x, top, shift, args, thr)
    if candidates == HISTOGRAM:
        return _truncate_by_histogram(x, top, shift, args, thr, nucleus)
    return _truncate(x, top, shift, args, thr, candidates)


def _penalise(x: torch.Tensor, args: SamplingArgs,
              extra: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """vLLM's penalties (module doc, step 2)."""
    sp, t, v = args.sp, args.t, x.shape[1]
    counts = torch.zeros(sp.num_seqs * v, dtype=x.dtype, device=x.device)
    counts.scatter_add_(0, t["counted"], torch.ones_like(t["counted"], dtype=x.dtype))
    seen = torch.zeros(sp.num_seqs * v, dtype=torch.bool, device=x.device)
    seen.scatter_(0, t["seen"], True)
    counts = counts.view(sp.num_seqs, v)[t["seq_of"]]  # [N, V]
    seen = seen.view(sp.num_seqs, v)[t["seq_of"]]
    if extra is not None:
        counts.scatter_add_(1, extra[0], extra[1].to(x.dtype))
    generated = counts > 0
    rep = args.row(6, x.dtype)[:, None]
    x = torch.where(seen | generated, torch.where(x > 0, x / rep, x * rep), x)
    return x - args.row(5, x.dtype)[:, None] * counts - args.row(4, x.dtype)[:, None] * generated


def _truncate(x: torch.Tensor, top: torch.Tensor, shift: torch.Tensor, args: SamplingArgs,
              thr: torch.Tensor | None, candidates: int) -> Dist:
    """top_k and top_p among each row's sorted candidates: the whole vocabulary sorted
    (``candidates`` 0, CUDA) or its ``candidates`` most likely tokens (module doc, step 3)."""
    sp, vocab, dt = args.sp, x.shape[1], x.dtype
    width = vocab if not candidates else min(vocab, max(candidates, sp.max_top_k))
    vals = (x.sort(-1, descending=True) if width == vocab
            else x.topk(width, -1)).values  # [N, width], most likely first
    top_k = args.t["top_k"]
    kth = vals.gather(1, (top_k - 1).clamp(0, width - 1)[:, None])[:, 0]
    thr_a = torch.where(top_k > 0, kth, -math.inf)  # min_p, then top_k
    if thr is not None:
        thr_a = torch.maximum(thr_a, thr)
    inv_t = args.row(1, dt)[:, None]
    e = torch.addcmul(-shift[:, None] * inv_t, x, inv_t).exp_()
    e.masked_fill_(x < thr_a[:, None], 0.0)
    if not sp.top_p:
        return Dist(x, top, shift, args, thr_a, full=e)
    top_p = args.row(3, torch.float64)
    goal = top_p * e.sum(-1).double()  # top_p is a share of A's mass (min_p, top_k)
    pc = torch.addcmul(-shift[:, None] * inv_t, vals, inv_t).exp_()
    pc.masked_fill_(vals < thr_a[:, None], 0.0)
    cum = pc.cumsum(-1, dtype=torch.float64)
    # the nucleus: each token whose more likely tokens hold less than top_p of the mass
    inside = (cum - pc) < goal[:, None]
    last = (inside.sum(-1) - 1).clamp_(min=0)
    use = top_p < 1
    final = torch.where(use, torch.maximum(thr_a, vals.gather(1, last[:, None])[:, 0]), thr_a)
    uncovered = None
    if width < vocab:
        # the nucleus (or its ties) may pass the candidates: keep the candidates (a true
        # distribution a speculative draft may propose from) and mark the row for an
        # exact draw
        uncovered = use & ~args.greedy & (final <= vals[:, -1])
        final = torch.where(uncovered, vals[:, -1], final)
    e.masked_fill_(x < final[:, None], 0.0)
    return Dist(x, top, shift, args, final, uncovered, full=e)


def _truncate_by_histogram(x: torch.Tensor, top: torch.Tensor, shift: torch.Tensor,
                           args: SamplingArgs, thr: torch.Tensor | None,
                           nucleus: bool = True) -> Dist:
    """top_k among each row's ``max_top_k`` most likely tokens, top_p by ``_nucleus_edge``:
    no sort of the vocabulary, whatever the nucleus's size (the CPU's path)."""
    sp, dt = args.sp, x.dtype
    thr_a = torch.full_like(shift, -math.inf) if thr is None else thr
    top_k = args.t["top_k"]
    if sp.max_top_k:
        vals = x.topk(min(sp.max_top_k, x.shape[1]), -1).values
        kth = vals.gather(1, (top_k - 1).clamp(0, vals.shape[1] - 1)[:, None])[:, 0]
        thr_a = torch.maximum(thr_a, torch.where(top_k > 0, kth, -math.inf))
    inv_t = args.row(1, dt)[:, None]
    e = torch.addcmul(-shift[:, None] * inv_t, x, inv_t).exp_()
    if thr is not None or sp.max_top_k:
        e.masked_fill_(x < thr_a[:, None], 0.0)
    final, uncovered = thr_a, None
    if sp.top_p and nucleus:
        top_p = args.row(3, torch.float64)
        goal = top_p * e.sum(-1).double()
        edge, overflow = _nucleus_edge(x, e, shift, inv_t, thr_a, goal)
        use = top_p < 1
        final = torch.where(use, torch.maximum(thr_a, edge), thr_a)
        uncovered = use & overflow & ~args.greedy
        e.masked_fill_(x < final[:, None], 0.0)
    return Dist(x, top, shift, args, final, uncovered, full=e)


def _nucleus_edge(x: torch.Tensor, e: torch.Tensor, shift: torch.Tensor, inv_t: torch.Tensor,
                  thr_a: torch.Tensor, goal: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top-p threshold (a logit) without sorting its vocabulary.

    The kept weights ``e`` go into ``HIST_BINS`` bins of log-probability below the row's
    most likely token (one ``index_add_``); the bin where the cumulative mass reaches
    ``goal`` is the only one whose tokens may fall either side of the nucleus's edge, so
    only its tokens are sorted (``topk`` of ``EDGE_TOKENS``). Returns the threshold and
    whether that bin held more tokens than were sorted (the row must be drawn again)."""
    n = x.shape[0]
    # bins over the row's own range of log-probability (up to HIST_RANGE): a flat row
    # gets bins as fine as a peaked one's in tokens per bin
    spread = ((shift - x.amin(-1))[:, None] * inv_t).clamp_(min=1e-6, max=HIST_RANGE)
    scale = inv_t * (HIST_BINS * (1 - 1e-6)) / spread  # [N, 1]
    pos = torch.addcmul(shift[:, None] * scale, x, scale, value=-1.0)  # >= 0, bins from 0
    rows = torch.arange(n, device=x.device)[:, None] * HIST_BINS
    index = pos.clamp_(0, HIST_BINS - 1).long().add_(rows)  # [N, V]: row * bins + bin
    mass = torch.zeros(n * HIST_BINS, dtype=e.dtype, device=x.device)
    mass.index_add_(0, index.view(-1), e.view(-1))
    cum = mass.view(n, HIST_BINS).double().cumsum(-1)
    edge_bin = torch.searchsorted(cum, goal[:, None])[:, 0].clamp_(max=HIST_BINS - 1)
    before = torch.where(edge_bin > 0, cum.gather(1, (edge_bin - 1).clamp(min=0)[:, None])[:, 0],
                         0.0)
    in_edge = index == (edge_bin + torch.arange(n, device=x.device) * HIST_BINS)[:, None]
    vals = torch.where(in_edge & (x >= thr_a[:, None]), x, -math.inf).topk(
        min(EDGE_TOKENS, x.shape[1]), -1).values  # [N, EDGE_TOKENS], most likely first
    pc = torch.addcmul(-shift[:, None] * inv_t, vals, inv_t).exp_()  # -inf: 0
    held = before[:, None] + pc.cumsum(-1, dtype=torch.float64)
    inside = (held - pc) < goal[:, None]
    last = (inside.sum(-1) - 1).clamp_(min=0)
    return vals.gather(1, last[:, None])[:, 0], vals[:, -1] > -math.inf


# -- a step's draws, start to end -----------------------------------------------------------
def choose(logits: torch.Tensor, args: SamplingArgs, candidates: int, purpose: int = DRAW,
           reject: bool = True, extra: tuple[torch.Tensor, torch.Tensor] | None = None
           ) -> torch.Tensor:
    """[2, N] int64: each draw's token and whether it must be drawn again (CPU only).
    ``extra``: as ``process`` takes it.

    On CPU (``HISTOGRAM``) top-p rows draw by rejection: a token drawn from the row's
    distribution before top-p is kept when it is inside the nucleus (the mass of the
    tokens more likely than it is below top_p of the whole: one pass), which holds with
    probability top_p or more; the others are marked and ``exact_rows`` draws them from
    the nucleus with a fresh number (``REDRAW``), so every token follows the nucleus's
    distribution exactly. That costs a handful of passes where finding the nucleus's
    edge costs a sort or a histogram of every row.
    """
    if reject and candidates == HISTOGRAM and args.sp.top_p:
        return _choose_by_rejection(logits, args, purpose, extra)
    d = process(logits, args, candidates=candidates, extra=extra)
    tokens = d.draw(args.u(purpose))
    flags = torch.zeros_like(tokens) if d.uncovered is None else d.uncovered.long()
    return torch.stack([tokens, flags])


def _choose_by_rejection(logits: torch.Tensor, args: SamplingArgs, purpose: int,
                         extra: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    d = process(logits, args, candidates=HISTOGRAM, extra=extra, nucleus=False)
    w = d.weights()
    drawn, mass = draw_weighted(w, args.u(purpose), total=True)
    tokens = torch.where(d.greedy, d.top, drawn)
    more = torch.where(d.x > d.x.gather(1, drawn[:, None]), w, 0.0).sum(-1).double()
    top_p = args.row(3, torch.float64)
    outside = (top_p < 1) & ~args.greedy & (more >= top_p * mass)
    return torch.stack([tokens, outside.long()])


def exact_rows(logits: torch.Tensor, args: SamplingArgs, out: np.ndarray,
               extra: tuple[torch.Tensor, torch.Tensor] | None = None) -> np.ndarray:
    """``out`` ([2, N], as ``choose`` returned it, downloaded) with the marked draws drawn
    again, exactly, with fresh numbers: the nucleus's edge by the histogram, by a sort
    where its edge bin was too full. Reads the device again; only on CPU. ``extra``: as
    ``choose`` took it."""
    tokens = out[0].copy()
    rows = np.flatnonzero(out[1])
    for candidates in (HISTOGRAM, 0):
        if not len(rows):
            break
        index = torch.from_numpy(rows).to(logits.device)
        part = None if extra is None else (extra[0][index], extra[1][index])
        again = download(choose(logits[index], args.take(index), candidates, REDRAW,
                                reject=False, extra=part))
        tokens[rows] = again[0]
        rows = rows[np.flatnonzero(again[1])]
    return tokens


def draw(logits: torch.Tensor, draws: SamplingPlan, dev: DevicePlan) -> np.ndarray:
    """A plain step's tokens, one per row of ``logits``: its ``draws`` (``plan_draws``,
    uploaded in ``dev``) chosen on the device, copied down once, and drawn again exactly
    where the CPU's nucleus could not decide (``exact_rows``)."""
    args = SamplingArgs.bind(draws, dev)
    return exact_rows(logits, args, download(choose(logits, args,
                                                    candidates_for(logits.device))))


def sample(logits: torch.Tensor, params: list[SamplingParams], labels: list[str],
           steps: list[int], history: Sequence[tuple[Sequence[int], Sequence[int]]] | None
           = None) -> list[int]:
    """One token per row of ``logits`` ([batch, vocab]) on the host: a step's plan,
    upload, ``choose`` and download in one call (for callers outside a step)."""
    host = HostPlan(logits.device)
    sp = plan_sampling(host, params, [seed_key(p, lb) for p, lb in zip(params, labels)],
                       steps, vocab_size=logits.shape[1], history=history)
    args = SamplingArgs.bind(sp, host.upload())
    with torch.inference_mode():
        out = download(choose(logits, args, candidates_for(logits.device)))
        return exact_rows(logits, args, out).tolist()
