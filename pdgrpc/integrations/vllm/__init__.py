"""pdgrpc as vLLM's KV connector (docs/vllm.md).

Load it by path, with no patch to vLLM::

    --kv-transfer-config '{"kv_connector":"PdgrpcConnector",
                           "kv_connector_module_path":"pdgrpc.integrations.vllm",
                           "kv_role":"kv_both"}'

``PdgrpcConnector`` is imported on first access, so the front door
(:mod:`pdgrpc.integrations.vllm.proxy`) runs without vLLM; that import checks the
installed vLLM's version (:mod:`pdgrpc.integrations.vllm.version`) and fails naming it
when unsupported.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PdgrpcConnector"]


def __getattr__(name: str) -> Any:
    if name == "PdgrpcConnector":
        from pdgrpc.integrations.vllm.connector import PdgrpcConnector

        return PdgrpcConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
