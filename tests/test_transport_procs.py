"""Two real processes over real sockets: a spawned prefill group, the decode group here
(or the other way round for the SIGKILL-the-decode story).

``kind`` names the data path: ``tcp``/``ipc`` carry KV in ZMQ frames (the decode pool is
private), ``shm`` puts the decode pool in shared memory so the same-host prefill writes
into it (control over ipc)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from common.freelog import cross_check, replay_file
from tests.transport_helpers import DecodeDriver, PrefillDriver, decode_child, prefill_child

pytestmark = pytest.mark.timeout(90)
CTX = mp.get_context("spawn")


def _plan(page_size=4, prefill_tp=1, decode_tp=1, total_heads=4, **extra):
    requests = {
        "a": {"prompt_len": 37, "seed": 1, "chunks": [5, 13, 19], "first_token": 101},
        "b": {"prompt_len": 64, "seed": 2, "chunks": [30, 34], "first_token": 102},
        "c": {"prompt_len": 20, "seed": 3, "chunks": [7, 6, 7], "first_token": 103,
              "cached": 2 * page_size if page_size <= 8 else 0},
    }
    return {"total_heads": total_heads, "page_size": page_size, "num_pages": 160,
            "prefill_tp": prefill_tp, "decode_tp": decode_tp, "requests": requests, **extra}


def _shm_plan(kind, page_size=4, **kw):
    return _plan(page_size, shm=kind == "shm", **kw)


def _addresses(kind, tmp_path, n):
    if kind == "tcp":
        return ["tcp://127.0.0.1:*"] * n
    return [f"ipc://{tmp_path}/p{rank}.sock" for rank in range(n)]


def _start_prefill(plan, tmp_path, kind, cfg_kw=None):
    queue = CTX.Queue()
    proc = CTX.Process(target=prefill_child, args=(
        plan, str(tmp_path), _addresses(kind, tmp_path, plan["prefill_tp"]), queue,
        cfg_kw or {}))
    proc.start()
    return proc, queue, queue.get(timeout=30)


def _assert_logs_clean(tmp_path, names) -> dict:
    """Every log replays clean, and every digest a decode received equals the one its
    prefill sent (``pdkv replay`` given both sides' logs); returns the cross-check counts."""
    reports = [replay_file(tmp_path / f"{name}.log") for name in names]
    for report in reports:
        assert report.ok, report.format()
    found, counts = cross_check([r.ledger for r in reports])
    assert not found, [v.format() for v in found]
    return counts


def _run_pair(plan, tmp_path, kind="ipc"):
    proc, queue, addresses = _start_prefill(plan, tmp_path, kind)
    try:
        drv = DecodeDriver(plan, str(tmp_path), addresses)
        drv.announce_all()
        drv.run(30)
        decode = drv.close()
        prefill = queue.get(timeout=30)
        proc.join(10)
    finally:
        proc.kill()
    assert proc.exitcode == 0
    return prefill, decode


def _assert_data_path(kind, prefill, decode):
    """No errors counted anywhere, and the KV took the path ``kind`` names."""
    for stats in prefill["stats"] + decode["stats"]:
        assert stats.get("errors", 0) == 0 and stats.get("errors_recv", 0) == 0, stats
    frames = sum(s.get("frames_sent", 0) for s in prefill["stats"])
    writes = sum(s.get("shm_writes", 0) for s in prefill["stats"])
    assert (writes > 0 and frames == 0) if kind == "shm" else (frames > 0 and writes == 0)


@pytest.mark.parametrize("kind, page_size", [("ipc", 1), ("ipc", 16), ("tcp", 1), ("tcp", 4),
                                             ("tcp", 16), ("shm", 1), ("shm", 16)])
def test_interleaved_requests_arrive_byte_exact(tmp_path, kind, page_size):
    plan = _shm_plan(kind, page_size)
    prefill, decode = _run_pair(plan, tmp_path, kind)
    assert decode["correct"] == {"a@0": True, "b@0": True, "c@0": True}
    assert {rid: f[0][1:] for rid, f in decode["final"].items()} == {
        "a": ("COMPLETED", "", 101), "b": ("COMPLETED", "", 102), "c": ("COMPLETED", "", 103)}
    assert all(f[0][1] == "COMPLETED" for f in prefill["final"].values())
    assert prefill["leaked"] == [0] and decode["leaked"] == [0]
    _assert_data_path(kind, prefill, decode)
    counts = _assert_logs_clean(tmp_path, ["prefill0", "decode0"])
    # every data message sent was received and its digest matched (c: its prefix cached)
    assert counts["runs_matched"] >= 3 and counts["runs_received_unmatched"] == 0
    assert counts["runs_sent_unreceived"] == 0 and counts["mismatches"] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("prefill_device, decode_device, prefill_tp", [
    ("cuda:0", "cuda:0", 1), ("cuda:0", "cpu", 1), ("cpu", "cuda:0", 1), ("cuda:0", "cuda:0", 2)])
def test_gpu_pools_move_over_frames_byte_exact(tmp_path, prefill_device, decode_device,
                                               prefill_tp):
    """A CUDA pool's frames are staged through host memory (transport/pool_view.py); a
    shared-memory offer is declined by a prefill whose pool is not on the host."""
    plan = _plan(4, prefill_tp=prefill_tp, total_heads=8, shm=decode_device == "cpu",
                 prefill_device=prefill_device, decode_device=decode_device)
    prefill, decode = _run_pair(plan, tmp_path, "tcp")
    assert decode["correct"] == {"a@0": True, "b@0": True, "c@0": True}
    assert prefill["leaked"] == [0] * prefill_tp and decode["leaked"] == [0]
    _assert_data_path("tcp", prefill, decode)
    _assert_logs_clean(tmp_path, [f"prefill{r}" for r in range(prefill_tp)] + ["decode0"])


@pytest.mark.parametrize("kind", ["ipc", "shm"])
@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2), (2, 4)])
def test_tensor_parallel_groups_of_different_sizes(tmp_path, kind, prefill_tp, decode_tp):
    plan = _shm_plan(kind, 4, prefill_tp=prefill_tp, decode_tp=decode_tp, total_heads=8)
    prefill, decode = _run_pair(plan, tmp_path)
    assert decode["correct"] == {f"{rid}@{r}": True for rid in "abc" for r in range(decode_tp)}
    assert prefill["leaked"] == [0] * prefill_tp and decode["leaked"] == [0] * decode_tp
    _assert_data_path(kind, prefill, decode)
    _assert_logs_clean(tmp_path, [f"prefill{r}" for r in range(prefill_tp)]
                       + [f"decode{r}" for r in range(decode_tp)])


