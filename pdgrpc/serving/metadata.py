"""The metadata row layout both servers use.

Prefill writes rows of this layout from its send buffer into decode's rows; both must
build it the same way (the row size is checked against the decode's descriptor at
handshake time). ``top_k`` is the engine's :data:`~pdgrpc.engine.base.MAX_TOP_LOGPROBS`
so any ``sampling.top_logprobs`` a request may ask for fits the row.
"""

from __future__ import annotations

from pdgrpc.engine.base import MAX_TOP_LOGPROBS, Engine, SampledToken
from pdgrpc.engine.layout import PROTOCOL_VERSION, compat_hash
from pdgrpc.state.metadata import MetadataLayout, MetadataRow

__all__ = ["compat_hash_bytes", "metadata_layout", "row_from_token"]


def metadata_layout() -> MetadataLayout:
    """The row layout of every pdgrpc server (prefill send buffer and decode slots)."""
    return MetadataLayout(top_k=MAX_TOP_LOGPROBS)


def row_from_token(token: SampledToken, cached_tokens: int = 0) -> MetadataRow:
    """The metadata row carrying prefill's first token (``bootstrap_room`` is written separately, last)."""
    return MetadataRow(
        output_id=token.token_id,
        cached_tokens=cached_tokens,
        output_token_logprob_value=token.logprob,
        output_token_logprob_index=token.token_id,
        top_logprobs_values=tuple(token.top_logprobs),
        top_logprobs_indices=tuple(token.top_ids),
    )


def compat_hash_bytes(engine: Engine, protocol_version: int = PROTOCOL_VERSION) -> bytes:
    """The engine's compatibility hash under ``protocol_version`` as the bytes that travel
    in ``ParallelInfo`` and ``HandshakeRequest.compatibility_hash`` (the hex digest
    decoded; 32 bytes)."""
    return bytes.fromhex(compat_hash(engine.kv_layout, engine.model_id, protocol_version))
