"""The NIXL data path with real NIXL agents in two real processes: a spawned prefill group,
the decode group here (or the other way round for the SIGKILL-the-decode story).

Each story runs with UCX's own choice of transport on one host (``default``: cma for the
bytes) and with UCX forced onto TCP over loopback (``tcp``), where the bytes move only
while both sides progress. Control stays on ZMQ ipc. Without NIXL the module skips with
the import error; CI installs ``pdkv[nixl]`` and fails loudly if it cannot.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
import torch

from common.freelog import cross_check, replay_file
from tests.transport_helpers import (
    DecodeDriver,
    PrefillDriver,
    config,
    decode_child,
    layout,
    make_cache,
    prefill_child,
)
from transport import HandshakeError, nixl

pytestmark = [pytest.mark.timeout(90),
              pytest.mark.skipif(bool(nixl.import_error()),
                                 reason=f"NIXL not importable: {nixl.import_error()}")]
CTX = mp.get_context("spawn")
NIXL = {"kv_transport": "nixl"}
LEASE = {"lease_s": 1.0, "heartbeat_s": 0.1}


@pytest.fixture(params=["default", "tcp"])
def ucx(request, monkeypatch):
    """UCX's transports for this story; the spawned child inherits the environment."""
    if request.param == "tcp":
        monkeypatch.setenv("UCX_TLS", "tcp")
    else:
        monkeypatch.delenv("UCX_TLS", raising=False)
    return request.param


def _plan(page_size=4, prefill_tp=1, decode_tp=1, total_heads=4, **extra):
    requests = {
        "a": {"prompt_len": 37, "seed": 1, "chunks": [5, 13, 19], "first_token": 101},
        "b": {"prompt_len": 64, "seed": 2, "chunks": [30, 34], "first_token": 102},
        "c": {"prompt_len": 20, "seed": 3, "chunks": [7, 6, 7], "first_token": 103,
              "cached": 2 * page_size if page_size <= 8 else 0},
    }
    return {"total_heads": total_heads, "page_size": page_size, "num_pages": 160,
            "prefill_tp": prefill_tp, "decode_tp": decode_tp, "requests": requests, **extra}


def _start_prefill(plan, tmp_path, cfg_kw):
    queue = CTX.Queue()
    addresses = [f"ipc://{tmp_path}/p{rank}.sock" for rank in range(plan["prefill_tp"])]
    proc = CTX.Process(target=prefill_child, args=(plan, str(tmp_path), addresses, queue,
                                                   cfg_kw))
    proc.start()
    return proc, queue, queue.get(timeout=30)


def _run_pair(plan, tmp_path, prefill_kw=NIXL, decode_kw=NIXL):
    proc, queue, addresses = _start_prefill(plan, tmp_path, prefill_kw)
    try:
        drv = DecodeDriver(plan, str(tmp_path), addresses, **decode_kw)
        paths = [rx.data_paths() for rx in drv.receivers]
        drv.announce_all()
        drv.run(30)
        decode = drv.close()
        prefill = queue.get(timeout=30)
        proc.join(10)
    finally:
        proc.kill()
    assert proc.exitcode == 0
    return prefill, decode, paths


def _assert_logs_clean(tmp_path, names) -> dict:
    """Every log replays clean and every digest received equals the one sent."""
    reports = [replay_file(tmp_path / f"{name}.log") for name in names]
    for report in reports:
        assert report.ok, report.format()
    found, counts = cross_check([r.ledger for r in reports])
    assert not found, [v.format() for v in found]
    return counts


def _assert_nixl_only(prefill, decode):
    """No errors anywhere; every byte went by NIXL writes, each one notified."""
    for stats in prefill["stats"] + decode["stats"]:
        assert stats.get("errors", 0) == 0 and stats.get("errors_recv", 0) == 0, stats
    sent = sum(s.get("nixl_writes", 0) for s in prefill["stats"])
    assert sent > 0
    assert sum(s.get("frames_sent", 0) + s.get("shm_writes", 0)
               for s in prefill["stats"]) == 0
    recv = sum(s.get("nixl_writes_recv", 0) for s in decode["stats"])
    late = sum(s.get("nixl_writes_late", 0) for s in decode["stats"])  # after an abort
    assert recv + late == sent
    if not late:
        assert sum(s.get("bytes_recv", 0) for s in decode["stats"]) == sum(
            s.get("bytes_sent", 0) for s in prefill["stats"])


