"""pdgrpc: move an LLM request's KV cache from a prefill engine to a decode engine.

Control plane: gRPC services defined in ``protos/pdgrpc/v1`` (generated code in
``pdgrpc.v1``). Data plane: pluggable transports (``pdgrpc.transport``). Decode and
prefill bookkeeping: pure state machines (``pdgrpc.state``). See DESIGN.md.
"""

from pdgrpc.errors import PdgrpcError
from pdgrpc.kvpoll import KVPoll

__all__ = ["KVPoll", "PdgrpcError", "__version__"]
__version__ = "0.1.0"
