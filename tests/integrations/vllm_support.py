"""Shared by the tests that need vLLM: the skip when it is not importable, and the model."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(
    not HAVE_VLLM,
    reason="vLLM is not installed in this venv (it lives in .venv-vllm: `make test-vllm` sets it up and runs these)",
)

# A Hugging Face checkpoint vLLM can load (SmolLM2-135M-Instruct in fp32, converted from the
# GGUF the suite fetches); PDGRPC_VLLM_MODEL overrides where it is.
MODEL = Path(os.environ.get("PDGRPC_VLLM_MODEL", ".cache/models/smollm2-hf"))