@pytest.mark.parametrize("ucx, page_size", [("default", 1), ("default", 16), ("tcp", 4)],
                         indirect=["ucx"])
def test_interleaved_requests_arrive_byte_exact(tmp_path, ucx, page_size):
    plan = _plan(page_size)
    prefill, decode, paths = _run_pair(plan, tmp_path)
    assert list(paths[0].values()) == ["nixl"]
    assert decode["correct"] == {"a@0": True, "b@0": True, "c@0": True}
    assert {rid: f[0][1:] for rid, f in decode["final"].items()} == {
        "a": ("COMPLETED", "", 101), "b": ("COMPLETED", "", 102), "c": ("COMPLETED", "", 103)}
    assert all(f[0][1] == "COMPLETED" for f in prefill["final"].values())
    assert prefill["leaked"] == [0] and decode["leaked"] == [0]
    _assert_nixl_only(prefill, decode)
    counts = _assert_logs_clean(tmp_path, ["prefill0", "decode0"])
    assert counts["runs_matched"] >= 3 and counts["runs_received_unmatched"] == 0
    assert counts["runs_sent_unreceived"] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("prefill_device, decode_device", [
    ("cuda:0", "cuda:0"), ("cuda:0", "cpu"), ("cpu", "cuda:0")])
def test_vram_pools_move_by_nixl_writes_byte_exact(tmp_path, prefill_device, decode_device):
    """Pools registered as VRAM (UCX's own choice of transport: cuda_ipc / cuda_copy)."""
    plan = _plan(4, prefill_device=prefill_device, decode_device=decode_device)
    prefill, decode, paths = _run_pair(plan, tmp_path)
    assert list(paths[0].values()) == ["nixl"]
    assert decode["correct"] == {"a@0": True, "b@0": True, "c@0": True}
    assert prefill["leaked"] == [0] and decode["leaked"] == [0]
    _assert_nixl_only(prefill, decode)
    _assert_logs_clean(tmp_path, ["prefill0", "decode0"])


@pytest.mark.parametrize("ucx, prefill_tp, decode_tp", [("default", 2, 1), ("tcp", 1, 2)],
                         indirect=["ucx"])
def test_tensor_parallel_head_mapping(tmp_path, ucx, prefill_tp, decode_tp):
    """Each prefill rank writes exactly its overlap of heads into each decode rank."""
    plan = _plan(4, prefill_tp=prefill_tp, decode_tp=decode_tp, total_heads=8)
    prefill, decode, _ = _run_pair(plan, tmp_path)
    assert decode["correct"] == {f"{rid}@{r}": True for rid in "abc" for r in range(decode_tp)}
    assert prefill["leaked"] == [0] * prefill_tp and decode["leaked"] == [0] * decode_tp
    _assert_nixl_only(prefill, decode)
    _assert_logs_clean(tmp_path, [f"prefill{r}" for r in range(prefill_tp)]
                       + [f"decode{r}" for r in range(decode_tp)])


def test_prefill_abort_mid_transfer_frees_both_sides(tmp_path, ucx):
    plan = _plan(4, prefill_abort_after={"b": 1}, chunk_delay_s=0.01)
    prefill, decode, _ = _run_pair(plan, tmp_path)
    assert [f[1:3] for f in decode["final"]["b"]] == [("ABORTED", "aborted")]
    assert decode["correct"] == {"a@0": True, "c@0": True}
    assert prefill["leaked"] == [0] and decode["leaked"] == [0]
    _assert_logs_clean(tmp_path, ["prefill0", "decode0"])


def test_decode_abort_mid_transfer_frees_both_sides(tmp_path, ucx):
    plan = _plan(4, decode_abort_after_frames={"b": 1}, chunk_delay_s=0.05)
    prefill, decode, _ = _run_pair(plan, tmp_path)
    assert [f[1:] for f in prefill["final"]["b"]] == [("ABORTED", "aborted")]
    assert decode["correct"] == {"a@0": True, "c@0": True}
    assert prefill["leaked"] == [0] and decode["leaked"] == [0]
    _assert_nixl_only(prefill, decode)
    _assert_logs_clean(tmp_path, ["prefill0", "decode0"])


