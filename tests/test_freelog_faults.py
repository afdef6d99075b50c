"""Free logs that never lie: real I/O faults against the writer, and what replay says.

Faults are real: ``/dev/full`` (ENOSPC on every write), ``RLIMIT_FSIZE`` in a subprocess
(a short write, then EFBIG), a read-only folder, and ``FillingFile``, a real subclass of
the writer's file interface that stops taking bytes at a capacity (with a short write, as
a full disk does) until the test gives space back. Each story ends with ``pdkv replay``:
clean when every event made it, INCOMPLETE (exit 3) when some were lost, never a false
double free.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

from common.config import ServeConfig
from common.control import Load
from common.freelog import FreeLogReader, FreeLogWriter, health, log_problems, replay_file
from common.freelog.sink import LogFile, WriteError
from common.node import FreeLogFailed, WorkerBase
from tests.fakes import FakeLink

REPO = Path(__file__).resolve().parents[1]
POOLS = {"full": {"num_pages": 64, "page_size": 4, "reserved": [0]}}


@pytest.fixture(autouse=True)
def _forget_failed_writers():
    """A writer that closed with lost events stays in the process's registry (a worker's
    final stats name it); forget this test's, so no later test sees them."""
    before = set(health._writers)
    yield
    for writer in set(health._writers) - before:
        health.unregister(writer)


class FillingFile(LogFile):
    """A log file on a device that holds ``capacity`` bytes; ``None``: space returned."""

    capacity: int | None = None

    def write_all(self, data) -> None:
        if self.capacity is None or self.size + len(data) <= self.capacity:
            return super().write_all(data)
        room = max(0, self.capacity - self.size)
        super().write_all(memoryview(data)[:room])  # the part that fits, as a disk does
        raise WriteError(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), room)


class NoCutFile(FillingFile):
    """A full device on which the file cannot be cut back either (EIO)."""

    def truncate(self, size: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))


def open_with(cls, files: list):
    def opener(path: str) -> LogFile:
        plain = LogFile.create(path)
        f = cls(plain.fd, plain.path)
        files.append(f)
        return f
    return opener


def requests(log: FreeLogWriter, n: int, start: int = 0) -> None:
    """``n`` requests of two pages each: alloc, pin, free while pinned, unpin, release."""
    for i in range(start, start + n):
        pages = np.array([1 + 2 * (i % 30), 2 + 2 * (i % 30)], dtype=np.int32)
        log.alloc("full", pages, f"req-{i}")
        log.pin("full", pages, i + 1, "send")
        log.free("full", pages, f"req-{i}", "sent", [(0, 8)])
        log.unpin("full", pages, i + 1)
        log.release("full", pages)


