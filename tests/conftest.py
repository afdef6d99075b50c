"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest
import torch

from common.model import Model
from tests.model_helpers import F64
from tests.zmq_leaks import ZmqTracker

# One torch thread in the test process, as every worker has (``--threads 1``): references
# are computed here while worker processes run on the same two cores, and two OpenMP
# threads then wait on each other's slices. test_attacks' float64 reference took 30 s on
# two threads and 8 s on one at load 3.5 (92 s on two at load 6, 7 s quiet). Tests of the
# page copier set its own thread count (``set_copy_threads``), which this does not touch.
torch.set_num_threads(1)


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


@pytest.fixture(scope="session")
def real_model_dir():
    """SmolLM2-135M-Instruct as a float32 Hugging Face checkpoint directory, converted once
    (tests/real_model.py); skips, saying why, where its package is not installed."""
    from tests.real_model import checkpoint_dir, missing_reason

    if why := missing_reason():
        pytest.skip(why)
    return checkpoint_dir()
