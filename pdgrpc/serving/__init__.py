"""Server utilities shared by ``pdgrpc.prefill``, ``pdgrpc.decode`` and ``pdgrpc.router``.

Kept deliberately small:

* :mod:`pdgrpc.serving.flags` -- the command-line flags every server has in common
  (engine shape, transport, logging) and their mapping to config objects. Prefill and
  decode must build *identical* engines (same compatibility hash), so both take their
  engine from :func:`engine_config_from_args`.
* :mod:`pdgrpc.serving.logs` -- logging set-up and the one-line-per-request-event helper.
* :mod:`pdgrpc.serving.convert` -- :class:`pdgrpc.v1.common_pb2.SamplingParams` <->
  :class:`pdgrpc.engine.base.SamplingParams`.
* :mod:`pdgrpc.serving.metadata` -- the metadata row layout both servers build
  (:func:`metadata_layout`), the row carrying prefill's first token, and the
  compatibility hash as wire bytes (:func:`compat_hash_bytes`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Names load on first use (PEP 562): `import pdgrpc.serving.logs` must not import
# torch (via flags -> engine), or the router, which needs only logging, starts in seconds.
_EXPORTS = {
    "sampling_from_proto": "pdgrpc.serving.convert",
    "sampling_to_proto": "pdgrpc.serving.convert",
    "add_engine_arguments": "pdgrpc.serving.flags",
    "add_logging_arguments": "pdgrpc.serving.flags",
    "add_transport_arguments": "pdgrpc.serving.flags",
    "create_transport": "pdgrpc.serving.flags",
    "engine_config_from_args": "pdgrpc.serving.flags",
    "transport_options_from_args": "pdgrpc.serving.flags",
    "tune_malloc_from_args": "pdgrpc.serving.flags",
    "request_event": "pdgrpc.serving.logs",
    "setup_logging": "pdgrpc.serving.logs",
    "compat_hash_bytes": "pdgrpc.serving.metadata",
    "metadata_layout": "pdgrpc.serving.metadata",
    "row_from_token": "pdgrpc.serving.metadata",
}

if TYPE_CHECKING:  # for type checkers and IDEs; at run time names load on first use
    from pdgrpc.serving.convert import sampling_from_proto, sampling_to_proto
    from pdgrpc.serving.flags import (
        add_engine_arguments,
        add_logging_arguments,
        add_transport_arguments,
        create_transport,
        engine_config_from_args,
        transport_options_from_args,
        tune_malloc_from_args,
    )
    from pdgrpc.serving.logs import request_event, setup_logging
    from pdgrpc.serving.metadata import compat_hash_bytes, metadata_layout, row_from_token

__all__ = [
    "add_engine_arguments",
    "add_logging_arguments",
    "add_transport_arguments",
    "compat_hash_bytes",
    "create_transport",
    "engine_config_from_args",
    "metadata_layout",
    "request_event",
    "row_from_token",
    "sampling_from_proto",
    "sampling_to_proto",
    "setup_logging",
    "transport_options_from_args",
    "tune_malloc_from_args",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
