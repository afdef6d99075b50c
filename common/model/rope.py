"""Rotary position embeddings: default, linear, dynamic (NTK) and llama3 frequencies.

Frequencies and angles are computed in float32, the way transformers (and vLLM) compute
them for every model dtype, then cast: a checkpoint sees the rotations it was trained
with, and at float64 pdkv's rotations equal transformers' bit for bit.

Dynamic NTK follows transformers' ``generate``: a forward pass of a sequence whose length
so far (``end``, the pass's last position + 1) passes the original context uses a base
stretched for that length; shorter ones use the original frequencies. pdkv decides per
request, so batching never changes a request's rotations (transformers uses the batch's
longest sequence). Chunked prefill and speculative verification past the original
context therefore rotate a few keys with a slightly different base than one-shot
prefill does (docs/models.md).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from common.model.config import ModelConfig


def inv_freq(cfg: ModelConfig, seq_len: int | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], float32; ``seq_len`` matters for dynamic only."""
    dim = cfg.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    base: float | torch.Tensor = cfg.rope_theta
    if cfg.rope_type == "dynamic" and seq_len is not None:
        orig, factor = cfg.rope_original_max_position, cfg.rope_factor
        n = torch.maximum(torch.tensor(seq_len), torch.tensor(orig))
        base = base * ((factor * n / orig) - (factor - 1)) ** (dim / (dim - 2))
    freq = 1.0 / (base ** exponents)
    if cfg.rope_type == "linear":
        freq = freq / cfg.rope_factor
    elif cfg.rope_type == "llama3":
        freq = _llama3(cfg, freq)
    return freq


def _llama3(cfg: ModelConfig, freq: torch.Tensor) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by factor, short kept, the middle smoothed."""
    factor, old = cfg.rope_factor, cfg.rope_original_max_position
    low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > old / low, freq / factor, freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) * ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)


class Rotary:
    """Precomputed cos/sin tables of positions [0, max_position) and rotation.

    Tables: ``cos``, ``sin`` of shape [max_position, head_dim / 2] in the model's dtype.
    """

    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        # Dynamic tables hold the original frequencies; longer sequences compute theirs.
        limit = cfg.rope_original_max_position if cfg.rope_type == "dynamic" else \
            cfg.max_position
        self.cos, self.sin = self._tables(torch.arange(limit), inv_freq(cfg))

    def _tables(self, positions: torch.Tensor, freq: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float()[:, None] * freq[None, :]  # float32, as transformers
        dt = self.cfg.torch_dtype
        return angles.cos().to(self.device, dt), angles.sin().to(self.device, dt)

    def tables(self, positions: torch.Tensor, ends: list[int] | None = None,
               lengths: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [num_tokens, 1, head_dim / 2] of ``positions`` (on the model's device).

        ``ends`` / ``lengths``: per request of the batch, its pass's end and how many of
        the tokens are its; only dynamic RoPE past the original context reads them (and
        then ``positions`` is read on the host: the runner plans those with
        ``stretched`` instead).
        """
        stretched = self.stretched(positions.cpu().numpy(), ends, lengths) \
            if self.is_stretched(ends) else None
        if stretched is None:
            return self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        cos, sin = (torch.from_numpy(t).to(self.device, self.cfg.torch_dtype)
                    for t in stretched)
        return cos[:, None, :], sin[:, None, :]

    def is_stretched(self, ends: list[int] | np.ndarray | None) -> bool:
        """Dynamic RoPE with a request past the original context (its own frequencies)."""
        cfg = self.cfg
        return cfg.rope_type == "dynamic" and ends is not None and len(ends) > 0 and \
            max(ends) > cfg.rope_original_max_position

    def stretched(self, positions: np.ndarray, ends, lengths) -> tuple[np.ndarray, np.ndarray]:
        """Host tables (float32) cos, sin [num_tokens, head_dim / 2] of a batch with
        dynamic RoPE: each request past the original context with its own base."""
        cfg, orig = self.cfg, self.cfg.rope_original_max_position
        base = inv_freq(cfg)
        cos, sin, first = [], [], 0
        for end, n in zip(ends, lengths if lengths is not None else [len(positions)]):
            pos = torch.from_numpy(np.asarray(positions[first:first + n], dtype=np.int64))
            first += n
            angles = pos.float()[:, None] * (base if end <= orig else inv_freq(cfg, end)
                                             )[None, :]
            cos.append(angles.cos().numpy())
            sin.append(angles.sin().numpy())
        return np.concatenate(cos), np.concatenate(sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's rotate-half rotation; x: [num_tokens, heads, head_dim]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
