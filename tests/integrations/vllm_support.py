"""Shared by the tests that need vLLM: the skip when it is not importable."""

from __future__ import annotations

import importlib.util

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(
    not HAVE_VLLM,
    reason="vLLM is not installed in this venv (it lives in .venv-vllm: `make test-vllm` sets it up and runs these)",
)
