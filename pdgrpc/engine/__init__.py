"""The engine side of pdgrpc: the interface an LLM engine implements, and a reference one.

- :mod:`pdgrpc.engine.base` -- :class:`Engine` (what the prefill and decode servers call,
  and when), request/response data types, :func:`stop_reason`.
- :mod:`pdgrpc.engine.layout` -- the KV pool byte layout and the compatibility hash.
- :mod:`pdgrpc.engine.reference` -- :class:`ReferenceEngine`, a tiny deterministic
  transformer with a paged KV cache (no downloads), TP-ready.
- :mod:`pdgrpc.engine.colocated` -- :func:`generate`, colocated generation: the output
  disaggregated serving must reproduce token for token.
- :mod:`pdgrpc.engine.tp` -- all-reduce callables for tensor parallelism.
- :mod:`pdgrpc.engine.hf` -- :class:`~pdgrpc.engine.hf.engine.HFEngine`, a Hugging Face
  decoder checkpoint from a local directory (``--model PATH``) on the same paged KV pool.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Names load on first use (PEP 562): `pdgrpc.engine.tokenizer` (the router's) must
# not pull in torch through this package's other modules.
_EXPORTS = {
    "DecodeRequest": "pdgrpc.engine.base",
    "Engine": "pdgrpc.engine.base",
    "InvalidRequest": "pdgrpc.engine.base",
    "PrefillRequest": "pdgrpc.engine.base",
    "SampledToken": "pdgrpc.engine.base",
    "SamplingParams": "pdgrpc.engine.base",
    "stop_reason": "pdgrpc.engine.base",
    "Generation": "pdgrpc.engine.colocated",
    "generate": "pdgrpc.engine.colocated",
    "KVLayout": "pdgrpc.engine.layout",
    "compat_hash": "pdgrpc.engine.layout",
    "ModelConfig": "pdgrpc.engine.config",
    "EngineConfig": "pdgrpc.engine.config",
    "ReferenceEngine": "pdgrpc.engine.reference",
    "BOS_ID": "pdgrpc.engine.tokenizer",
    "EOS_ID": "pdgrpc.engine.tokenizer",
    "ByteTokenizer": "pdgrpc.engine.tokenizer",
}

if TYPE_CHECKING:  # for type checkers and IDEs; at run time names load on first use
    from pdgrpc.engine.base import (
        DecodeRequest,
        Engine,
        InvalidRequest,
        PrefillRequest,
        SampledToken,
        SamplingParams,
        stop_reason,
    )
    from pdgrpc.engine.colocated import Generation, generate
    from pdgrpc.engine.layout import KVLayout, compat_hash
    from pdgrpc.engine.config import EngineConfig, ModelConfig
    from pdgrpc.engine.reference import ReferenceEngine
    from pdgrpc.engine.tokenizer import BOS_ID, EOS_ID, ByteTokenizer

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "ByteTokenizer",
    "DecodeRequest",
    "Engine",
    "EngineConfig",
    "Generation",
    "InvalidRequest",
    "KVLayout",
    "ModelConfig",
    "PrefillRequest",
    "ReferenceEngine",
    "SampledToken",
    "SamplingParams",
    "compat_hash",
    "generate",
    "stop_reason",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
