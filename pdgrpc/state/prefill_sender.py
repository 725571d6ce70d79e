"""The prefill-side machine of one request's transfer, h11 style.

::

    WAITING_FOR_DESTINATION --DestinationReceived--> WAITING_FOR_INPUT
    WAITING_FOR_INPUT --ChunkDone--> TRANSFERRING --ChunkDone/PagesWritten--> TRANSFERRING
    TRANSFERRING --(last chunk seen, every page write completed)--> SENDING_METADATA
    SENDING_METADATA --MetadataWritten--> SUCCESS
    (any non-terminal) --Fail--> FAILED

After each prefill chunk the sender emits a :class:`WritePages` action for the pages that
the chunk **completed**; a partially filled last page is held back until the final chunk
(a later chunk would add tokens to it, and decode must never see a half-written page as
final). The metadata row goes **last**, only after every page write has completed, as a
:class:`WriteMetadata` action (the driver writes the payload, then ``bootstrap_room``).

:meth:`PrefillSender.create` applies the dp rules first: under strict
``follow_bootstrap_room`` a request whose actual rank differs from ``room % dp_size`` (an
external ``routed_dp_rank`` overrode it) starts FAILED with a message saying so, unless
force-query mode is on; when decode must query, the first action is :class:`RegisterDpRank`.

:meth:`PrefillSender.poll` maps the state onto :class:`~pdgrpc.kvpoll.KVPoll`.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Union

from pdgrpc.errors import ConfigError, IllegalTransition
from pdgrpc.kvpoll import KVPoll
from pdgrpc.state.config import DpConfig, SenderDeadlines
from pdgrpc.state.dp_rank import DpRankConflict, check_prefill_dispatch

__all__ = [
    "ChunkDone",
    "DestinationReceived",
    "Fail",
    "MetadataWritten",
    "PagesWritten",
    "PrefillSender",
    "RegisterDpRank",
    "SenderAction",
    "SenderEvent",
    "SenderFailReason",
    "SenderState",
    "SENDER_TRANSITIONS",
    "WriteMetadata",
    "WritePages",
]


class SenderState(enum.Enum):
    WAITING_FOR_DESTINATION = "waiting_for_destination"
    WAITING_FOR_INPUT = "waiting_for_input"
    TRANSFERRING = "transferring"
    SENDING_METADATA = "sending_metadata"
    SUCCESS = "success"
    FAILED = "failed"


class SenderFailReason(enum.Enum):
    DP_RANK_CONFLICT = "dp_rank_conflict"
    BAD_DESTINATION = "bad_destination"
    TRANSFER_FAILED = "transfer_failed"
    CANCELLED = "cancelled"
    WAITING_FOR_DESTINATION_TIMEOUT = "waiting_for_destination_timeout"
    WAITING_FOR_INPUT_TIMEOUT = "waiting_for_input_timeout"
    TRANSFER_TIMEOUT = "transfer_timeout"


# -- events --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DestinationReceived:
    """Decode's handshake: where the pages and the metadata row go."""

    dst_pages: tuple[int, ...]
    slot: int


@dataclasses.dataclass(frozen=True)
class ChunkDone:
    """Prefill computed the prompt up to ``tokens_done`` (cumulative); ``last`` on the final chunk."""

    tokens_done: int
    last: bool = False


@dataclasses.dataclass(frozen=True)
class PagesWritten:
    """The transport completed ``count`` page writes."""

    count: int


@dataclasses.dataclass(frozen=True)
class MetadataWritten:
    """The metadata row (room last) landed."""


@dataclasses.dataclass(frozen=True)
class Fail:
    reason: SenderFailReason
    message: str


SenderEvent = Union[DestinationReceived, ChunkDone, PagesWritten, MetadataWritten, Fail]


# -- actions -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RegisterDpRank:
    room: int
    dp_rank: int


@dataclasses.dataclass(frozen=True)
class WritePages:
    """Write local pages ``src`` into decode pages ``dst`` (same length, in order)."""

    room: int
    src: tuple[int, ...]
    dst: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class WriteMetadata:
    """Write this request's metadata row into decode slot ``slot``: payload, then the room."""

    room: int
    slot: int


SenderAction = Union[RegisterDpRank, WritePages, WriteMetadata]

