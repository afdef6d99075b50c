"""Digests of KV page runs: what a transfer and the host tier check end to end.

A digest covers the **canonical bytes** of a run of blocks: for each block in order, the
page restricted to a head range, laid out ``[total_layers, 2, page_size, heads,
head_dim]`` (exactly a data frame's layout, docs/protocol.md). The sender computes it over
its source pages, the receiver over what landed, and both free logs record it.

Two algorithms, one per kind of memory:

- ``xxh3_64`` (host memory): xxHash's XXH3, 64 bits. 16-27 GB/s from DRAM and 55 GB/s
  from cache on the 2-core box, 2.5-10 times memcpy's speed there; crc32c (SSE4.2) runs
  at a third of that, zlib's crc32 at 1 GB/s, and a cryptographic hash is not needed:
  this guards against corruption and bugs, not against a peer that forges bytes (the KV
  plane is authenticated, docs/security.md). Even so a pass from DRAM is a fifth to a
  half of a copy's time there (docs/benchmarks/2026-12-05.md).
- ``fold64`` (device memory): a multilinear sum over 32-bit words,
  ``sum_p M_p * sum_j w[p, j] * C_j`` modulo 2^64 with odd constants ``C_j`` (word ``j``
  of a block) and ``M_p`` (block ``p`` of the run), then mixed. It is one elementwise
  product and one reduction: on a GPU it runs as two kernels on the current stream and
  leaves a 0-dim tensor, so nothing waits until someone reads it. Any change of a single
  32-bit word changes it (an odd multiplier times a nonzero difference below 2^32 is never
  0 modulo 2^64); it is not meant to resist an adversary either. The same math runs on
  CPU (torch, or numpy in ``fold64_numpy``, the reference the tests compare with).

``negotiate`` picks one per leg from what each end offers (``preferred``): fold64 when both
pools live in device memory, xxh3 otherwise. fold64 on a CPU (0.1-0.2 GB/s on the 2-core
box) is for the tests only.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
import xxhash

from common.kv.page_copy import page_runs

XXH3 = "xxh3_64"
FOLD64 = "fold64"
ALGORITHMS = (XXH3, FOLD64)
_MASK = (1 << 64) - 1
_FOLD_PAGES = 16  # blocks per fold step: bounds the int64 temporary of a device reduction


class DigestMismatch(ValueError):
    """What landed is not what the source sent (or stored)."""


def preferred(device: torch.device | str) -> str:
    """The algorithm an end offers for a pool on ``device``."""
    return XXH3 if torch.device(device).type == "cpu" else FOLD64


def negotiate(mine: str, theirs: str) -> str:
    """The algorithm of a leg: "" (integrity off) when either end offers none, fold64 when
    both pools are on devices, else xxh3 (a device end of a mixed leg reads its run
    through host memory: a bus copy and xxh3 run at 10+ GB/s where fold64 on a CPU runs
    below 1 GB/s)."""
    if not mine or not theirs:
        return ""
    return FOLD64 if mine == theirs == FOLD64 else XXH3


def check_algorithm(algo: str) -> None:
    if algo and algo not in ALGORITHMS:
        raise ValueError(f"digest algorithm {algo!r}; allowed: {ALGORITHMS}")


# -- host bytes ----------------------------------------------------------------------------
def of_bytes(algo: str, blocks: np.ndarray) -> int:
    """Digest of host bytes ``[num_blocks, block_bytes]`` (a frame, or a staged run)."""
    if algo == XXH3:
        return xxhash.xxh3_64_intdigest(np.ascontiguousarray(blocks))
    return finish_fold(fold64_torch(torch.from_numpy(np.ascontiguousarray(blocks))))


class RunDigest:
    """Streaming digest of a run fed piece by piece in canonical order (xxh3 only; fold64
    is computed over a whole run by ``of_pages``). ``feed`` takes a contiguous piece with
    no checks (the copier's hook: ``common.kv.copy_pages_fed``)."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()
        self.feed = self._h.update

    def update(self, blocks: np.ndarray) -> None:
        self._h.update(np.ascontiguousarray(blocks))

    def value(self) -> int:
        return self._h.intdigest()


def of_pages(algo: str, pool: torch.Tensor, pages: np.ndarray, heads: slice | None = None):
    """Digest of blocks ``pages`` of a page-major pool, restricted to ``heads``.

    Returns:
        an int; for fold64 on a device pool a 0-dim int64 tensor still on the device
        (``finish_fold`` reads it, the one moment that waits for the reduction).
    """
    raw = pool.view(torch.uint8)  # [N, layers, 2, page_size, heads, head_dim * itemsize]
    if heads is not None and heads.stop - heads.start == raw.shape[4]:
        heads = None
    if algo == XXH3:
        return _xxh3_pages(raw, pages, heads)
    return fold64_torch(_gather(raw, pages, heads))


def _xxh3_pages(raw: torch.Tensor, pages: np.ndarray, heads: slice | None) -> int:
    host = raw if raw.device.type == "cpu" else None
    h = xxhash.xxh3_64()
    for first, _, length in _runs(pages):
        if host is None:   # a device pool offered xxh3: read the run through the host
            part = raw[first:first + length]
            part = part if heads is None else part[:, :, :, :, heads]
            h.update(np.ascontiguousarray(part.cpu().numpy()))
            continue
        part = host[first:first + length].numpy()
        h.update(part if heads is None else np.ascontiguousarray(part[:, :, :, :, heads]))
    return h.intdigest()


def _runs(pages: np.ndarray) -> list[tuple[int, int, int]]:
    return page_runs(np.asarray(pages, np.int64))


def _gather(raw: torch.Tensor, pages: np.ndarray, heads: slice | None) -> torch.Tensor:
    """``[num_blocks, block_bytes]`` uint8 of the canonical bytes (a view when it can)."""
    pages = np.asarray(pages, np.int64)
    runs = _runs(pages)
    if len(runs) == 1 and heads is None:
        first, _, n = runs[0]
        return raw[first:first + n].reshape(n, -1)
    idx = torch.as_tensor(pages, device=raw.device)
    sel = raw.index_select(0, idx)
    if heads is not None:
        sel = sel[:, :, :, :, heads]
    return sel.reshape(len(pages), -1)


# -- fold64 ----------------------------------------------------------------------------------
def _splitmix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


@lru_cache(maxsize=64)
def _word_consts(num_words: int) -> np.ndarray:
    """Odd multipliers ``C_j`` of the words of one block (uint64)."""
    return _splitmix(np.arange(num_words, dtype=np.uint64)) | np.uint64(1)


def _block_consts(num_blocks: int) -> np.ndarray:
    """Odd multipliers ``M_p`` of the blocks of a run (uint64)."""
    return _splitmix(np.arange(num_blocks, dtype=np.uint64) + np.uint64(1 << 40)) \
        | np.uint64(1)


@lru_cache(maxsize=16)
def _device_consts(num_words: int, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(_word_consts(num_words).view(np.int64)).to(device)


def fold64_torch(blocks: torch.Tensor) -> torch.Tensor:
    """The unmixed fold of ``[num_blocks, block_bytes]`` uint8 (``block_bytes`` a multiple
    of 4) as a 0-dim int64 tensor on the same device; int64 products and sums wrap
    modulo 2^64, which is the arithmetic the digest is defined in."""
    n, nbytes = blocks.shape
    if nbytes % 4:
        raise ValueError(f"fold64: a block of {nbytes} bytes is not whole 32-bit words")
    words = blocks.reshape(n, -1)
    if not words.is_contiguous():
        words = words.contiguous()
    words = words.view(torch.int32)  # [n, W]
    consts = _device_consts(words.shape[1], words.device)
    blocks_m = torch.from_numpy(_block_consts(n).view(np.int64)).to(words.device)
    acc = torch.zeros((), dtype=torch.int64, device=words.device)
    for i in range(0, n, _FOLD_PAGES):
        w = words[i:i + _FOLD_PAGES].to(torch.int64) & 0xFFFFFFFF  # the word, unsigned
        per_block = (w * consts).sum(dim=1)
        acc += (per_block * blocks_m[i:i + _FOLD_PAGES]).sum()
    return acc


def finish_fold(acc) -> int:
    """The fold64 digest: the fold read to the host (the one wait) and mixed."""
    value = int(acc.item() if isinstance(acc, torch.Tensor) else acc) & _MASK
    return int(_splitmix(np.array([value], np.uint64))[0])


def fold64_numpy(blocks: np.ndarray) -> int:
    """Reference fold64 of ``[num_blocks, block_bytes]`` uint8 in numpy (uint64 wraps by
    definition): what ``fold64_torch`` must equal on every device."""
    words = np.ascontiguousarray(blocks).reshape(len(blocks), -1).view("<u4").astype(np.uint64)
    with np.errstate(over="ignore"):
        per_block = (words * _word_consts(words.shape[1])).sum(axis=1, dtype=np.uint64)
        acc = (per_block * _block_consts(len(blocks))).sum(dtype=np.uint64)
    return finish_fold(int(acc))


def value(digest) -> int:
    """An int from ``of_pages``'s result (reads a device fold: waits for it)."""
    return finish_fold(digest) if isinstance(digest, torch.Tensor) else int(digest)
