"""The KV digests on their own: canonical bytes of a page run, xxh3 on host memory, and
fold64 - the device digest - tested on CPU against its numpy reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.kv import digest as d


def _pool(pages=20, heads=4, seed=0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    # [num_pages, layers, 2, page_size, heads, head_dim]
    return torch.from_numpy(rng.standard_normal((pages, 3, 2, 4, heads, 8)).astype(np.float32))


def _canonical(pool: torch.Tensor, pages, heads=slice(None)) -> np.ndarray:
    raw = pool.view(torch.uint8).numpy()
    return np.ascontiguousarray(raw[np.asarray(pages)][:, :, :, :, heads]).reshape(
        len(pages), -1)


@pytest.mark.parametrize("heads", [slice(0, 4), slice(1, 3), slice(3, 4)])
@pytest.mark.parametrize("pages", [[3, 4, 5], [9, 2, 7, 8], [1]])
def test_a_run_digest_is_the_digest_of_its_canonical_bytes(pages, heads):
    """Pages in block order, restricted to the heads, laid out as a data frame: the same
    value whether computed over the pool's pages or over a frame of them."""
    pool = _pool()
    frame = _canonical(pool, pages, heads)
    assert d.of_pages(d.XXH3, pool, np.array(pages), heads) == d.of_bytes(d.XXH3, frame)
    fold = d.value(d.of_pages(d.FOLD64, pool, np.array(pages), heads))
    assert fold == d.fold64_numpy(frame) == d.of_bytes(d.FOLD64, frame)


def test_fold64_on_torch_equals_the_numpy_reference_across_chunks():
    """More blocks than one reduction step (16) and values near the word's top bit: the
    int64 products and sums wrap exactly like the uint64 reference."""
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, size=(37, 4096), dtype=np.uint8)
    blocks[:, 3::4] = 0xFF   # every word's top byte set: the unsigned reading matters
    assert d.finish_fold(d.fold64_torch(torch.from_numpy(blocks))) == d.fold64_numpy(blocks)


def test_fold64_sees_every_single_word_change_and_block_order():
    rng = np.random.default_rng(2)
    blocks = rng.integers(0, 256, size=(5, 256), dtype=np.uint8)
    base = d.fold64_numpy(blocks)
    for at in range(0, blocks.size, 7):
        changed = blocks.copy()
        changed.reshape(-1)[at] ^= 1 << (at % 8)
        assert d.fold64_numpy(changed) != base, at
    swapped = blocks[[1, 0, 2, 3, 4]]
    assert d.fold64_numpy(swapped) != base            # blocks are weighted by position
    with pytest.raises(ValueError, match="32-bit words"):
        d.fold64_torch(torch.zeros((1, 6), dtype=torch.uint8))


def test_the_device_fold_is_a_tensor_until_it_is_read():
    """On any device the fold is left on the device (nothing waits); ``value`` reads it."""
    pool = _pool()
    fold = d.of_pages(d.FOLD64, pool, np.array([2, 3]))
    assert isinstance(fold, torch.Tensor) and fold.shape == () and fold.dtype == torch.int64
    assert d.value(fold) == d.fold64_numpy(_canonical(pool, [2, 3]))


@pytest.mark.parametrize("mine, theirs, algo", [
    ("xxh3_64", "xxh3_64", "xxh3_64"), ("fold64", "fold64", "fold64"),
    ("xxh3_64", "fold64", "xxh3_64"), ("fold64", "", ""), ("", "xxh3_64", "")])
def test_each_leg_negotiates_one_algorithm_or_none(mine, theirs, algo):
    assert d.negotiate(mine, theirs) == d.negotiate(theirs, mine) == algo
    assert d.preferred("cpu") == "xxh3_64" and d.preferred("cuda:0") == "fold64"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fold64_on_a_gpu_equals_the_cpu_value():
    pool = _pool()
    fold = d.of_pages(d.FOLD64, pool.cuda(), np.array([4, 5, 9]), slice(1, 3))
    assert fold.device.type == "cuda"
    assert d.value(fold) == d.fold64_numpy(_canonical(pool, [4, 5, 9], slice(1, 3)))