T = SenderState
_NON_TERMINAL = (T.WAITING_FOR_DESTINATION, T.WAITING_FOR_INPUT, T.TRANSFERRING, T.SENDING_METADATA)
SENDER_TRANSITIONS: dict[tuple[SenderState, type], frozenset[SenderState]] = {
    (T.WAITING_FOR_DESTINATION, DestinationReceived): frozenset({T.WAITING_FOR_INPUT, T.FAILED}),
    (T.WAITING_FOR_INPUT, ChunkDone): frozenset({T.TRANSFERRING}),
    (T.TRANSFERRING, ChunkDone): frozenset({T.TRANSFERRING, T.SENDING_METADATA}),
    (T.TRANSFERRING, PagesWritten): frozenset({T.TRANSFERRING, T.SENDING_METADATA}),
    (T.SENDING_METADATA, MetadataWritten): frozenset({T.SUCCESS}),
    **{(s, Fail): frozenset({T.FAILED}) for s in _NON_TERMINAL},
}
"""(state, event type) -> the states the event may lead to (the table of what is legal)."""

_POLL = {
    T.WAITING_FOR_DESTINATION: KVPoll.BOOTSTRAPPING,
    T.WAITING_FOR_INPUT: KVPoll.WAITING_FOR_INPUT,
    T.TRANSFERRING: KVPoll.TRANSFERRING,
    T.SENDING_METADATA: KVPoll.TRANSFERRING,
    T.SUCCESS: KVPoll.SUCCESS,
    T.FAILED: KVPoll.FAILED,
}
_TIMEOUT = {
    T.WAITING_FOR_DESTINATION: SenderFailReason.WAITING_FOR_DESTINATION_TIMEOUT,
    T.WAITING_FOR_INPUT: SenderFailReason.WAITING_FOR_INPUT_TIMEOUT,
    T.TRANSFERRING: SenderFailReason.TRANSFER_TIMEOUT,
    T.SENDING_METADATA: SenderFailReason.TRANSFER_TIMEOUT,
}


