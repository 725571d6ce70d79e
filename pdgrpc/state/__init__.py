"""Pure transfer state machines: poll rules, metadata slots, pages, the decode request and
queues, dp-rank rules, and the prefill sender.

Nothing here does I/O, starts a thread, or reads a clock: time is an argument, and I/O
leaves as returned actions for a driver to carry out (h11's model). Drivers: the decode
and prefill servers.
"""

from typing import TYPE_CHECKING, Any

from pdgrpc.kvpoll import KVPoll
from pdgrpc.state.config import DecodeDeadlines, DpConfig, SenderDeadlines
from pdgrpc.state.decode_request import DecodeRequest, DecodeState
from pdgrpc.state.dp_rank import DpRankConflict, DpRankResolver, QueryDpRanks, check_prefill_dispatch, resolve_locally
from pdgrpc.state.outcomes import AbortReason, Aborted, Committed
from pdgrpc.state.pages import PageAllocator
from pdgrpc.state.poll import advance
from pdgrpc.state.prefill_sender import PrefillSender, SenderState

# The modules that hold tensors (and so import torch) load on first use of one of their
# names (PEP 562): `pdgrpc.state.outcomes` (AbortReason, which the router's metrics
# label aborts with) must not start torch in a process that has no tensor.
if TYPE_CHECKING:
    from pdgrpc.state.decode_queues import DecodeQueues, NewRequest, Outcome, SendHandshake
    from pdgrpc.state.metadata import MetadataBuffers, MetadataLayout, MetadataRow
    from pdgrpc.state.slots import SlotAllocator
    from pdgrpc.state.transfer_poll import identity_reduce

_TENSOR_NAMES = {
    "DecodeQueues": "decode_queues", "NewRequest": "decode_queues", "Outcome": "decode_queues", "SendHandshake": "decode_queues",
    "MetadataBuffers": "metadata", "MetadataLayout": "metadata", "MetadataRow": "metadata",
    "SlotAllocator": "slots",
    "identity_reduce": "transfer_poll",
}  # fmt: skip


def __getattr__(name: str) -> Any:
    # Static imports (no importlib): the purity test reads this package's imports.
    module = _TENSOR_NAMES.get(name)
    if module == "decode_queues":
        from pdgrpc.state import decode_queues

        return getattr(decode_queues, name)
    if module == "metadata":
        from pdgrpc.state import metadata

        return getattr(metadata, name)
    if module == "slots":
        from pdgrpc.state import slots

        return getattr(slots, name)
    if module == "transfer_poll":
        from pdgrpc.state import transfer_poll

        return getattr(transfer_poll, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "AbortReason",
    "Aborted",
    "Committed",
    "DecodeDeadlines",
    "DecodeQueues",
    "DecodeRequest",
    "DecodeState",
    "DpConfig",
    "DpRankConflict",
    "DpRankResolver",
    "KVPoll",
    "MetadataBuffers",
    "MetadataLayout",
    "MetadataRow",
    "NewRequest",
    "Outcome",
    "PageAllocator",
    "PrefillSender",
    "QueryDpRanks",
    "SendHandshake",
    "SenderDeadlines",
    "SenderState",
    "SlotAllocator",
    "advance",
    "check_prefill_dispatch",
    "identity_reduce",
    "resolve_locally",
]
