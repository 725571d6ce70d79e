"""The engine side of pdgrpc: the interface an LLM engine implements, and a reference one.

- :mod:`pdgrpc.engine.base` -- :class:`Engine` (what the prefill and decode servers call,
  and when), request/response data types, :func:`stop_reason`.
- :mod:`pdgrpc.engine.layout` -- the KV pool byte layout and the compatibility hash.
- :mod:`pdgrpc.engine.reference` -- :class:`ReferenceEngine`, a tiny deterministic
  transformer with a paged KV cache (no downloads), TP-ready.
- :mod:`pdgrpc.engine.colocated` -- :func:`generate`, colocated generation: the output
  disaggregated serving must reproduce token for token.
- :mod:`pdgrpc.engine.transfer_sim` -- :func:`copy_pages`, a transfer without a network.
- :mod:`pdgrpc.engine.tp` -- all-reduce callables for tensor parallelism.
"""

from pdgrpc.engine.base import (
    MAX_TOP_LOGPROBS,
    DecodeRequest,
    Engine,
    InvalidRequest,
    KVBuffers,
    PrefillRequest,
    SampledToken,
    SamplingParams,
    stop_reason,
)
from pdgrpc.engine.colocated import Generation, generate, prefill
from pdgrpc.engine.layout import PROTOCOL_VERSION, KVLayout, compat_hash, newly_complete_pages, pages_for_tokens
from pdgrpc.engine.model import ModelConfig
from pdgrpc.engine.reference import EngineConfig, ReferenceEngine
from pdgrpc.engine.tokenizer import BOS_ID, EOS_ID, ByteTokenizer
from pdgrpc.engine.transfer_sim import copy_pages

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "MAX_TOP_LOGPROBS",
    "PROTOCOL_VERSION",
    "ByteTokenizer",
    "DecodeRequest",
    "Engine",
    "EngineConfig",
    "Generation",
    "InvalidRequest",
    "KVBuffers",
    "KVLayout",
    "ModelConfig",
    "PrefillRequest",
    "ReferenceEngine",
    "SampledToken",
    "SamplingParams",
    "compat_hash",
    "copy_pages",
    "generate",
    "newly_complete_pages",
    "pages_for_tokens",
    "prefill",
    "stop_reason",
]
