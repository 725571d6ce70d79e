"""Engine test fixtures (helpers live in engine_helpers.py)."""

from __future__ import annotations

import pytest

from engine_helpers import make_engine
from pdgrpc.engine import ReferenceEngine


@pytest.fixture(scope="module")
def engine() -> ReferenceEngine:
    return make_engine()