class PrefillSender:
    """One request on one prefill rank. Build it with :meth:`create`."""

    def __init__(
        self, room: int, src_pages: tuple[int, ...], num_tokens: int, page_size: int, now: float, deadlines: SenderDeadlines
    ) -> None:
        if room <= 0:
            raise ConfigError(f"room must be > 0, got {room}")
        if page_size <= 0:
            raise ConfigError(f"page_size must be > 0, got {page_size}")
        if num_tokens <= 0:
            raise ConfigError(f"num_tokens must be > 0, got {num_tokens}")
        needed = -(-num_tokens // page_size)
        if len(src_pages) != needed:
            raise ConfigError(f"src_pages has {len(src_pages)} pages, {num_tokens} tokens at page_size {page_size} need {needed}")
        self.room = room
        self.src_pages = tuple(src_pages)
        self.num_tokens = num_tokens
        self.page_size = page_size
        self.deadlines = deadlines
        self.state = T.WAITING_FOR_DESTINATION
        self.deadline = now + deadlines.waiting_for_destination_s
        self.dst_pages: tuple[int, ...] = ()
        self.slot: int | None = None
        self.tokens_done = 0
        self.pages_sent = 0  # pages handed to the transport
        self.pages_written = 0  # page writes completed
        self.last_chunk_seen = False
        self.failure: Fail | None = None

    @classmethod
    def create(
        cls,
        room: int,
        src_pages: tuple[int, ...],
        num_tokens: int,
        page_size: int,
        now: float,
        *,
        dp_rank: int = 0,
        method_follows_room: bool = True,
        dp: DpConfig | None = None,
        deadlines: SenderDeadlines | None = None,
    ) -> tuple["PrefillSender", list[SenderAction]]:
        """A sender plus its first actions, after the dp rules (see the module docstring)."""
        s = cls(room, src_pages, num_tokens, page_size, now, deadlines or SenderDeadlines())
        try:
            decision = check_prefill_dispatch(room, dp_rank, method_follows_room, dp or DpConfig())
        except DpRankConflict as exc:
            s._enter(T.FAILED, now)
            s.failure = Fail(SenderFailReason.DP_RANK_CONFLICT, str(exc))
            return s, []
        return s, [RegisterDpRank(room, dp_rank)] if decision.register else []

    @property
    def is_terminal(self) -> bool:
        return self.state in (T.SUCCESS, T.FAILED)

    def poll(self) -> KVPoll:
        return _POLL[self.state]

    def handle(self, event: SenderEvent, now: float) -> list[SenderAction]:
        if (self.state, type(event)) not in SENDER_TRANSITIONS:
            raise IllegalTransition(f"room {self.room}: sender event {type(event).__name__} is not allowed in state {self.state.name}")
        if isinstance(event, Fail):
            self.failure = event
            self._enter(T.FAILED, now)
            return []
        if isinstance(event, DestinationReceived):
            return self._destination(event, now)
        if isinstance(event, ChunkDone):
            return self._chunk(event, now)
        if isinstance(event, PagesWritten):
            if event.count <= 0 or self.pages_written + event.count > self.pages_sent:
                raise IllegalTransition(
                    f"room {self.room}: PagesWritten({event.count}) but only {self.pages_sent - self.pages_written} writes are outstanding"
                )
            self.pages_written += event.count
            return self._maybe_metadata(now)
        assert isinstance(event, MetadataWritten)
        self._enter(T.SUCCESS, now)
        return []

    def tick(self, now: float) -> Fail | None:
        if self.is_terminal or now <= self.deadline:
            return None
        ev = Fail(_TIMEOUT[self.state], f"room {self.room}: deadline exceeded in state {self.state.name}")
        self.handle(ev, now)
        return ev

    # -- internals ------------------------------------------------------------------------
    def _enter(self, state: SenderState, now: float) -> None:
        if state is not self.state:
            self.state = state
            d = self.deadlines
            limit = {
                T.WAITING_FOR_INPUT: d.waiting_for_input_s,
                T.TRANSFERRING: d.transferring_s,
                T.SENDING_METADATA: d.transferring_s,
            }.get(state)
            self.deadline = now + limit if limit is not None else float("inf")

    def _destination(self, ev: DestinationReceived, now: float) -> list[SenderAction]:
        if len(ev.dst_pages) != len(self.src_pages) or ev.slot < 0:
            self.failure = Fail(
                SenderFailReason.BAD_DESTINATION,
                f"room {self.room}: decode sent {len(ev.dst_pages)} destination pages and slot {ev.slot}; "
                f"the prompt needs exactly {len(self.src_pages)} pages and a slot >= 0",
            )
            self._enter(T.FAILED, now)
            return []
        self.dst_pages, self.slot = tuple(ev.dst_pages), ev.slot
        self._enter(T.WAITING_FOR_INPUT, now)
        return []

    def _chunk(self, ev: ChunkDone, now: float) -> list[SenderAction]:
        if self.last_chunk_seen:
            raise IllegalTransition(f"room {self.room}: ChunkDone after the last chunk")
        if not self.tokens_done < ev.tokens_done <= self.num_tokens:
            raise IllegalTransition(
                f"room {self.room}: ChunkDone.tokens_done={ev.tokens_done} must grow past {self.tokens_done} "
                f"and stay <= num_tokens={self.num_tokens}"
            )
        if ev.last != (ev.tokens_done == self.num_tokens):
            raise IllegalTransition(
                f"room {self.room}: ChunkDone(last={ev.last}) at tokens_done={ev.tokens_done} of {self.num_tokens}"
            )
        self.tokens_done = ev.tokens_done
        self.last_chunk_seen = ev.last
        # Completed pages only; the final chunk also releases the partial last page.
        upto = len(self.src_pages) if ev.last else ev.tokens_done // self.page_size
        actions: list[SenderAction] = []
        if upto > self.pages_sent:
            sl = slice(self.pages_sent, upto)
            actions.append(WritePages(self.room, self.src_pages[sl], self.dst_pages[sl]))
            self.pages_sent = upto
        self._enter(T.TRANSFERRING, now)
        return actions + self._maybe_metadata(now)

    def _maybe_metadata(self, now: float) -> list[SenderAction]:
        if self.last_chunk_seen and self.pages_written == self.pages_sent and self.state is T.TRANSFERRING:
            self._enter(T.SENDING_METADATA, now)
            assert self.slot is not None
            return [WriteMetadata(self.room, self.slot)]
        return []
