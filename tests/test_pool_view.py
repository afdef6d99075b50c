"""The frame path's pool views: a CPU pool's frames are views of it; an accelerator pool's
frames are staged through host memory. The staged view runs here on CPU pools, so its
logic (shapes, head slices, gaps) is proven without a GPU; the CUDA stories, which run
where a GPU is, are in test_transport_procs.py (frames) and test_transport_nixl.py (VRAM).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.test_transport_unit import Pair, _connect_and_transfer
from transport.pool_view import HostPoolView, StagedPoolView, pool_view


def _pool(seed: int) -> torch.Tensor:
    # [num_pages, layers, 2, page_size, heads, head_dim]
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(12, 3, 2, 4, 4, 8, generator=gen, dtype=torch.float32)


@pytest.mark.parametrize("heads", [slice(0, 4), slice(1, 3), slice(3, 4)])
def test_a_staged_read_is_the_bytes_a_host_view_reads(heads):
    data = _pool(1)
    host, staged = HostPoolView(data), StagedPoolView(data)
    want = host.read(5, 3, heads)
    got = staged.read(5, 3, heads)
    assert got.shape == want.shape == (3, host.block_bytes(heads.stop - heads.start))
    assert np.array_equal(got, want)
    assert not np.shares_memory(got, host.flat)  # a copy the frame owns, not the pool


@pytest.mark.parametrize("heads", [slice(0, 4), slice(2, 4)])
def test_a_staged_write_lands_where_a_host_write_lands(heads):
    frame = bytearray(HostPoolView(_pool(2)).read(0, 4, heads).tobytes())  # as ZMQ gives
    dest = np.array([9, 2, 3, 7])  # a gap: three runs
    by_host, by_staged = torch.zeros(12, 3, 2, 4, 4, 8), torch.zeros(12, 3, 2, 4, 4, 8)
    assert HostPoolView(by_host).write(dest, heads, memoryview(frame)) == 3
    assert StagedPoolView(by_staged).write(dest, heads, memoryview(frame)) == 3
    assert torch.equal(by_staged, by_host)
    untouched = [p for p in range(12) if p not in dest]
    assert not by_staged[untouched].any()
    assert not by_staged[dest][:, :, :, :, [h for h in range(4) if h not in
                                            range(heads.start, heads.stop)]].any()


def test_the_view_follows_the_pool_device():
    assert isinstance(pool_view(_pool(3)), HostPoolView)
    assert pool_view(_pool(3)).on_host and not StagedPoolView(_pool(3)).on_host


def _staged(pair: Pair, sender: bool = True, receiver: bool = True) -> Pair:
    """Put staged views where the endpoints would build them for device pools."""
    if sender:
        pair.tx.link.pool = pair.tx.link.frames.pool = StagedPoolView(pair.pc.data())
    if receiver:
        pair.rx.pool = StagedPoolView(pair.dc.data())
    return pair


@pytest.mark.parametrize("sender, receiver", [(True, True), (True, False), (False, True)])
def test_staged_pools_move_a_request_byte_exact_over_real_sockets(tmp_path, sender,
                                                                  receiver):
    pair = _staged(Pair(tmp_path), sender, receiver)
    try:
        _connect_and_transfer(pair)  # asserts COMPLETED and every byte of the row
        assert pair.tx.stats["frames_sent"] > 0
    finally:
        pair.close()


def test_a_prefill_whose_pool_is_not_on_the_host_declines_a_shared_memory_pool(tmp_path):
    pair = _staged(Pair(tmp_path, shared=True), receiver=False)
    try:
        _connect_and_transfer(pair)
        assert not pair.tx.link.shm and pair.tx.stats["shm_writes"] == 0
        assert pair.tx.stats["frames_sent"] > 0
    finally:
        pair.close()
