"""SIGTERM stops a worker after the step under way, never inside it.

The story that needs it: rank 0 of a tensor-parallel group took its pending cache ops
for a broadcast and was signalled before they went out; its follower then closed with
a row still held that rank 0 had freed, and its free log reported the leak (a CI run
saw it in the killed-rank test). Here a real leader cache and a follower ``Mirror`` are
joined by a group of one that keeps rank 0's steps, and the signal lands inside the
broadcast of the step that carries the free."""

from __future__ import annotations

import os
import signal

import pytest

from common.config import ServeConfig
from common.control import Drain, Shutdown
from common.freelog import FreeLogReader, replay_file
from common.kv import KvCache
from common.model import ModelRunner, get_config
from common.node import WorkerBase, stop_signals
from common.node.tp import LeaderKvCache, Lockstep, Mirror, TpLeader
from common.parallel import TpGroup
from tests.fakes import FakeLink

CFG = get_config("tiny", dtype="float64")


@pytest.fixture(autouse=True)
def _own_handlers():
    """``install`` replaces the process's SIGTERM/SIGINT handlers (pytest's among them)."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    stop_signals.install()
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


class SignalledGroup(TpGroup):
    """A group of one that keeps every step rank 0 broadcast; the process is sent
    SIGTERM once, at the start of broadcast number ``signal_at`` (that step's ops
    already taken from the lockstep's queue)."""

    def __init__(self, signal_at: int) -> None:
        super().__init__(0, 1)
        self.steps: list[bytes] = []
        self.signal_at: int | None = signal_at

    def broadcast_bytes(self, tag: int, payload: bytes | None, idle=None) -> bytes:
        if len(self.steps) == self.signal_at:
            self.signal_at = None
            os.kill(os.getpid(), signal.SIGTERM)
        self.steps.append(payload)
        return payload


class RouterThatShutsDrains(FakeLink):
    """The router's side of a drain: a worker that holds nothing is told to shut down."""

    def send(self, msg) -> None:
        super().send(msg)
        if isinstance(msg, Drain):
            self.inbox.append(Shutdown())


class Leader(WorkerBase):
    """Rank 0's shell: tick 1 opens a row and fills it, tick 2 frees and closes it."""

    role = "prefill"

    def __init__(self, tmp_path, group: TpGroup) -> None:
        super().__init__("p0", RouterThatShutsDrains())
        self.tmp_path, self.group, self.ticks = tmp_path, group, 0

    def build(self) -> None:
        self.cache = LeaderKvCache(64, 4, layout=CFG.kv_layout(True),
                                   log_path=self.tmp_path / "p0.freelog", node="p0",
                                   lockstep=Lockstep(self.group))
        self.tp = TpLeader(self.cache)

    def tick(self) -> bool:
        self.ticks += 1
        if self.ticks == 1:
            self.row = self.cache.open_row("r1")
            self.cache.extend(self.row, 9)
        elif self.ticks == 2:
            self.cache.free_kv_row(self.row, [(0, 9)], reason="sent")
            self.cache.close_row(self.row)
        self.lockstep.send("idle")  # as a pass does: the ops so far go out with it
        return True

    def on_req(self, req) -> None: ...
    def on_abort(self, rid) -> None: ...
    def abandon(self, detail) -> None: ...

    def shutdown(self) -> None:
        self.cache.close()


@pytest.mark.parametrize("drain", [True, False], ids=["drains", "second-sigterm"])
def test_sigterm_inside_rank_0s_broadcast_stops_after_the_step_and_the_follower_closes_clean(
        tmp_path, model, monkeypatch, drain):
    if not drain:   # the drain hook already spent: this SIGTERM stops the process
        monkeypatch.setattr(stop_signals, "drain_with", lambda hook: None)
    group = SignalledGroup(signal_at=2)  # broadcasts: tick 1's, the heartbeat's, tick 2's
    leader = Leader(tmp_path, group)
    leader.start(ServeConfig())
    if drain:   # a serving worker drains: it asks the router and stops at its Shutdown
        leader._loop()
        assert leader.drain_asked and leader.stopping
        assert any(isinstance(m, Drain) for m in leader.link.sent)
        assert leader.ticks == 3  # the signalled step ran to its end, one more before the
    else:                         # router's answer was read
        with pytest.raises(SystemExit) as stopped:
            leader._loop()
        assert stopped.value.code == 128 + signal.SIGTERM
        assert leader.ticks == 2  # the signalled step ran to its end; no step after it
    leader.close()

    follower = KvCache(64, 4, layout=CFG.kv_layout(True), log_path=tmp_path / "p0.tp1.freelog",
                       node="p0/tp1")
    mirror = Mirror(ModelRunner(model, follower), 1, group=TpGroup.solo())
    assert all(mirror.apply(step) for step in group.steps[:-1])
    assert not mirror.apply(group.steps[-1])  # the last step is the stop
    for name in ("p0.freelog", "p0.tp1.freelog"):
        report = replay_file(tmp_path / name)
        assert report.ok and report.closed, report.format()
        with FreeLogReader(tmp_path / name) as log:
            assert [e.get("reason") for e in log.records if e["op"] == "free"] == ["sent"]


def test_a_stop_signal_outside_a_step_is_raised_at_once_and_sigint_is_keyboard_interrupt():
    with pytest.raises(SystemExit) as stopped:
        os.kill(os.getpid(), signal.SIGTERM)
        signal.pause()  # not reached: the handler raised
    assert stopped.value.code == 128 + signal.SIGTERM
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with stop_signals.held():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)  # a second one: still after the step
            reached.append(True)
    assert reached == [True]


def test_the_first_sigterm_of_a_serving_worker_only_asks_it_to_drain():
    asked = []
    stop_signals.drain_with(lambda: asked.append(True))
    try:
        with stop_signals.held():
            os.kill(os.getpid(), signal.SIGTERM)    # noted by the hook, nothing raised
        assert asked == [True]
        with pytest.raises(SystemExit):             # the second one stops the process
            os.kill(os.getpid(), signal.SIGTERM)
            signal.pause()
        assert asked == [True]
    finally:
        stop_signals.drain_with(None)