def test_prefill_killed_mid_transfer_decode_reclaims_within_the_lease(tmp_path, ucx):
    plan = _plan(4, prefill_stall_after={"b": 1})
    proc, _, addresses = _start_prefill(plan, tmp_path, {**NIXL, **LEASE})
    drv = DecodeDriver(plan, str(tmp_path), addresses, **NIXL, **LEASE)
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
    decode = drv.close()
    proc.join(5)
    assert [f[1:3] for f in decode["final"]["b"]] == [("FAILED", "peer_lost")]
    assert decode["leaked"] == [0] and decode["stats"][0]["peers_lost"] == 1
    assert decode["correct"] == {"a@0": True, "c@0": True}
    _assert_logs_clean(tmp_path, ["decode0"])


def test_decode_killed_mid_transfer_prefill_reclaims(tmp_path, ucx):
    """The decode dies between chunks: the prefill loses it (a failed write, or the
    lease), fails every request with peer_lost and frees everything."""
    plan = _plan(4, chunk_delay_s=0.2)
    drv = PrefillDriver(plan, str(tmp_path), [f"ipc://{tmp_path}/p0.sock"], **NIXL, **LEASE)
    queue = CTX.Queue()
    proc = CTX.Process(target=decode_child, args=(plan, str(tmp_path), drv.addresses, queue,
                                                  {**NIXL, **LEASE}))
    proc.start()
    deadline = time.monotonic() + 30
    while not any(drv.progress.values()) and time.monotonic() < deadline:
        drv.step()
    os.kill(proc.pid, signal.SIGKILL)
    while not drv.settled() and time.monotonic() < deadline:
        drv.step()
    prefill = drv.close()
    proc.join(5)
    assert all(f[0][1:] == ("FAILED", "peer_lost") for f in prefill["final"].values())
    assert prefill["leaked"] == [0] and prefill["stats"][0]["peers_lost"] == 1
    assert prefill["stats"][0]["nixl_writes"] > 0
    _assert_logs_clean(tmp_path, ["prefill0"])


class _Serving:
    """A ``KvSender`` polled on a thread of this process (for handshake-only stories)."""

    def __init__(self, tmp_path, mode: str):
        from transport import KvSender
        plan = _plan(4)
        self.lay = layout(plan["total_heads"])
        self.cache = make_cache(32, 4, self.lay)
        self.sender = KvSender(self.cache, f"ipc://{tmp_path}/p.sock",
                               config("prefill0", kv_transport=mode))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            self.sender.poll(0.005)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sender.close()
        self.cache.close()


def _connect(tmp_path, prefill_mode: str, decode_mode: str) -> dict[str, str]:
    from transport import KvReceiver
    serving = _Serving(tmp_path, prefill_mode)
    cache = make_cache(32, 4, serving.lay)
    rx = None
    try:
        rx = KvReceiver(cache, config("decode0", kv_transport=decode_mode))
        rx.connect(serving.sender.address)
        return rx.data_paths()
    finally:
        if rx is not None:
            rx.close()
        cache.close()
        serving.close()


@pytest.mark.parametrize("prefill_mode, decode_mode, path", [
    ("auto", "auto", "nixl"), ("auto", "zmq", "ipc"), ("zmq", "auto", "ipc"),
    ("nixl", "auto", "nixl"), ("auto", "nixl", "nixl")])
def test_negotiation_uses_nixl_only_when_both_offer_it(tmp_path, prefill_mode, decode_mode,
                                                       path):
    assert list(_connect(tmp_path, prefill_mode, decode_mode).values()) == [path]


@pytest.mark.parametrize("prefill_mode, decode_mode", [("nixl", "zmq"), ("zmq", "nixl")])
def test_required_nixl_against_a_zmq_peer_fails_the_handshake(tmp_path, prefill_mode,
                                                              decode_mode):
    with pytest.raises(HandshakeError, match="kv_transport: .* requires nixl"):
        _connect(tmp_path, prefill_mode, decode_mode)


def test_auto_falls_back_and_serves_over_zmq(tmp_path):
    """auto on one end, zmq on the other: the KV moves in frames, byte-exact."""
    prefill, decode, paths = _run_pair(_plan(4), tmp_path, {"kv_transport": "auto"},
                                       {"kv_transport": "zmq"})
    assert list(paths[0].values()) == ["ipc"]   # frames over the ipc socket
    assert decode["correct"] == {"a@0": True, "b@0": True, "c@0": True}
    assert sum(s.get("frames_sent", 0) for s in prefill["stats"]) > 0
    assert sum(s.get("nixl_writes", 0) for s in prefill["stats"]) == 0
