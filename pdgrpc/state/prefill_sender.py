"""The prefill-side machine of one request's transfer, h11 style.

::

    WAITING_FOR_DESTINATION --DestinationReceived--> WAITING_FOR_INPUT (or FAILED: bad destination)
    WAITING_FOR_INPUT --ChunkDone--> TRANSFERRING, or SENDING_METADATA on the last chunk
    TRANSFERRING --ChunkDone/PagesWritten--> TRANSFERRING
    TRANSFERRING --(last chunk seen, every page write completed)--> SENDING_METADATA
    SENDING_METADATA --MetadataWritten--> SUCCESS
    (any non-terminal) --Fail--> FAILED

Which pages go when. After each chunk the pages that chunks **completed** and that are
not written yet are *pending*; they go as one :class:`WritePages` once there are at least
``min_write_pages`` of them (every write has a fixed cost that small pieces do not earn
back). A partially filled last page is held back until the final chunk: a later chunk
adds tokens to it, and decode must never see a half-written page as final. The leading
pages the decode holds already (``cached_pages`` of its handshake) count as written: only
the rest go, and when the decode holds them all, the row goes alone.

Metadata last. On the final chunk the pages still pending (the partial page included)
go *with* the metadata row as one :class:`WriteMetadata`: the transport lands a row after
every earlier write of its room, the row's ``bootstrap_room`` last. If earlier page
writes are still outstanding, the rest of the pages go as a :class:`WritePages` and the
row waits for :class:`PagesWritten` of every one.

Deadlines (``deadline``, enforced by the driver through :meth:`PrefillSender.tick`): the
handshake (``waiting_for_destination_s``); the compute, from the destination or from the
previous chunk to the next chunk (``waiting_for_input_s``, restarted by each chunk); the
wire, from the last chunk to the decode's acknowledgement of the row (``transferring_s``).

:meth:`PrefillSender.poll` maps the state onto :class:`~pdgrpc.kvpoll.KVPoll`.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Union

from pdgrpc.errors import ConfigError, IllegalTransition
from pdgrpc.kvpoll import KVPoll
from pdgrpc.state.config import SenderDeadlines
from pdgrpc.state.room import Room

__all__ = [
    "ChunkDone",
    "DestinationReceived",
    "Fail",
    "MetadataWritten",
    "PagesWritten",
    "PrefillSender",
    "SenderAction",
    "SenderEvent",
    "SenderFailReason",
    "SenderState",
    "SENDER_TRANSITIONS",
    "WriteMetadata",
    "WritePages",
    "write_pages_for",
]


class SenderState(enum.Enum):
    WAITING_FOR_DESTINATION = "waiting_for_destination"
    WAITING_FOR_INPUT = "waiting_for_input"
    TRANSFERRING = "transferring"
    SENDING_METADATA = "sending_metadata"
    SUCCESS = "success"
    FAILED = "failed"


class SenderFailReason(enum.Enum):
    BAD_DESTINATION = "bad_destination"
    TRANSFER_FAILED = "transfer_failed"
    CANCELLED = "cancelled"
    WAITING_FOR_DESTINATION_TIMEOUT = "waiting_for_destination_timeout"
    WAITING_FOR_INPUT_TIMEOUT = "waiting_for_input_timeout"
    TRANSFER_TIMEOUT = "transfer_timeout"


# -- events --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DestinationReceived:
    """Decode's handshake: where the pages and the metadata row go. The decode holds the
    first ``cached_pages`` pages already: they are never written."""

    dst_pages: tuple[int, ...]
    slot: int
    cached_pages: int = 0


@dataclasses.dataclass(frozen=True)
class ChunkDone:
    """Prefill computed the prompt up to ``tokens_done`` (cumulative); ``last`` on the final chunk."""

    tokens_done: int
    last: bool = False


@dataclasses.dataclass(frozen=True)
class PagesWritten:
    """The transport completed (for an ordered transport: queued) ``count`` page writes."""

    count: int


@dataclasses.dataclass(frozen=True)
class MetadataWritten:
    """The metadata row (room last) landed: the decode acknowledged the transfer."""


@dataclasses.dataclass(frozen=True)
class Fail:
    reason: SenderFailReason
    message: str


SenderEvent = Union[DestinationReceived, ChunkDone, PagesWritten, MetadataWritten, Fail]


# -- actions -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class WritePages:
    """Write local pages ``src`` into decode pages ``dst`` (same length, in order)."""

    room: int
    src: tuple[int, ...]
    dst: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class WriteMetadata:
    """The final write: local pages ``src`` into decode pages ``dst`` (possibly none),
    then this request's metadata row into decode slot ``slot`` (payload, then the room)."""

    room: int
    slot: int
    src: tuple[int, ...] = ()
    dst: tuple[int, ...] = ()