@pytest.mark.parametrize("kind", ["ipc", "shm"])
def test_prefill_abort_mid_transfer_frees_both_sides(tmp_path, kind):
    plan = _shm_plan(kind, 4, prefill_abort_after={"b": 1}, chunk_delay_s=0.01)
    prefill, decode = _run_pair(plan, tmp_path)
    assert [f[1:3] for f in decode["final"]["b"]] == [("ABORTED", "aborted")]
    assert decode["correct"] == {"a@0": True, "c@0": True}
    assert prefill["leaked"] == [0] and decode["leaked"] == [0]
    _assert_logs_clean(tmp_path, ["prefill0", "decode0"])


@pytest.mark.parametrize("kind", ["ipc", "shm"])
def test_decode_abort_mid_transfer_frees_both_sides(tmp_path, kind):
    plan = _shm_plan(kind, 4, decode_abort_after_frames={"b": 1}, chunk_delay_s=0.05)
    prefill, decode = _run_pair(plan, tmp_path)
    assert [f[1:] for f in prefill["final"]["b"]] == [("ABORTED", "aborted")]
    assert decode["correct"] == {"a@0": True, "c@0": True}
    assert prefill["leaked"] == [0] and decode["leaked"] == [0]
    _assert_data_path(kind, prefill, decode)
    _assert_logs_clean(tmp_path, ["prefill0", "decode0"])


LEASE = {"lease_s": 1.0, "heartbeat_s": 0.1}


@pytest.mark.parametrize("kind", ["ipc", "shm"])
def test_prefill_killed_mid_transfer_decode_reclaims_within_the_lease(tmp_path, kind):
    plan = _shm_plan(kind, 4, prefill_stall_after={"b": 1})
    proc, _, addresses = _start_prefill(plan, tmp_path, "ipc", LEASE)
    drv = DecodeDriver(plan, str(tmp_path), addresses, **LEASE)
    drv.announce_all()
    deadline = time.monotonic() + 20
    rx = drv.receivers[0]
    def b_leg():
        return next(iter(rx.transfers["b"].legs.values()))

    # a and c complete and b stalls after its first block, whose arrival may come after
    # theirs: wait for both, not for the finals alone
    while (len(drv.final) < 2 or not b_leg().blocks_received) and time.monotonic() < deadline:
        drv.step()
    assert len(drv.final) == 2 and b_leg().blocks_received > 0  # b mid-transfer
    os.kill(proc.pid, signal.SIGKILL)
    t_kill = time.monotonic()
    free_at_kill = drv.caches[0].num_free_pages()
    while time.monotonic() - t_kill < LEASE["lease_s"] * 0.6:   # within the lease: still held
        drv.step()
    assert rx.num_pins == 1 and drv.caches[0].num_free_pages() == free_at_kill
    while rx.transfers and time.monotonic() < deadline:
        drv.step()
    reclaimed_after = time.monotonic() - t_kill
    decode = drv.close()
    proc.join(5)
    assert [f[1:3] for f in decode["final"]["b"]] == [("FAILED", "peer_lost")]
    assert reclaimed_after < LEASE["lease_s"] + 0.5
    assert decode["leaked"] == [0] and decode["stats"][0]["peers_lost"] == 1
    _assert_logs_clean(tmp_path, ["decode0"])


def test_decode_killed_mid_transfer_prefill_reclaims_within_the_lease(tmp_path):
    plan = _plan(4, decode_abort_after_frames={}, chunk_delay_s=0.2)
    drv = PrefillDriver(plan, str(tmp_path), [f"ipc://{tmp_path}/p0.sock"], **LEASE)
    queue = CTX.Queue()
    proc = CTX.Process(target=decode_child, args=(plan, str(tmp_path), drv.addresses, queue,
                                                  LEASE))
    proc.start()
    deadline = time.monotonic() + 30
    while not any(drv.progress.values()) and time.monotonic() < deadline:
        drv.step()
    os.kill(proc.pid, signal.SIGKILL)
    t_kill = time.monotonic()
    while not drv.settled() and time.monotonic() < deadline:
        drv.step()
    reclaimed_after = time.monotonic() - t_kill
    prefill = drv.close()
    proc.join(5)
    assert all(f[0][1:] == ("FAILED", "peer_lost") for f in prefill["final"].values())
    assert reclaimed_after < LEASE["lease_s"] + 0.8
    assert prefill["leaked"] == [0] and prefill["stats"][0]["peers_lost"] == 1
    _assert_logs_clean(tmp_path, ["prefill0"])
