"""The heartbeat thread of a worker (common/node/pulse.py) on its own: it beats only
while the loop computes, never while the loop holds the sockets, and stops beating once
a pass runs past ``max_busy_s``."""

from __future__ import annotations

import threading
import time

import pytest

from common.node.pulse import Pulse

pytestmark = pytest.mark.timeout(60)


class Beats:
    """A ``beat`` that records when it ran and whether the loop held the sockets then."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.loop_holds = threading.Event()   # set while the loop uses its sockets
        self.overlaps = 0

    def __call__(self) -> int:
        self.overlaps += self.loop_holds.is_set()
        self.times.append(time.monotonic())
        return 1


def test_beats_only_while_the_loop_computes_and_never_beside_it():
    beats = Beats()
    pulse = Pulse("w", beats, tick_s=0.02, max_busy_s=30.0)
    try:
        beats.loop_holds.set()
        time.sleep(0.3)                       # between passes: the loop's own heartbeats
        assert beats.times == []
        beats.loop_holds.clear()
        with pulse.computing():
            time.sleep(0.5)                   # a long pass
        beats.loop_holds.set()
        n = len(beats.times)
        time.sleep(0.3)
        assert n >= 5 and len(beats.times) == n   # beats during the pass, none after
        assert beats.overlaps == 0 and pulse.num_sent == n and pulse.num_hung == 0
    finally:
        pulse.close()


def test_a_pass_past_max_busy_s_is_hung_and_its_beats_stop():
    beats = Beats()
    pulse = Pulse("w", beats, tick_s=0.02, max_busy_s=0.3)
    try:
        with pulse.computing():
            time.sleep(0.8)
        assert beats.times and max(beats.times) - min(beats.times) < 0.35
        assert pulse.num_hung == 1
    finally:
        pulse.close()


def test_a_beat_that_raises_does_not_end_the_pulse():
    calls = []

    def beat() -> int:
        calls.append(1)
        raise OSError("socket gone")

    pulse = Pulse("w", beat, tick_s=0.02, max_busy_s=30.0)
    try:
        with pulse.computing():
            time.sleep(0.2)
        assert len(calls) >= 3
    finally:
        pulse.close()