def wait_for(pred, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def seqs(path: str) -> list[int]:
    with FreeLogReader(path) as reader:
        return [ev["seq"] for ev in reader.records]


# -- a full device ------------------------------------------------------------------------
def test_dev_full_is_surfaced_and_never_raises_into_the_allocator():
    def opener(path: str) -> LogFile:
        return LogFile(os.open("/dev/full", os.O_WRONLY), "/dev/full")

    log = FreeLogWriter("unused.freelog", node="n", pools=POOLS, opener=opener,
                        max_buffer_bytes=8192)
    requests(log, 200)  # far more than the buffer: events are dropped, nothing raises
    health = log.health()
    assert not health.ok and "ENOSPC" in health.error, health
    assert health.lost_events > 0 and health.failures == 1
    assert any(h.path == "/dev/full" for h in log_problems())
    log.close()
    closed = log.health()
    assert closed.closed and closed.lost_events == log.num_events  # not one event written
    assert any(h.path == "/dev/full" for h in log_problems())  # a worker still sees it


def test_space_that_returns_writes_every_record_exactly_once(tmp_path):
    files: list[FillingFile] = []
    log = FreeLogWriter(tmp_path / "d.freelog", node="n", pools=POOLS,
                        opener=open_with(FillingFile, files))
    requests(log, 20)
    wait_for(lambda: files[0].size > 1000)  # the flusher wrote the first requests
    files[0].capacity = files[0].size + 700  # the disk fills mid-record
    requests(log, 200, start=20)
    wait_for(lambda: not log.health().ok)
    assert "ENOSPC" in log.health().error and log.health().buffered_bytes > 0
    files[0].capacity = None  # space returns
    wait_for(lambda: log.health().ok)
    requests(log, 10, start=220)
    log.close()
    assert seqs(log.path) == list(range(log.num_events))  # no record twice, none missing
    report = replay_file(log.path)
    assert report.ok and report.exit_code == 0, report.format()
    assert log.health().lost_events == 0 and log.health().failures == 1


def test_events_dropped_past_the_memory_limit_leave_a_lost_marker(tmp_path):
    files: list[FillingFile] = []
    log = FreeLogWriter(tmp_path / "d.freelog", node="n", pools=POOLS,
                        opener=open_with(FillingFile, files), max_buffer_bytes=4096)
    requests(log, 10)
    wait_for(lambda: files[0].size > 500)
    files[0].capacity = files[0].size  # full
    requests(log, 300, start=10)
    wait_for(lambda: log.health().lost_events > 0)
    lost = log.health().lost_events
    files[0].capacity = None
    wait_for(lambda: log.health().ok)
    requests(log, 5, start=310)
    log.close()
    report = replay_file(log.path)
    assert report.incomplete and not report.ok and report.exit_code == 3, report.format()
    assert report.num_violations == 0  # no false double free after the gap
    assert report.lost_events == lost == log.health().lost_events
    gap = report.gaps[0]
    assert gap["seq"] == 50 and "ENOSPC" in gap["error"]  # 10 requests x 5 events judged
    assert report.closed and report.judged_after_gap > 0
    assert "INCOMPLETE" in report.format()
    on_disk = seqs(log.path)
    assert len(set(on_disk)) == len(on_disk) and on_disk[-1] == log.num_events - 1


def test_a_file_that_cannot_be_cut_back_is_given_up_loudly(tmp_path):
    files: list[NoCutFile] = []
    log = FreeLogWriter(tmp_path / "d.freelog", node="n", pools=POOLS,
                        opener=open_with(NoCutFile, files))
    wait_for(lambda: files[0].size > 0)  # the header
    files[0].capacity = files[0].size + 10
    requests(log, 50)
    wait_for(lambda: not log.health().ok)
    size = files[0].size
    files[0].capacity = None
    time.sleep(0.3)  # retries would write now: there must be none
    assert files[0].size == size and "cannot cut the file back" in log.health().error
    log.close()
    assert log.health().lost_events == log.num_events


# -- new file per incarnation ---------------------------------------------------------------
def test_a_restarted_process_never_overwrites_the_old_log(tmp_path):
    first = FreeLogWriter(tmp_path / "decode0.freelog", node="decode0", pools=POOLS)
    requests(first, 3)
    # killed: no close; the file holds what was flushed
    wait_for(lambda: (tmp_path / "decode0.freelog").stat().st_size > 300)
    before = (tmp_path / "decode0.freelog").read_bytes()
    second = FreeLogWriter(tmp_path / "decode0.freelog", node="decode0", pools=POOLS)
    third = FreeLogWriter(tmp_path / "decode0.freelog", node="decode0", pools=POOLS)
    assert second.path == str(tmp_path / "decode0.1.freelog")
    assert third.path == str(tmp_path / "decode0.2.freelog")
    requests(second, 2)
    second.close()
    third.close()
    assert (tmp_path / "decode0.freelog").read_bytes()[:len(before)] == before
    with FreeLogReader(second.path) as reader:
        assert reader.header.extra["pid"] == os.getpid()
    first.close()
    assert all(replay_file(p).ok for p in (first.path, second.path, third.path))


def test_a_read_only_folder_is_a_clear_error_at_creation():
    folder = Path(tempfile.mkdtemp(prefix="pdkv-ro-"))
    try:
        folder.chmod(0o555)
        # root ignores permission bits: try as nobody, in a subprocess
        # (imports first: nobody may not read the interpreter's own folders)
        code = ("import os,sys\n"
                f"sys.path.insert(0, {str(REPO)!r})\n"
                "from common.freelog import FreeLogWriter\n"
                "if os.geteuid() == 0: os.setgid(65534); os.setuid(65534)\n"
                "try:\n"
                f"    FreeLogWriter({str(folder / 'x.freelog')!r}, node='n', pools={POOLS!r})\n"
                "except OSError as exc:\n"
                "    print(exc); sys.exit(7)\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 7, out.stderr
        assert f"cannot create free log {folder / 'x.freelog'}" in out.stdout
        assert "EACCES" in out.stdout or "EROFS" in out.stdout
        assert list(folder.iterdir()) == []
    finally:
        folder.chmod(0o755)
        folder.rmdir()


# -- a file-size limit in a real process ---------------------------------------------------
_RLIMIT_SCRIPT = """
import json, resource, sys, time
sys.path.insert(0, {repo!r})
from common import KvCache
limit = {limit}
cache = KvCache(64, 4, log_path={path!r}, node="decode0")
log = cache.free_log
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
def work(n):
    for i in range(n):
        kv = cache.open_row(f"r{{i}}")
        cache.extend(kv, 10)
        pin = cache.pin(kv, 0, 10, reason="send")
        cache.free_kv_row(kv, [(0, 10)], reason="sent")
        cache.unpin(pin)
        cache.close_row(kv)
work({before})
time.sleep(0.5)
failing = log.health()
if {returns}:
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
work(20)
cache.close()
print(json.dumps({{"failing": failing.to_dict(), "after": log.health().to_dict(),
                  "events": log.num_events, "path": log.path}}))
"""


def _limited(tmp_path: Path, *, returns: bool, before: int, max_buffer: int | None = None):
    script = _RLIMIT_SCRIPT.format(repo=str(REPO), limit=16384, before=before,
                                   path=str(tmp_path / "decode0.freelog"), returns=returns)
    if max_buffer is not None:
        script = script.replace("limit = ", "from common.freelog.writer import configure\n"
                                f"configure(max_buffer_bytes={max_buffer})\nlimit = ")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1]), out.stderr


