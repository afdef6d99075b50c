"""Shared-memory segments are named after their deployment, worker and owner process, and
those of dead owners are reclaimed: never a live worker's, never another deployment's,
never a file that is not a pdkv pool."""

from __future__ import annotations

import os
import subprocess
import sys

from common.kv import KvCache, reclaim_orphans, segment_stem
from common.kv.segments import MAGIC, owner_alive, segment_name


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _segment(folder, name: str, head: bytes = MAGIC) -> None:
    (folder / name).write_bytes(head + b"\0" * 64)
    os.chmod(folder / name, 0o600)


def test_a_pool_segment_says_whose_it_is():
    cache = KvCache(4, 2, shared_memory=True, node="decode0",
                    segment=segment_stem("0123456789abcdef0123", "decode0"))
    try:
        name = cache.shared_memory_name()
        stem, owner, rand = name.rsplit(".", 2)
        assert stem == "pdkv.0123456789abcdef.decode0" and len(rand) == 8
        assert owner.startswith(f"{os.getpid()}-") and owner_alive(name)
        assert os.path.exists(f"/dev/shm/{name}")
        assert reclaim_orphans("0123456789abcdef0123") == []     # its owner lives
    finally:
        cache.close()
    assert not os.path.exists(f"/dev/shm/{name}")
    default = KvCache(4, 2, shared_memory=True, node="p0/tp1")
    try:
        assert default.shared_memory_name().startswith("pdkv.local.p0-tp1.")
    finally:
        default.close()


def test_orphans_of_dead_owners_are_reclaimed_and_nothing_else(tmp_path):
    dead = _dead_pid()
    ours = segment_name("pdkv.local.decode0")            # this process: alive
    orphan = f"pdkv.local.decode1.{dead}-123.00ff00ff"
    reused = f"pdkv.local.decode2.{os.getpid()}-1.00ff00ff"  # our pid, another start time
    for name in (ours, orphan, reused):
        _segment(tmp_path, name)
    _segment(tmp_path, f"pdkv.local.decode3.{dead}-1.0a0a0a0a", b"NOTAPOOL")   # foreign
    _segment(tmp_path, f"pdkv.other.decode4.{dead}-1.0b0b0b0b")   # another deployment
    _segment(tmp_path, "pdkv.local.odd-name")                       # no owner in the name
    gone = reclaim_orphans("", shm_dir=str(tmp_path))
    assert sorted(gone) == sorted([orphan, reused])
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([ours, f"pdkv.local.decode3.{dead}-1.0a0a0a0a",
                           f"pdkv.other.decode4.{dead}-1.0b0b0b0b", "pdkv.local.odd-name"])
    assert reclaim_orphans("", shm_dir=str(tmp_path)) == []        # nothing more
