"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest

from common.model import Model
from tests.model_helpers import F64
from tests.zmq_leaks import ZmqTracker


@pytest.fixture(scope="session")
def model() -> Model:
    """The tiny float64 model, built once (its weights depend only on the seed)."""
    return Model(F64)


@pytest.fixture(autouse=True)
def no_leaked_zmq(monkeypatch):
    """Fail a test that leaves a ZMQ socket open or a context unterminated in this
    process (a leak the code under test would repeat in production); the leaked objects
    are closed so the next test starts clean."""
    tracker = ZmqTracker()
    tracker.install(monkeypatch)
    yield tracker
    if message := tracker.leaks():
        pytest.fail(message, pytrace=False)
