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
its label), its step and the draw's purpose (``DRAW``, a speculative ``DRAFT`` proposal,
an ``ACCEPT`` test), computed on the host and uploaded with the step's plan; the token
is the inverse of the kept mass's cumulative sum (float64) at that number. A request's
tokens therefore depend on its seed and steps only, never on its batch neighbours or on
the device, and no draw uses a device random generator (CUDA graphs can replay a step).

Truncation without sorting the vocabulary: ``top_k`` and ``top_p`` read the row's
``candidates`` most likely tokens (``torch.topk``). On CUDA the candidates are the whole
vocabulary (a sort is cheap there). On CPU they are ``CPU_CANDIDATES``; a row whose
nucleus does not fit in them (a flat distribution) is marked ``uncovered``, and the
step draws it again exactly (``exact_rows``), the only case where a step reads the device
twice, and only on CPU.
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

DRAW, DRAFT, ACCEPT = 0, 1, 2
"""Purposes of a uniform: a token drawn for the output, a draft's proposal, the test of
a proposal (rejection sampling)."""
CPU_CANDIDATES = 1024
"""Tokens ``top_k``/``top_p`` read per row on CPU (the whole vocabulary on CUDA)."""

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
    s = np.asarray(steps, dtype=np.uint64) * np.uint64(4) + np.uint64(purpose)
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
    plain: bool = False
    """Some sampled row is truncated by neither top-k nor top-p (draws over the whole
    vocabulary)."""
    slots: dict[str, Slot] = field(default_factory=dict)


def plan_sampling(host: HostPlan, params: Sequence[SamplingParams], keys: Sequence[int],
                  steps: Sequence[int], *, vocab_size: int, purposes: Sequence[int] = (DRAW,),
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
                      int(top_k.max(initial=0)),
                      any(p.top_p == 1 and not 0 < p.top_k < vocab_size for p in sampled))
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
               purposes: Sequence[int] = (DRAW,)) -> SamplingPlan:
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
    weighs them by ``exp((x - shift) * inv_t)``; ``mass`` is their sum. A row truncated
    by top-k or top-p keeps only tokens among its sorted candidates (``cand``: their
    logits, ids and kept weights), and draws among them; any other sampled row draws over
    the whole vocabulary.
    """

    def __init__(self, x: torch.Tensor, top: torch.Tensor, shift: torch.Tensor,
                 args: SamplingArgs, thr: torch.Tensor | None = None,
                 uncovered: torch.Tensor | None = None, cand: _Candidates | None = None,
                 full_mass: torch.Tensor | None = None) -> None:
        self.x, self.top, self.shift, self.args = x, top, shift, args
        self.thr, self.uncovered, self.cand = thr, uncovered, cand
        self._full_mass = full_mass

    @property
    def greedy(self) -> torch.Tensor:
        return self.args.greedy

    @property
    def _plain(self) -> bool:
        """Some sampled row draws over the whole vocabulary."""
        return self.cand is None or self.args.sp.plain

    def _weights(self, x: torch.Tensor, rows: torch.Tensor | slice = slice(None)
                 ) -> torch.Tensor:
        """Kept weights of ``x`` (the rows ``rows`` of this Dist), float32 or float64."""
        inv_t = self.args.row(1, x.dtype)[rows][:, None]
        w = torch.addcmul(-self.shift[rows][:, None] * inv_t, x, inv_t).exp_()
        if self.thr is not None:
            w.masked_fill_(x < self.thr[rows][:, None], 0.0)
        return w

    @property
    def mass(self) -> torch.Tensor:
        """[N] float64: each sampled row's kept weight."""
        if self._full_mass is None and self._plain:
            self._full_mass = self._weights(self.x).sum(-1).double()
        if self.cand is None:
            return self._full_mass
        if not self.args.sp.plain:
            return self.cand.mass
        return torch.where(self.cand.rows, self.cand.mass, self._full_mass)

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
        tok = None
        if self._plain:
            tok = draw_weighted(self._weights(self.x), u)
        if self.cand is not None:
            c = self.cand
            at = draw_weighted(c.weights, u, blocks=False)
            drawn = c.ids.gather(1, at[:, None])[:, 0]
            tok = drawn if tok is None else torch.where(c.rows, drawn, tok)
        return torch.where(self.greedy, self.top, tok)


@dataclass
class _Candidates:
    """Each row's most likely tokens, sorted, and what of them a truncated row keeps."""

    ids: torch.Tensor
    """[N, width] token ids."""
    weights: torch.Tensor
    """[N, width] kept weights (0 past the row's threshold)."""
    rows: torch.Tensor
    """[N] bool: the row draws among its candidates (top-k or top-p truncated)."""

    @property
    def mass(self) -> torch.Tensor:
        return self.weights.sum(-1, dtype=torch.float64)


