"""Pure transfer state machines: poll rules, metadata slots, pages, the decode request and
queues, dp-rank rules, and the prefill sender.

Nothing here does I/O, starts a thread, or reads a clock: time is an argument, and I/O
leaves as returned actions for a driver to carry out (h11's model). Drivers: the decode
and prefill servers.
"""

from pdgrpc.kvpoll import KVPoll
from pdgrpc.state.config import DecodeDeadlines, DpConfig, SenderDeadlines
from pdgrpc.state.decode_queues import DecodeQueues, NewRequest, Outcome, SendHandshake
from pdgrpc.state.decode_request import DecodeRequest, DecodeState
from pdgrpc.state.dp_rank import DpRankConflict, DpRankResolver, QueryDpRanks, check_prefill_dispatch, resolve_locally
from pdgrpc.state.metadata import MetadataBuffers, MetadataLayout, MetadataRow
from pdgrpc.state.outcomes import AbortReason, Aborted, Committed
from pdgrpc.state.pages import PageAllocator
from pdgrpc.state.poll import RoomStatusTable, advance, combine
from pdgrpc.state.prefill_sender import PrefillSender, SenderState
from pdgrpc.state.slots import SlotAllocator
from pdgrpc.state.transfer_poll import AllReduceMin, identity_reduce

__all__ = [
    "AbortReason",
    "Aborted",
    "AllReduceMin",
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
    "RoomStatusTable",
    "SendHandshake",
    "SenderDeadlines",
    "SenderState",
    "SlotAllocator",
    "advance",
    "check_prefill_dispatch",
    "combine",
    "identity_reduce",
    "resolve_locally",
]
