"""Attack stories on the KV plane, against real processes over real sockets.

The victims are a prefill process (spawned) and a decode group (here) moving three
interleaved requests through the decode's shared-memory pool. The attacker is anyone who
can reach a socket: it writes raw msgpack (no checks on its side), offers hostile
shared-memory segments, sends negative counts and out-of-range page ids, and forges
messages for requests that are not its own. Every attack is refused and counted, no
process goes down, the victims' KV arrives byte-exact and every free log replays clean.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import threading
import time

import msgpack
import numpy as np
import pytest
import torch
import zmq

from common.freelog import replay_file
from common.kv import SharedTensor
from tests.transport_helpers import DecodeDriver, prefill_child
from transport.integrity import pack_epochs
from transport.messages import Hello, decode, encode, pages_to_bytes

pytestmark = pytest.mark.timeout(120)
CTX = mp.get_context("spawn")


def _plan(**extra) -> dict:
    requests = {
        "a": {"prompt_len": 37, "seed": 1, "chunks": [5, 13, 19], "first_token": 101},
        "b": {"prompt_len": 64, "seed": 2, "chunks": [30, 34], "first_token": 102},
        "c": {"prompt_len": 20, "seed": 3, "chunks": [7, 6, 7], "first_token": 103},
    }
    return {"total_heads": 4, "page_size": 4, "num_pages": 160, "prefill_tp": 1,
            "decode_tp": 1, "requests": requests, "shm": True, "chunk_delay_s": 0.02,
            **extra}


def _raw(kind: str, **fields) -> bytes:
    """A control frame as an attacker writes it: nothing checked on its side."""
    return msgpack.packb({"t": kind, **fields}, use_bin_type=True)


def _hello(base: Hello, **changes) -> bytes:
    return _raw("Hello", **{**dataclasses.asdict(base), "node": "mallory", **changes})


class Attacker:
    """Raw DEALER sockets against one address; ``pump`` keeps the victims' loop turning
    while it waits for answers (the decode must heartbeat its prefill meanwhile)."""

    def __init__(self, address: str, pump):
        self.ctx, self.address, self.pump = zmq.Context(), address, pump
        self.socks: list[zmq.Socket] = []

    def connect(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        self.socks.append(sock)
        return sock

    def ask(self, sock: zmq.Socket, *frames: bytes, answers: int = 1) -> list:
        sock.send(frames[0]) if len(frames) == 1 else sock.send_multipart(list(frames))
        got, deadline = [], time.monotonic() + 5
        while len(got) < answers and time.monotonic() < deadline:
            self.pump()
            while sock.poll(0):
                msg = decode(sock.recv_multipart()[0])
                if type(msg).__name__ != "Heartbeat":
                    got.append(msg)
        return got

    def close(self) -> None:
        for sock in self.socks:
            sock.close(linger=0)
        self.ctx.term()


def _start_prefill(plan, tmp_path):
    queue = CTX.Queue()
    proc = CTX.Process(target=prefill_child, args=(plan, str(tmp_path),
                                                   [f"ipc://{tmp_path}/p0.sock"], queue, {}))
    proc.start()
    return proc, queue, queue.get(timeout=30)


def _finish(drv: DecodeDriver, proc, queue, tmp_path) -> tuple[dict, dict]:
    drv.run(30)
    decode_report = drv.close()
    prefill_report = queue.get(timeout=30)
    proc.join(10)
    assert proc.exitcode == 0                              # nobody took the prefill down
    assert decode_report["correct"] == {"a@0": True, "b@0": True, "c@0": True}
    assert {rid: f[0][1] for rid, f in decode_report["final"].items()} == {
        "a": "COMPLETED", "b": "COMPLETED", "c": "COMPLETED"}
    assert prefill_report["leaked"] == [0] and decode_report["leaked"] == [0]
    for name in ("prefill0", "decode0"):
        report = replay_file(tmp_path / f"{name}.log")
        assert report.ok, report.format()
    for stats in prefill_report["stats"] + decode_report["stats"]:
        assert stats.get("errors.internal", 0) == 0, stats
    return prefill_report["stats"][0], decode_report["stats"][0]


def _codes(answers) -> list[str]:
    return [getattr(m, "code", type(m).__name__) for m in answers]


def test_hostile_segments_and_bad_counts_are_refused_and_the_victims_unharmed(tmp_path):
    plan = _plan()
    proc, queue, addresses = _start_prefill(plan, tmp_path)
    drv = DecodeDriver(plan, str(tmp_path), addresses)
    victim = drv.receivers[0].hello          # the victim decode's offer, token included
    mallory = Attacker(addresses[0], drv.step)
    target = tmp_path / "target"
    target.write_bytes(b"precious" * 512)
    link = f"/dev/shm/pdkv-test-link-{os.getpid()}"
    os.symlink(target, link)
    wrong_size = SharedTensor((8, 3, 2, 4, 4, 8), torch.float32)   # mallory's own
    own = SharedTensor((victim.shm_pages, 3, 2, 4, 4, 8), torch.float32)
    try:
        refusals = {
            "path": _hello(victim, shm_pool=f"../..{target}", shm_token=b""),
            "negative pages": _hello(victim, shm_pages=-1),
            "victim's segment, no token": _hello(victim, shm_token=b""),
            "victim's segment, guessed token": _hello(victim, shm_token=b"\0" * 16),
            "wrong size": _hello(victim, shm_pool=wrong_size.name,
                                 shm_token=wrong_size.token),
            "symlink": _hello(victim, shm_pool=os.path.basename(link)),
        }
        answers = {what: _codes(mallory.ask(mallory.connect(), frame))
                   for what, frame in refusals.items()}
        assert answers == {"path": ["bad_field"], "negative pages": ["bad_field"],
                           "victim's segment, no token": ["handshake"],
                           "victim's segment, guessed token": ["handshake"],
                           "wrong size": ["handshake"], "symlink": ["handshake"]}
        # mallory's own, well-formed pool is mapped; its announces still may not write
        # anywhere but its pages, and bad counts are refused before anything is pinned
        sock = mallory.connect()
        ok = mallory.ask(sock, _hello(victim, shm_pool=own.name, shm_token=own.token))
        assert [type(m).__name__ for m in ok] == ["Hello"] and ok[0].shm_pool == own.name
        drv.announce_all()
        two = pack_epochs(np.ones(2, np.uint64))
        bad = [_raw("Register", rid="m1", prompt_len=8, cached_tokens=0,
                    dest_pages=pages_to_bytes([victim.shm_pages, 3]), dest_epochs=two),
               _raw("Register", rid="m2", prompt_len=8, cached_tokens=0,
                    dest_pages=pages_to_bytes([0, 3]), dest_epochs=two),
               _raw("Register", rid="m3", prompt_len=-5, cached_tokens=0, dest_pages=b"",
                    dest_epochs=b""),
               _raw("Register", rid="m4", prompt_len=8, cached_tokens=0,
                    dest_pages=pages_to_bytes([-2, 3]), dest_epochs=two),
               _raw("KvChunk", rid="a", first_block=-1, num_blocks=1, head_start=0,
                    head_end=4, nbytes=4)]
        got = [_codes(mallory.ask(sock, frame)) for frame in bad]
        assert got == [["bad_range"], ["bad_range"], ["bad_field"], ["bad_range"],
                       ["bad_field"]]
        prefill, _ = _finish(drv, proc, queue, tmp_path)
    finally:
        mallory.close()
        os.unlink(link)
        proc.kill()
    assert target.read_bytes() == b"precious" * 512
    assert not own.tensor.any()                           # nothing landed in mallory's pool
    wrong_size.close()
    own.close()
    assert prefill["shm_refused"] == 4 and prefill["errors.handshake"] == 4
    assert prefill["errors.bad_field"] == 4 and prefill["errors.bad_range"] == 3


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand a file to another uid")
def test_a_segment_another_user_could_shrink_is_never_mapped(tmp_path):
    plan = _plan(requests={"a": {"prompt_len": 8, "seed": 1, "chunks": [8],
                                 "first_token": 7}})
    proc, queue, addresses = _start_prefill(plan, tmp_path)
    drv = DecodeDriver(plan, str(tmp_path), addresses)
    victim = drv.receivers[0].hello
    mallory = Attacker(addresses[0], drv.step)
    theirs = SharedTensor((victim.shm_pages, 3, 2, 4, 4, 8), torch.float32)
    os.chown(f"/dev/shm/{theirs.name}", 65534, 65534)
    try:
        answer = mallory.ask(mallory.connect(), _hello(victim, shm_pool=theirs.name,
                                                       shm_token=theirs.token))
        assert _codes(answer) == ["handshake"] and "belongs to uid 65534" in answer[0].detail
        drv.announce_all()
        drv.run(30)
        report = drv.close()
        assert report["correct"] == {"a@0": True}
        assert queue.get(timeout=30)["stats"][0]["shm_refused"] == 1
        proc.join(10)
    finally:
        mallory.close()
        proc.kill()
        theirs.close()


class HostilePrefill:
    """A ROUTER that answers the decode's Hello like a prefill, then forges messages."""

    def __init__(self, address: str, rx):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self.hello = dataclasses.replace(rx.hello, role="prefill", node="mallory",
                                         shm_pool="", shm_pages=0, shm_token=b"")
        self.peer = None
        thread = threading.Thread(target=self._answer_hello)
        thread.start()
        self.group = rx.connect(address)
        thread.join()

    def _answer_hello(self) -> None:
        while self.peer is None:
            if self.sock.poll(10):
                self.peer, _ = self.sock.recv_multipart()
                self.sock.send_multipart([self.peer, encode(self.hello)])

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart([self.peer, *frames])

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def test_a_second_prefill_cannot_write_finish_abort_or_fail_requests_it_does_not_serve(
        tmp_path):
    plan = _plan(chunk_delay_s=0.05)
    proc, queue, addresses = _start_prefill(plan, tmp_path)
    drv = DecodeDriver(plan, str(tmp_path), addresses)
    rx = drv.receivers[0]
    hostile = HostilePrefill(f"ipc://{tmp_path}/mallory.sock", rx)
    block = drv.caches[0].data()[0].numel() * 4
    try:
        drv.announce_all()
        chunk = dict(first_block=0, num_blocks=1, head_start=0, head_end=4, nbytes=block)
        hostile.send(_raw("KvChunk", rid="a", **chunk), b"\xff" * block)
        hostile.send(_raw("KvWritten", rid="b", first_block=0, num_blocks=1, head_start=0,
                          head_end=4))
        hostile.send(_raw("KvWritten", rid="b", first_block=1, num_blocks=1, head_start=0,
                          head_end=4, first_token=666))      # a forged completion
        hostile.send(_raw("Abort", rid="c", reason="aborted", detail="forged"))
        hostile.send(_raw("Error", code="bad_range", detail="forged", rid="a"))
        hostile.send(_raw("KvChunk", rid="a", **{**chunk, "num_blocks": -4}), b"\xff")
        hostile.send(_raw("KvChunk", rid="c", **chunk, first_token=1), b"\xff" * block)
        _, decode_stats = _finish(drv, proc, queue, tmp_path)
    finally:
        hostile.close()
        proc.kill()
    assert decode_stats["errors.unknown_rid"] == 5 and decode_stats["errors.bad_field"] == 1
    assert decode_stats["errors_recv"] == 1            # the forged Error failed nothing