def draw_weighted(weights: torch.Tensor, u: torch.Tensor, blocks: bool = True) -> torch.Tensor:
    """[N] indices: row i's token where its cumulative weight passes ``u[i]`` of its total
    (a zero weight is never chosen).

    Sums run in float64. Over a whole vocabulary the row is cut into blocks: block sums,
    a cumulative sum over blocks, then one over the chosen block (a float64 cumulative sum
    of the whole row costs several times a pass over it).
    """
    n, width = weights.shape
    block = next((b for b in (256, 128, 64) if width % b == 0 and width >= 16 * b), 0)
    if not blocks or not block:
        cum = weights.cumsum(-1, dtype=torch.float64)  # [N, width]
        target = (u.double() * cum[:, -1])[:, None]
        return torch.searchsorted(cum, target, right=True)[:, 0].clamp_(max=width - 1)
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
    return b * block + torch.minimum(j, last)


def process(logits: torch.Tensor, args: SamplingArgs, *, candidates: int,
            extra: tuple[torch.Tensor, torch.Tensor] | None = None) -> Dist:
    """The distributions of a step's draws (one call for every row of ``logits``).

    Args:
        logits: [N, V], one row per draw.
        candidates: tokens top-k/top-p read per row (0 or >= V: the whole vocabulary).
        extra: (ids [N, E], weights [N, E]) tokens to count as generated on top of the
            plan's history (a speculative position's earlier proposals).
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
    """top_k and top_p among each row's sorted candidates (module doc, step 3)."""
    sp, vocab, dt = args.sp, x.shape[1], x.dtype
    width = vocab if not candidates else min(vocab, max(candidates, sp.max_top_k))
    vals, ids = (x.sort(-1, descending=True) if width == vocab
                 else x.topk(width, -1))  # [N, width], most likely first
    top_k = args.t["top_k"]
    kth = vals.gather(1, (top_k - 1).clamp(0, width - 1)[:, None])[:, 0]
    thr_a = torch.where(top_k > 0, kth, -math.inf)  # min_p, then top_k
    if thr is not None:
        thr_a = torch.maximum(thr_a, thr)
    inv_t = args.row(1, dt)[:, None]
    pc = torch.addcmul(-shift[:, None] * inv_t, vals, inv_t).exp_()
    pc.masked_fill_(vals < thr_a[:, None], 0.0)
    top_p = args.row(3, torch.float64)
    use_p = top_p < 1
    full_mass = None
    final = thr_a
    if sp.top_p:
        # the mass top_p is a share of: A's, over the whole vocabulary
        full_mass = _kept_mass(x, shift, inv_t, thr_a if (sp.min_p or sp.max_top_k) else None)
        cum = pc.cumsum(-1, dtype=torch.float64)
        goal = top_p * full_mass
        # the nucleus: each token whose more likely tokens hold less than top_p of the mass
        inside = (cum - pc) < goal[:, None]
        last = (inside.sum(-1) - 1).clamp_(min=0)
        nucleus = vals.gather(1, last[:, None])[:, 0]
        final = torch.where(use_p, torch.maximum(thr_a, nucleus), thr_a)
    truncated = use_p | (top_k > 0)
    pc.masked_fill_(vals < final[:, None], 0.0)
    uncovered = None
    if width < vocab:
        # a row whose kept tokens may pass its candidates (a nucleus past them, ties at
        # the edge): draws among the candidates here (a true distribution a draft may
        # propose from) and is marked for an exact draw
        uncovered = truncated & ~args.greedy & (final <= vals[:, -1])
        final = torch.where(uncovered, vals[:, -1], final)
    cand = _Candidates(ids, pc, truncated)
    # a plain row's kept mass is A's (min_p alone), already summed when top_p needed it
    return Dist(x, top, shift, args, final, uncovered, cand, full_mass)


def _kept_mass(x: torch.Tensor, shift: torch.Tensor, inv_t: torch.Tensor,
               thr: torch.Tensor | None) -> torch.Tensor:
    """[N] float64: sum over the vocabulary of the weights of tokens with x >= thr."""
    w = torch.addcmul(-shift[:, None] * inv_t, x, inv_t).exp_()
    if thr is not None:
        w.masked_fill_(x < thr[:, None], 0.0)
    return w.sum(-1).double()


# -- a step's draws, start to end -----------------------------------------------------------
def choose(logits: torch.Tensor, args: SamplingArgs, candidates: int) -> torch.Tensor:
    """[2, N] int64: each draw's token and whether it needs an exact redraw (CPU)."""
    d = process(logits, args, candidates=candidates)
    tokens = d.draw(args.u(DRAW))
    flags = torch.zeros_like(tokens) if d.uncovered is None else d.uncovered.long()
    return torch.stack([tokens, flags])


def exact_rows(logits: torch.Tensor, args: SamplingArgs, out: np.ndarray) -> np.ndarray:
    """``out`` ([2, N], as ``choose`` returned it, downloaded) with the marked draws drawn
    again over the whole vocabulary; a second read of the device, on CPU only."""
    rows = np.flatnonzero(out[1])
    if not len(rows):
        return out[0]
    index = torch.from_numpy(rows).to(logits.device)
    again = download(choose(logits[index], args.take(index), 0))
    tokens = out[0].copy()
    tokens[rows] = again[0]
    return tokens


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