SenderAction = Union[WritePages, WriteMetadata]

T = SenderState
_NON_TERMINAL = (T.WAITING_FOR_DESTINATION, T.WAITING_FOR_INPUT, T.TRANSFERRING, T.SENDING_METADATA)
SENDER_TRANSITIONS: dict[tuple[SenderState, type], frozenset[SenderState]] = {
    (T.WAITING_FOR_DESTINATION, DestinationReceived): frozenset({T.WAITING_FOR_INPUT, T.FAILED}),
    (T.WAITING_FOR_INPUT, ChunkDone): frozenset({T.TRANSFERRING, T.SENDING_METADATA}),
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


def write_pages_for(min_write_bytes: int, page_nbytes: int) -> int:
    """``min_write_bytes`` in whole pages of ``page_nbytes`` (rounded up): the
    ``min_write_pages`` of a sender, and when a compute posts a chunk."""
    if page_nbytes <= 0:
        raise ConfigError(f"page_nbytes must be > 0, got {page_nbytes}")
    return -(-max(0, min_write_bytes) // page_nbytes)


class PrefillSender:
    """One request on one prefill rank. Build it with :meth:`create`."""

    def __init__(
        self, room: Room, src_pages: tuple[int, ...], num_tokens: int, page_size: int, now: float, deadlines: SenderDeadlines,
        min_write_pages: int = 1,
    ) -> None:
        if page_size <= 0:
            raise ConfigError(f"page_size must be > 0, got {page_size}")
        if num_tokens <= 0:
            raise ConfigError(f"num_tokens must be > 0, got {num_tokens}")
        if min_write_pages < 0:
            raise ConfigError(f"min_write_pages must be >= 0, got {min_write_pages}")
        needed = -(-num_tokens // page_size)
        if len(src_pages) != needed:
            raise ConfigError(f"src_pages has {len(src_pages)} pages, {num_tokens} tokens at page_size {page_size} need {needed}")
        self.room = room
        self.src_pages = tuple(src_pages)
        self.num_tokens = num_tokens
        self.page_size = page_size
        self.deadlines = deadlines
        self.min_write_pages = min_write_pages
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
        room: Room,
        src_pages: tuple[int, ...],
        num_tokens: int,
        page_size: int,
        now: float,
        *,
        deadlines: SenderDeadlines | None = None,
        min_write_pages: int = 1,
    ) -> "PrefillSender":
        """A sender waiting for its destination (the prefill's dispatcher applied the dp
        rules before the request reached this rank)."""
        return cls(room, src_pages, num_tokens, page_size, now, deadlines or SenderDeadlines(), min_write_pages)

    @property
    def is_terminal(self) -> bool:
        return self.state in (T.SUCCESS, T.FAILED)

    def poll(self) -> KVPoll:
        return _POLL[self.state]

    def planned_final_write(self) -> WriteMetadata | None:
        """The :class:`WriteMetadata` the final chunk will emit, when it is known now:
        the destination is in and no chunk before the last can complete
        ``min_write_pages`` pages, so the whole prompt goes in that one write (a driver
        may plan its messages while the prompt computes). None otherwise."""
        if self.state is not T.WAITING_FOR_INPUT or self.slot is None:
            return None
        most_before_last = (self.num_tokens - 1) // self.page_size  # complete pages any earlier chunk can hold
        if most_before_last > 0 and most_before_last >= max(1, self.min_write_pages):
            return None
        return WriteMetadata(self.room, self.slot, self.src_pages[self.pages_sent :], self.dst_pages[self.pages_sent :])

    def handle(self, event: SenderEvent, now: float) -> list[SenderAction]:
        """Apply ``event``; the actions the driver must carry out, in order. An event the
        state does not accept raises :class:`~pdgrpc.errors.IllegalTransition` and
        changes nothing."""
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
        """The timer event: past :attr:`deadline`, fail with the phase's timeout reason
        and return that failure; None while in time (or terminal)."""
        if self.is_terminal or now <= self.deadline:
            return None
        ev = Fail(self._timeout_reason(), f"room {self.room}: deadline exceeded in state {self.state.name}")
        self.handle(ev, now)
        return ev

    # -- internals ------------------------------------------------------------------------
    def _computing(self) -> bool:
        return self.state is T.WAITING_FOR_INPUT or (self.state is T.TRANSFERRING and not self.last_chunk_seen)

    def _timeout_reason(self) -> SenderFailReason:
        if self.state is T.WAITING_FOR_DESTINATION:
            return SenderFailReason.WAITING_FOR_DESTINATION_TIMEOUT
        return SenderFailReason.WAITING_FOR_INPUT_TIMEOUT if self._computing() else SenderFailReason.TRANSFER_TIMEOUT

    def _enter(self, state: SenderState, now: float) -> None:
        self.state = state
        self._arm(now)

    def _arm(self, now: float) -> None:
        """Start the current phase's deadline at ``now``."""
        d = self.deadlines
        if self.is_terminal:
            self.deadline = float("inf")
        elif self.state is T.WAITING_FOR_DESTINATION:
            self.deadline = now + d.waiting_for_destination_s
        else:
            self.deadline = now + (d.waiting_for_input_s if self._computing() else d.transferring_s)

    def _destination(self, ev: DestinationReceived, now: float) -> list[SenderAction]:
        if len(ev.dst_pages) != len(self.src_pages) or ev.slot < 0 or not 0 <= ev.cached_pages <= len(ev.dst_pages):
            self.failure = Fail(
                SenderFailReason.BAD_DESTINATION,
                f"room {self.room}: decode sent {len(ev.dst_pages)} destination pages ({ev.cached_pages} of them cached) "
                f"and slot {ev.slot}; the prompt needs exactly {len(self.src_pages)} pages, at most that many cached, "
                "and a slot >= 0",
            )
            self._enter(T.FAILED, now)
            return []
        self.dst_pages, self.slot = tuple(ev.dst_pages), ev.slot
        # The decode's cached pages count as sent and written: only the rest go.
        self.pages_sent = self.pages_written = ev.cached_pages
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
        self.state = T.TRANSFERRING
        if ev.last:
            # Every page still pending goes now, the partial last page included.
            rest = self._take(len(self.src_pages))
            if self.pages_written == self.pages_sent - len(rest[0]):
                # Nothing outstanding: the pages and the row in one write, the row last.
                self.pages_written = self.pages_sent
                self._enter(T.SENDING_METADATA, now)
                assert self.slot is not None
                return [WriteMetadata(self.room, self.slot, *rest)]
            self._arm(now)
            return [WritePages(self.room, *rest)] if rest[0] else []
        self._arm(now)
        complete = ev.tokens_done // self.page_size  # the partial page stays back
        if complete - self.pages_sent > 0 and complete - self.pages_sent >= self.min_write_pages:
            return [WritePages(self.room, *self._take(complete))]
        return []

    def _take(self, upto: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The pending pages up to page ``upto`` (local, destination); now sent."""
        sl = slice(self.pages_sent, upto)
        self.pages_sent = max(self.pages_sent, upto)
        return self.src_pages[sl], self.dst_pages[sl]

    def _maybe_metadata(self, now: float) -> list[SenderAction]:
        # While chunks still compute, a completed write leaves the compute deadline alone.
        if self.state is not T.TRANSFERRING or self._computing():
            return []
        if self.pages_written < self.pages_sent:
            self._arm(now)  # a completed write is progress on the wire
            return []
        self._enter(T.SENDING_METADATA, now)
        assert self.slot is not None
        return [WriteMetadata(self.room, self.slot)]
