"""A decode endpoint keeps the memory of received frames mapped (transport/frame_memory.py).

ZMQ's I/O thread mallocs each received frame and the receiver frees it after landing. With
glibc's default thresholds, freeing a few 8 MiB blocks gives them back to the kernel, and
the next frames fault every page in again. Each story runs in a fresh interpreter (the
setting is process-wide and cannot be undone): it builds a ``KvReceiver`` and then, on a
thread of its own as ZMQ's I/O thread is, allocates, fills and frees three 8 MiB blocks
per round, counting that thread's page faults per round.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 8 << 20
PAGES_PER_ROUND = 3 * BLOCK // 4096

STORY = """
import ctypes, json, resource, sys, threading
from common import KvCache, KvLayout
from transport import KvReceiver, TransportConfig

cache = KvCache(8, 16, layout=KvLayout(num_layers=1, num_kv_heads=1, head_dim=8))
rx = KvReceiver(cache, TransportConfig(node="d", keep_frame_memory=sys.argv[1] == "keep"))
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
faults = []

def rounds():
    for _ in range(6):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        blocks = [libc.malloc(8 << 20) for _ in range(3)]
        for b in blocks:
            ctypes.memset(b, 1, 8 << 20)
        for b in blocks:
            libc.free(b)
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

thread = threading.Thread(target=rounds)
thread.start()
thread.join()
rx.close()
cache.close()
print(json.dumps(faults))
"""

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc",
                                reason="the thresholds are glibc's")


def _faults_per_round(mode: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", STORY, mode], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_receiver_keeps_freed_frame_blocks_for_the_next_frames():
    faults = _faults_per_round("keep")
    assert faults[0] >= PAGES_PER_ROUND * 0.9, faults  # the heap grows once
    assert sum(faults[1:]) < 100, faults               # then every round reuses it


def test_without_it_glibc_gives_them_back_and_every_round_faults_again():
    faults = _faults_per_round("default")
    assert all(n >= PAGES_PER_ROUND * 0.9 for n in faults), faults


@pytest.mark.parametrize("frame", [0, (16 << 20) + 1, 32 << 20])
def test_frames_a_decode_would_map_afresh_each_time_are_refused(frame):
    """Frames of 32 MiB or more leave glibc's heaps (mapped and faulted in for every
    frame: 0.17-0.46x of raw pyzmq); the sender's setting is refused, saying why."""
    from transport import TransportConfig
    with pytest.raises(ValueError, match=r"max_frame_bytes=\d+ must be in \[1, 16777216\]"
                                         r".*afresh for every frame"):
        TransportConfig(max_frame_bytes=frame)
    assert TransportConfig(max_frame_bytes=16 << 20).max_frame_bytes == 16 << 20
