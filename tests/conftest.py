"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest

from common.model import Model
from tests.model_helpers import F64


@pytest.fixture(scope="session")
def model() -> Model:
    """The tiny float64 model, built once (its weights depend only on the seed)."""
    return Model(F64)