def test_a_file_size_limit_then_room_again_replays_clean(tmp_path):
    result, stderr = _limited(tmp_path, returns=True, before=400)
    failing = result["failing"]
    assert not failing["ok"] and "EFBIG" in failing["error"], result
    assert "write failed (EFBIG" in stderr  # said, not silent
    assert result["after"]["ok"] and result["after"]["lost_events"] == 0
    assert seqs(result["path"]) == list(range(result["events"]))
    assert os.path.getsize(result["path"]) > 16384
    report = replay_file(result["path"])
    assert report.ok, report.format()


def test_a_file_size_limit_that_stays_ends_the_log_early_and_says_so(tmp_path):
    result, stderr = _limited(tmp_path, returns=False, before=400)
    assert result["after"]["lost_events"] > 0 and not result["after"]["ok"]
    assert "closed with" in stderr and "never written" in stderr
    assert os.path.getsize(result["path"]) <= 16384
    report = replay_file(result["path"])
    assert report.num_violations == 0  # what is there is whole records, nothing torn


def test_lost_events_in_a_real_process_make_replay_exit_3(tmp_path):
    result, _ = _limited(tmp_path, returns=True, before=400, max_buffer=4096)
    assert result["failing"]["lost_events"] > 0
    out = subprocess.run([sys.executable, "-m", "deploy.cli", "replay", "--json",
                          result["path"]], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert out.returncode == 3, out.stdout + out.stderr
    doc = json.loads(out.stdout)
    log = doc["logs"][0]
    assert not doc["ok"] and log["incomplete"] and log["num_violations"] == 0
    assert log["lost_events"] == result["after"]["lost_events"]
    assert "EFBIG" in log["gaps"][0]["error"]


def test_lost_marker_is_plain_msgpack_with_the_documented_keys(tmp_path):
    files: list[FillingFile] = []
    log = FreeLogWriter(tmp_path / "d.freelog", node="n", pools=POOLS,
                        opener=open_with(FillingFile, files), max_buffer_bytes=2048)
    wait_for(lambda: files[0].size > 0)
    files[0].capacity = files[0].size
    requests(log, 100)
    wait_for(lambda: log.health().lost_events > 0)
    files[0].capacity = None
    wait_for(lambda: log.health().ok)
    log.close()
    with open(log.path, "rb") as f:
        records = list(msgpack.Unpacker(f, raw=False))
    marker = next(r for r in records if r.get("op") == "lost")
    assert set(marker) == {"seq", "t_ns", "op", "pool", "pages", "count", "error"}
    after = records[records.index(marker) + 1]
    assert marker["seq"] == 0 and after["seq"] == marker["seq"] + marker["count"]


@pytest.mark.parametrize("count", [-1, "x"])
def test_a_malformed_lost_marker_is_a_violation(tmp_path, count):
    path = tmp_path / "bad.freelog"
    packer = msgpack.Packer(use_bin_type=True)
    header = {"format": "pdkv-freelog", "version": 1, "node": "n", "pools": POOLS}
    with open(path, "wb") as f:
        f.write(packer.pack(header))
        f.write(packer.pack({"seq": 0, "t_ns": 0, "op": "lost", "pool": "", "pages": b"",
                             "count": count}))
    report = replay_file(path)
    assert report.violations_by_kind == {"malformed-event": 1} and report.exit_code == 1


# -- the worker's policy ----------------------------------------------------------------------
class _Shell(WorkerBase):
    """The worker shell over a fake control link: only the free-log policy is exercised."""

    role = "decode"

    def build(self) -> None: ...
    def on_req(self, req) -> None: ...
    def on_abort(self, rid) -> None: ...
    def abandon(self, detail) -> None: ...
    def shutdown(self) -> None: ...
    def tick(self) -> bool:
        return False


def _started(config: ServeConfig) -> tuple[_Shell, FakeLink]:
    link = FakeLink()
    shell = _Shell("decode0", link)
    shell.start(config)
    return shell, link


def _dev_full_writer() -> FreeLogWriter:
    return FreeLogWriter("unused", node="n", pools=POOLS, opener=lambda path: LogFile(
        os.open("/dev/full", os.O_WRONLY), "/dev/full"))


def _heartbeat(shell: _Shell, link: FakeLink) -> Load:
    shell._next_load = 0.0  # due now
    shell._heartbeat()
    return link.take(Load)[-1]


def test_the_worker_pauses_while_a_log_fails_and_admits_when_it_heals():
    shell, link = _started(ServeConfig())
    try:
        assert _heartbeat(shell, link).paused == ""
        log = _dev_full_writer()
        try:
            paused = _heartbeat(shell, link).paused
            assert "/dev/full" in paused and "ENOSPC" in paused and shell.paused == paused
        finally:
            log.close()
        health.unregister(log)  # the device never heals; the log is gone with its process
        assert _heartbeat(shell, link).paused == ""
    finally:
        shell.close()


def test_the_exit_policy_raises_free_log_failed():
    shell, link = _started(ServeConfig(freelog_on_error="exit"))
    log = _dev_full_writer()
    try:
        with pytest.raises(FreeLogFailed, match="freelog_on_error=exit.*ENOSPC"):
            _heartbeat(shell, link)
    finally:
        log.close()
        shell.close()


@pytest.mark.parametrize("field, value, words", [
    ("freelog_on_error", "ignore", "allowed: ('pause', 'exit')"),
    ("freelog_max_buffer_kib", 0, "must be >= 1")])
def test_free_log_config_fields_are_validated(field, value, words):
    with pytest.raises(ValueError, match=re.escape(f"{field}=")) as exc:
        ServeConfig(**{field: value})
    assert words in str(exc.value)


def test_the_router_routes_around_a_paused_worker_and_names_it():
    from common.request import BadRequest
    from deploy.router.placement import WorkerInfo, max_tokens, pick

    why = "free log /logs/decode0.freelog: failing for 2.0s: ENOSPC (No space left on device)"
    d0 = WorkerInfo("decode0", "decode", b"a", ready=True, pool_tokens=4096, paused=why)
    d1 = WorkerInfo("decode1", "decode", b"b", ready=True, pool_tokens=4096, assigned=3000)
    p0 = WorkerInfo("prefill0", "prefill", b"c", ready=True, pool_tokens=4096)
    assert pick([d0, d1, p0], 10, 20) == (d1, p0)  # d0 is idle but paused
    with pytest.raises(BadRequest, match=r"not admitting: decode0 \(free log .*ENOSPC"):
        max_tokens([d0, p0])
    p0.paused = why.replace("decode0", "prefill0")
    with pytest.raises(BadRequest, match=r"prefill worker .*not admitting: prefill0"):
        pick([d1, p0], 10, 20)
