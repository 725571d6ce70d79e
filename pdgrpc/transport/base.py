"""The transport plugin contract: what every data-plane backend (``fake``, ``tcp``,
``rdma``, third-party) implements, and the plain data types that cross it.

Roles
-----
One :class:`Transport` instance lives in each server process (prefill worker or decode
worker) and is driven from that process's single asyncio loop. The same instance can be
a *receiver* (decode: its KV pool and metadata rows are written into) and a *sender*
(prefill: it writes into a peer's memory); a process is usually one or the other.

Who calls which hook, and when
------------------------------
``register(regions)`` -- both sides, once at start-up (again if regions are added).
    The server hands over its KV pool tensors (one region per layer and K/V; pages are
    the first dimension, each page's bytes contiguous) and its metadata rows (one region;
    slots are the first dimension). Returns this instance's opaque **descriptor**
    (``bytes``), which the control plane carries in the handshake / bootstrap info.
    Descriptors are untrusted bytes to whoever receives them; :meth:`Descriptor.from_bytes`
    validates them and raises :class:`BadDescriptor`.

``connect(descriptor)`` -- the sender, when a handshake for a room arrives. Returns a
    :class:`Peer`. Connections are cached per peer *instance*: a descriptor whose
    ``instance_id`` differs from a cached one (the peer restarted, even on the same
    address) never reuses the old connection; the old one is closed and its rooms fail.
    Cheap to call for every room.

``advertise(grant)`` -- the receiver, after it allocated pages and a metadata slot for a
    room and before it sends the handshake. From then on the receiver accepts writes for
    that room only into exactly those pages (in every KV region) and that slot (in every
    metadata region); anything else is rejected, the room fails with a reason naming what
    was wrong, and nothing lands. Room state becomes ``WAITING_FOR_INPUT``.

``write(peer, room, ops, metadata=None)`` -- the sender, after each prefill chunk with
    the pages that chunk completed (build ``ops`` with :mod:`pdgrpc.transport.pages`),
    and with the last chunk passing ``metadata`` (the write of the room's metadata row).
    Returns once the writes are queued, not when they landed. The backend guarantees the
    metadata row becomes visible on the receiver only after every byte of every earlier
    ``write`` for that room has landed, so a receiver that sees the row sees the pages.

``poll(room)`` / ``status(room)`` -- the state machines, every scheduler iteration, on
    both sides. Sender: ``TRANSFERRING`` after the first ``write``, ``SUCCESS`` once the
    receiver acknowledged the metadata row. Receiver: ``WAITING_FOR_INPUT`` after
    ``advertise``, ``TRANSFERRING`` once bytes arrive, ``SUCCESS`` once the metadata row
    landed (after all pages); its acknowledgement to the sender goes out after the
    reactions that landing set off (:func:`after_reactions`), so the receiver's own
    reply to its client goes first. Either side: ``FAILED`` with ``status(room).reason``. A room
    only moves forward, ``FAILED`` always wins, terminal states stick. Polling a room the
    transport does not know raises :class:`UnknownRoom`. :meth:`Transport.wait` is an
    awaitable convenience over the same table.

``release(room)`` -- both sides, when the state machine is done with a room (committed,
    aborted, timed out). The receiver stops accepting writes for it (so a late write can
    never land in pages that now belong to another request) and forgets it.
    ``release_because(room, reason)`` (base class, for an aborted room) also keeps the
    reason for a while: a backend refuses a later write with
    :meth:`RoomTable.refusal`, so its sender reports why the room ended.

``fail_peer(instance_id, reason)`` -- the control plane, when its own liveness signal
    (bootstrap lease expired, heartbeat missed) says a peer is gone. Every non-terminal
    room that involves that peer fails at once with ``reason``, and the cached connection
    is dropped so the next ``connect`` builds a fresh one. Backends whose own channel
    does not notice peer death (``rdma`` with UCX error handling off) use
    :mod:`pdgrpc.transport.liveness` (a tiny heartbeat side channel whose address travels
    in :attr:`Descriptor.liveness`) and route its verdict into this same hook.

``close()`` -- both sides at shutdown. Fails every non-terminal room, closes every
    connection, and leaves no task, thread or file descriptor behind.

Errors
------
Backends map every library error (``OSError``, UCX exceptions, ...) to the tree in
:mod:`pdgrpc.errors` at this boundary: :class:`~pdgrpc.errors.PeerFailure` (peer gone),
:class:`~pdgrpc.errors.UnauthorizedWrite` (reason of a rejected room),
:class:`~pdgrpc.errors.TransportUnavailable` (backend cannot load),
:class:`~pdgrpc.errors.TransportError` (anything else). Per-room data-plane failures do
not raise from ``write``; they surface as ``FAILED`` in ``poll``.

Compatibility
-------------
This contract is relied upon by out-of-tree backends. Changes must stay backward
compatible: new data-type fields get defaults, new hooks get default implementations.
(Planned: strided writes for head-sliced TP transfers will be optional ``WriteOp``
fields with defaults meaning "one contiguous block".)

Source memory: a backend may read a write's source bytes at any time until the room
is terminal (``tcp`` sends straight from the tensors), so the sender must not modify
them, including the metadata row, before ``poll`` says SUCCESS or FAILED.

Change log:
* ``WriteOp`` became a ``NamedTuple`` (was a frozen dataclass): same fields, same
  construction and attribute access; it no longer validates on construction (use
  :func:`check_source_ops`), because scattered transfers build ~100k of them.
* ``Transport.moves_bytes`` class attribute added (default True).
* ``WriteOps`` added: a ``Sequence[WriteOp]`` backed by one int64 array, returned by
  ``pages.page_ops``; backends may keep iterating it as plain ``WriteOp``s, or read
  ``.array`` for speed.
* ``RoomGrant.runs_array()`` added (page runs as two int64 arrays, for vectorized
  authorization).
* ``Transport.drain(room, timeout)`` added (default: drained at once); ``rdma``
  implements it (a receive UCX already matched cannot be recalled by the receiver).
"""

from __future__ import annotations

import abc
import asyncio
import base64
import bisect
import collections
import dataclasses
import enum
import functools
import json
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any, Awaitable, Callable, ClassVar, Iterable, NamedTuple, Sequence

from pdgrpc.errors import TransportError
from pdgrpc.kvpoll import KVPoll

if TYPE_CHECKING:  # torch is a runtime dependency, but keep this module cheap to import
    import torch

log = logging.getLogger(__name__)

__all__ = [
    "BadDescriptor",
    "Descriptor",
    "MemoryRegion",
    "Peer",
    "RegionInfo",
    "RegionKind",
    "RoomGrant",
    "RoomStatus",
    "RoomTable",
    "Transport",
    "UnknownRoom",
    "WriteOp",
    "WriteOps",
    "after_reactions",
    "check_source_ops",
]

# Descriptor wire format version; bump on incompatible changes (peers refuse others).
DESCRIPTOR_VERSION = 1
_MAX_REGION_ID = 0xFFFF  # region ids fit 16 bits so backends can use fixed headers


class BadDescriptor(TransportError):
    """A peer descriptor could not be parsed or is inconsistent (untrusted input)."""


class UnknownRoom(TransportError):
    """``poll``/``status`` for a room this transport does not track."""


class RegionKind(str, enum.Enum):
    """What a region holds, which decides how a :class:`RoomGrant` applies to it."""

    KV = "kv"  # first dimension = page index; a grant's ``pages`` apply
    METADATA = "metadata"  # first dimension = slot index; a grant's ``slot`` applies


@dataclasses.dataclass(frozen=True)
class RegionInfo:
    """What a peer learns about one registered region (from the descriptor).

    ``item_bytes`` is the size of one page (KV) or one row (metadata): the byte stride
    of the region's first dimension. ``backend_data`` is backend-specific (e.g. a remote
    key); empty for backends that need nothing.
    """

    region_id: int
    name: str
    kind: RegionKind
    nbytes: int
    item_bytes: int
    backend_data: bytes = b""

    def __post_init__(self) -> None:
        if not 0 <= self.region_id <= _MAX_REGION_ID:
            raise BadDescriptor(f"region_id must be in [0, {_MAX_REGION_ID}], got {self.region_id}")
        if self.item_bytes <= 0 or self.nbytes < 0 or self.nbytes % self.item_bytes:
            raise BadDescriptor(
                f"region {self.name!r}: nbytes ({self.nbytes}) must be a non-negative multiple "
                f"of item_bytes ({self.item_bytes} > 0)"
            )

    @property
    def num_items(self) -> int:
        return self.nbytes // self.item_bytes


@dataclasses.dataclass(frozen=True, eq=False)
class MemoryRegion:
    """A local tensor handed to :meth:`Transport.register`.

    The tensor must be contiguous; its first dimension indexes pages (KV) or slots
    (metadata). ``region_id`` is chosen by the caller and must agree between sender and
    receiver for the same logical region (e.g. ``2 * layer + (0 for K, 1 for V)``; see
    :mod:`pdgrpc.transport.pages`). ``name`` is for error messages.
    """

    region_id: int
    tensor: "torch.Tensor"
    kind: RegionKind = RegionKind.KV
    name: str = ""

    def __post_init__(self) -> None:
        from pdgrpc.errors import ConfigError

        if not 0 <= self.region_id <= _MAX_REGION_ID:
            raise ConfigError(f"MemoryRegion.region_id must be in [0, {_MAX_REGION_ID}], got {self.region_id}")
        if self.tensor.dim() < 1 or self.tensor.shape[0] < 1:
            raise ConfigError(f"MemoryRegion.tensor ({self.label}) needs a non-empty first dimension")
        if not self.tensor.is_contiguous():
            raise ConfigError(f"MemoryRegion.tensor ({self.label}) must be contiguous")
        if not self.name:
            object.__setattr__(self, "name", f"{self.kind.value}{self.region_id}")

    @property
    def label(self) -> str:
        return self.name or f"region {self.region_id}"

    # Cached: a registered tensor keeps its shape, and ``page_ops`` asks for every
    # region pair on every write (48 pairs: ~20 us of torch calls per write).
    @functools.cached_property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @functools.cached_property
    def item_bytes(self) -> int:
        return self.nbytes // self.tensor.shape[0]

    def info(self, backend_data: bytes = b"") -> RegionInfo:
        return RegionInfo(self.region_id, self.name, self.kind, self.nbytes, self.item_bytes, backend_data)


class WriteOp(NamedTuple):
    """Copy ``length`` bytes from ``src_offset`` of local region ``src_region`` to
    ``dst_offset`` of the peer's region ``dst_region`` (offsets in bytes).

    A ``NamedTuple`` (immutable, attribute access, cheap to build): a scattered 32k-token
    transfer is ~100k ops, so construction does not validate. Senders validate their
    side with :func:`check_source_ops`; receivers authorize the destination side against
    the room's grant (:meth:`RoomGrant.check`), which is the check that matters.
    """

    src_region: int
    src_offset: int
    dst_region: int
    dst_offset: int
    length: int


class WriteOps(Sequence[WriteOp]):
    """Many write ops as one ``(N, 5)`` int64 array, columns in :class:`WriteOp` field
    order. It *is* a ``Sequence[WriteOp]`` (indexing and iteration yield ``WriteOp``),
    so every backend accepts it unchanged; backends that want speed read
    :attr:`array` directly instead of touching ~100k Python objects.
    :func:`pdgrpc.transport.pages.page_ops` returns this type."""

    __slots__ = ("array",)

    def __init__(self, array: Any) -> None:
        import numpy as np

        arr = np.ascontiguousarray(array, dtype=np.int64).reshape(-1, 5)
        arr.flags.writeable = False
        self.array = arr

    @classmethod
    def of(cls, ops: Iterable[WriteOp]) -> "WriteOps":
        if isinstance(ops, WriteOps):
            return ops
        import numpy as np

        return cls(np.array([tuple(op) for op in ops], dtype=np.int64).reshape(-1, 5))

    def __len__(self) -> int:
        return int(self.array.shape[0])

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return WriteOps(self.array[i])
        return WriteOp(*(int(x) for x in self.array[i]))

    def __iter__(self) -> Any:
        return (WriteOp(*row) for row in self.array.tolist())

    def __repr__(self) -> str:
        return f"WriteOps({len(self)} ops, {int(self.array[:, 4].sum()) if len(self) else 0} bytes)"

    @property
    def nbytes(self) -> int:
        return int(self.array[:, 4].sum()) if len(self) else 0


def check_source_ops(ops: Iterable[WriteOp], regions: "dict[int, MemoryRegion]") -> None:
    """Raise :class:`~pdgrpc.errors.ConfigError` naming the field if an op's source
    side is not inside a registered local region (a caller bug, not a peer's fault)."""
    from pdgrpc.errors import ConfigError

    if isinstance(ops, WriteOps):  # vectorized: same checks, first offender reported
        a = ops.array
        if not len(a):
            return
        bad = (a[:, 1] < 0) | (a[:, 3] < 0) | (a[:, 4] <= 0)
        sizes = {rid: r.nbytes for rid, r in regions.items()}
        for rid in set(a[:, 0].tolist()):
            rows = a[:, 0] == rid
            if rid not in sizes:
                bad |= rows
            else:
                bad |= rows & (a[:, 1] + a[:, 4] > sizes[rid])
        if bad.any():
            ops = [ops[int(bad.argmax())]]
        else:
            return
    for op in ops:
        region = regions.get(op.src_region)
        if region is None:
            raise ConfigError(f"WriteOp.src_region {op.src_region} is not registered locally")
        if op.src_offset < 0 or op.length <= 0 or op.dst_offset < 0:
            raise ConfigError(
                f"WriteOp needs src_offset >= 0, dst_offset >= 0, length > 0; got {op.src_offset}, "
                f"{op.dst_offset}, {op.length}"
            )
        if op.src_offset + op.length > region.nbytes:
            raise ConfigError(
                f"WriteOp source bytes [{op.src_offset}, {op.src_offset + op.length}) outside "
                f"local region {region.name!r} of {region.nbytes} bytes"
            )


@dataclasses.dataclass(frozen=True)
class RoomGrant:
    """What a receiver allows for one room: these page indices in every KV region and
    this slot in every metadata region (``slot=None``: no metadata row for this room,
    e.g. an intermediate TP rank). Build with :meth:`of`, which sorts and dedups."""

    room: int
    pages: tuple[int, ...]
    slot: int | None = None

    @classmethod
    def of(cls, room: int, pages: Iterable[int], slot: int | None = None) -> "RoomGrant":
        from pdgrpc.errors import ConfigError

        ps = tuple(sorted(set(int(p) for p in pages)))
        if ps and ps[0] < 0:
            raise ConfigError(f"RoomGrant.pages must be >= 0, got {ps[0]}")
        if slot is not None and slot < 0:
            raise ConfigError(f"RoomGrant.slot must be >= 0, got {slot}")
        if not 0 < room < 2**63:
            raise ConfigError(f"RoomGrant.room must be in [1, 2**63), got {room}")
        return cls(room, ps, slot)

    @property
    def page_runs(self) -> tuple[tuple[int, int], ...]:
        """Maximal runs of consecutive pages as ``(first, last_exclusive)``."""
        runs: list[tuple[int, int]] = []
        for p in self.pages:
            if runs and runs[-1][1] == p:
                runs[-1] = (runs[-1][0], p + 1)
            else:
                runs.append((p, p + 1))
        return tuple(runs)

    def check(self, region: RegionInfo | None, offset: int, length: int) -> str | None:
        """``None`` when writing ``[offset, offset+length)`` into ``region`` is allowed
        by this grant, else the reason (for the room's failure message)."""
        if region is None:
            return "unknown destination region"
        if offset < 0 or length <= 0 or offset + length > region.nbytes:
            return (
                f"bytes [{offset}, {offset + length}) outside region {region.name!r} "
                f"of {region.nbytes} bytes"
            )
        first = offset // region.item_bytes
        last = (offset + length - 1) // region.item_bytes
        if region.kind is RegionKind.METADATA:
            if self.slot is None:
                return f"room {self.room} was granted no metadata slot (write into {region.name!r} slot {first})"
            if first != self.slot or last != self.slot:
                return (
                    f"metadata write into slots {first}..{last} of {region.name!r}; "
                    f"room {self.room} was granted slot {self.slot}"
                )
            return None
        runs = self._runs_cache()
        i = bisect.bisect_right(runs[0], first) - 1
        if i < 0 or not (runs[0][i] <= first and last < runs[1][i]):
            bad = next(
                (p for p in range(first, last + 1) if not self._has_page(p)), first
            )
            return (
                f"page {bad} of {region.name!r} is outside the pages granted to room {self.room}"
            )
        return None

    def runs_array(self) -> tuple[Any, Any]:
        """Page runs as ``(starts, ends_exclusive)`` int64 arrays (cached)."""
        cached = self.__dict__.get("_runs_np")
        if cached is None:
            import numpy as np

            starts, ends = self._runs_cache()
            cached = (np.array(starts, dtype=np.int64), np.array(ends, dtype=np.int64))
            object.__setattr__(self, "_runs_np", cached)
        return cached

    def _has_page(self, p: int) -> bool:
        i = bisect.bisect_left(self.pages, p)
        return i < len(self.pages) and self.pages[i] == p

    def _runs_cache(self) -> tuple[list[int], list[int]]:
        cached = self.__dict__.get("_runs")
        if cached is None:
            runs = self.page_runs
            cached = ([a for a, _ in runs], [b for _, b in runs])
            object.__setattr__(self, "_runs", cached)
        return cached


@dataclasses.dataclass(frozen=True)
class Descriptor:
    """What one transport instance tells its peers, as bytes in the handshake.

    ``instance_id`` is fresh per transport instance (per process start): it is the
    connection-cache key and the generation that tells a restarted peer apart.
    ``endpoint`` is backend-specific (``host:port``, a UCX worker address, ...).
    ``liveness`` is the optional ``host:port`` of a :mod:`pdgrpc.transport.liveness`
    side channel ("" when the backend does not use one).
    """

    backend: str
    instance_id: str
    endpoint: bytes
    regions: tuple[RegionInfo, ...] = ()
    liveness: str = ""

    def region(self, region_id: int) -> RegionInfo | None:
        for r in self.regions:
            if r.region_id == region_id:
                return r
        return None

    def require_region(self, region_id: int) -> RegionInfo:
        """:meth:`region`, for a region the caller cannot do without: raises
        :class:`BadDescriptor` when this descriptor does not advertise it."""
        r = self.region(region_id)
        if r is None:
            raise BadDescriptor(f"{self.backend} descriptor of {self.instance_id} has no region {region_id}")
        return r

    def region_map(self) -> dict[int, RegionInfo]:
        return {r.region_id: r for r in self.regions}

    def to_bytes(self) -> bytes:
        doc = {
            "v": DESCRIPTOR_VERSION,
            "backend": self.backend,
            "instance_id": self.instance_id,
            "endpoint": base64.b64encode(self.endpoint).decode(),
            "liveness": self.liveness,
            "regions": [
                [r.region_id, r.name, r.kind.value, r.nbytes, r.item_bytes, base64.b64encode(r.backend_data).decode()]
                for r in self.regions
            ],
        }
        return b"PDGT" + json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Descriptor":
        if not isinstance(data, (bytes, bytearray, memoryview)) or bytes(data[:4]) != b"PDGT":
            raise BadDescriptor("not a pdgrpc transport descriptor (missing PDGT magic)")
        try:
            doc = json.loads(bytes(data[4:]))
            if doc["v"] != DESCRIPTOR_VERSION:
                raise BadDescriptor(f"descriptor version {doc['v']} unsupported (want {DESCRIPTOR_VERSION})")
            regions = tuple(
                RegionInfo(int(i), str(n), RegionKind(k), int(nb), int(ib), base64.b64decode(bd))
                for i, n, k, nb, ib, bd in doc["regions"]
            )
            d = cls(
                backend=str(doc["backend"]),
                instance_id=str(doc["instance_id"]),
                endpoint=base64.b64decode(doc["endpoint"]),
                regions=regions,
                liveness=str(doc.get("liveness", "")),
            )
        except BadDescriptor:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise BadDescriptor(f"malformed descriptor: {exc!r}") from None
        if len({r.region_id for r in regions}) != len(regions):
            raise BadDescriptor("descriptor lists a region_id twice")
        if not d.instance_id:
            raise BadDescriptor("descriptor has an empty instance_id")
        return d


@dataclasses.dataclass(frozen=True)
class Peer:
    """A connected peer, as returned by :meth:`Transport.connect`."""

    instance_id: str
    descriptor: Descriptor


@dataclasses.dataclass(frozen=True)
class RoomStatus:
    state: KVPoll
    reason: str | None = None  # set when state is FAILED


def after_reactions(callback: Callable[..., object], *args: object) -> None:
    """Run ``callback(*args)`` on the running loop once the reactions to a room that just
    turned terminal have run: a listener (:meth:`RoomTable.add_listener`) schedules its
    reaction for the loop's next turn, and what that reaction wakes (a task awaiting it)
    runs on the turn after; ``callback`` runs after both.

    For a receiver's ACK: it wakes the sender, whose reply to its own caller reaches the
    same client as the receiver's first token, on a small host at the same moment and
    competing for the same cores; the token is what the client waits for. Measured (2
    cores, 1p1d over rdma, 512-token prompts, side by side): ACK at once or one turn
    later, TTFT overhead 5.60 / 5.50 ms; after the reactions, 5.06 ms."""
    loop = asyncio.get_running_loop()
    loop.call_soon(loop.call_soon, callback, *args)


class RoomTable:
    """Per-room state shared by backends: forward-only transitions, FAILED wins,
    terminal states stick, waiters wake on terminal states. Not thread-safe: touch it
    from the transport's event loop only."""

    # Release reasons kept for late writes: a bounded number, the newest (a write comes
    # late by the sender's reaction time, not by thousands of rooms).
    RELEASE_REASONS_KEPT = 4096

    def __init__(self) -> None:
        self._states: dict[int, RoomStatus] = {}
        self._events: dict[int, asyncio.Event] = {}
        self._listeners: list[Callable[[int], None]] = []
        self._started: dict[int, float] = {}  # room -> time.monotonic() it reached TRANSFERRING
        self._release_reasons: collections.OrderedDict[int, str] = collections.OrderedDict()

    def add_listener(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(room)`` each time a room turns terminal (SUCCESS or FAILED),
        synchronously, from inside whatever update made it so (often the transport's own
        receive path): keep it short and schedule real work, e.g. with ``call_soon``.
        Cheaper than a task per room in :meth:`wait` when a server follows every room
        (the decode scheduler: one less task and loop hop between KV landed and commit)."""
        self._listeners.append(callback)

    def __contains__(self, room: int) -> bool:
        return room in self._states

    def __len__(self) -> int:
        return len(self._states)

    def rooms(self) -> list[int]:
        return list(self._states)

    def create(self, room: int, state: KVPoll) -> None:
        """Start tracking ``room`` (no-op if already tracked)."""
        if room not in self._states and state is KVPoll.TRANSFERRING:
            self._started[room] = time.monotonic()
        self._states.setdefault(room, RoomStatus(state))

    def transfer_started(self, room: int) -> float | None:
        """When ``room`` first reached TRANSFERRING (``time.monotonic()``): the first
        byte written (sender) or arrived (receiver). None if it has not, or is untracked."""
        return self._started.get(room)

    def set(self, room: int, state: KVPoll, reason: str | None = None) -> bool:
        """Move ``room`` to ``state`` if that is forward (or FAILED). Returns whether
        the state changed. Untracked rooms are ignored (released rooms stay released)."""
        cur = self._states.get(room)
        if cur is None or cur.state.is_terminal:
            return False
        if state is not KVPoll.FAILED and state <= cur.state:
            return False
        self._states[room] = RoomStatus(state, reason if state is KVPoll.FAILED else None)
        if state is KVPoll.TRANSFERRING or (state is KVPoll.SUCCESS and room not in self._started):
            self._started[room] = time.monotonic()
        if state.is_terminal:
            ev = self._events.get(room)
            if ev is not None:
                ev.set()
            for callback in self._listeners:
                try:
                    callback(room)
                except Exception:  # a listener's bug must not break the transport's update
                    log.exception("room %d: terminal-state listener %r failed", room, callback)
        return True

    def fail(self, room: int, reason: str) -> bool:
        return self.set(room, KVPoll.FAILED, reason)

    def status(self, room: int) -> RoomStatus:
        try:
            return self._states[room]
        except KeyError:
            raise UnknownRoom(f"room {room} is not tracked by this transport") from None

    def note_release(self, room: int, reason: str) -> None:
        """Remember why ``room`` is being released, for :meth:`refusal`."""
        self._release_reasons[room] = reason
        self._release_reasons.move_to_end(room)
        while len(self._release_reasons) > self.RELEASE_REASONS_KEPT:
            self._release_reasons.popitem(last=False)

    def release_reason(self, room: int) -> str | None:
        """The reason noted for ``room``'s release, if any (and still kept)."""
        return self._release_reasons.get(room)

    def refusal(self, room: int) -> str:
        """Why a receiver refuses a write for ``room``, which it does not track. A room
        released for a noted reason says so: a sender whose write was a moment late then
        reports the cause (say, the decode found the metadata corrupt on another TP
        rank), not only that the room is gone."""
        why = self.release_reason(room)
        text = f"room {room} is not advertised here (never, or already released)"
        return text if why is None else f"{text}; it was released because: {why}"

    def discard(self, room: int) -> None:
        self._states.pop(room, None)
        self._started.pop(room, None)
        ev = self._events.pop(room, None)
        if ev is not None:
            ev.set()  # wake waiters; they see UnknownRoom

    def fail_all(self, reason: str, rooms: Iterable[int] | None = None) -> None:
        for room in list(self._states if rooms is None else rooms):
            self.fail(room, reason)

    async def wait(self, room: int, timeout: float) -> RoomStatus:
        st = self.status(room)
        if st.state.is_terminal:
            return st
        ev = self._events.setdefault(room, asyncio.Event())
        try:
            await asyncio.wait_for(ev.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        return self.status(room)


def new_instance_id() -> str:
    """A fresh generation id for a transport instance."""
    return uuid.uuid4().hex


class Transport(abc.ABC):
    """Base class of every transport backend. See the module docstring for who calls
    each hook and when. Subclasses set :attr:`name` and accept their options as keyword
    arguments (``registry.create(name, **options)``); unknown options must raise
    :class:`~pdgrpc.errors.ConfigError` naming the option.

    The base keeps the per-room table (:attr:`rooms`), so ``poll``, ``status`` and
    ``wait`` are implemented here; backends update it with ``self.rooms.set(...)``.
    """

    name: ClassVar[str] = ""
    # False for backends that move no bytes (``fake``): the conformance suite then
    # skips the data checks and expects every room to succeed at once.
    moves_bytes: ClassVar[bool] = True

    def __init__(self) -> None:
        self.instance_id: str = new_instance_id()
        self.rooms = RoomTable()

    # -- set-up -----------------------------------------------------------------------
    @abc.abstractmethod
    async def register(self, regions: Sequence[MemoryRegion]) -> bytes:
        """Register local tensors; return this instance's descriptor bytes."""

    @abc.abstractmethod
    async def connect(self, descriptor: bytes) -> Peer:
        """Connect (or reuse the cached connection) to the peer described; raises
        :class:`BadDescriptor` or :class:`~pdgrpc.errors.PeerFailure`."""

    # -- receiver -----------------------------------------------------------------------
    @abc.abstractmethod
    def advertise(self, grant: RoomGrant) -> None:
        """Accept writes for ``grant.room`` into exactly the granted pages and slot."""

    # -- sender ---------------------------------------------------------------------------
    @abc.abstractmethod
    async def write(
        self, peer: Peer, room: int, ops: Sequence[WriteOp], *, metadata: WriteOp | None = None
    ) -> None:
        """Queue ``ops`` for ``room`` to ``peer``; with ``metadata``, also the room's
        metadata row, which lands after everything written for the room before it."""

    def prepare_write(
        self, peer: Peer, room: int, ops: Sequence[WriteOp], *, metadata: WriteOp | None = None
    ) -> Callable[[], Awaitable[None]]:
        """Do now what :meth:`write` can do before the bytes exist (check ``ops``
        against the registered regions, plan the messages) and return a function that
        sends when called -- exactly ``write(peer, room, ops, metadata=metadata)`` at that
        moment, the metadata row read then. For a sender that knows its last write
        while the data is still being computed. Raises what :meth:`write` raises for
        bad ops. Default: nothing ahead of time."""
        return functools.partial(self.write, peer, room, ops, metadata=metadata)

    # -- both sides ----------------------------------------------------------------------
    def poll(self, room: int) -> KVPoll:
        return self.rooms.status(room).state

    def status(self, room: int) -> RoomStatus:
        return self.rooms.status(room)

    def transfer_started(self, room: int) -> float | None:
        """``time.monotonic()`` when ``room``'s first byte was written (sender) or
        arrived (receiver); None before that or for an untracked room."""
        return self.rooms.transfer_started(room)

    async def wait(self, room: int, timeout: float) -> RoomStatus:
        """Wait (bounded) until ``room`` is terminal; returns its status either way."""
        return await self.rooms.wait(room, timeout)

    @abc.abstractmethod
    def release(self, room: int) -> None:
        """Forget ``room``; a receiver rejects any later write for it."""

    def release_because(self, room: int, reason: str) -> None:
        """:meth:`release`, for a room ended early (aborted): a write for it that comes
        afterwards is refused with ``reason`` in the refusal (:meth:`RoomTable.refusal`),
        so its sender reports why the room ended."""
        self.rooms.note_release(room, reason)
        self.release(room)

    @abc.abstractmethod
    def fail_peer(self, instance_id: str, reason: str) -> None:
        """Fail every non-terminal room involving that peer; drop its connection."""

    async def drain(self, room: int, timeout: float) -> bool:
        """Sender: wait until no byte this instance wrote for ``room`` can still land at
        the receiver (every queued send completed, failed or was cancelled). True when
        drained, False at ``timeout``. Called before acknowledging an abort, so the
        receiver may reuse the pages once it has the ack. Default: True at once, right
        for backends whose receiver drops a released room's bytes by itself (``tcp``:
        frames after release are discarded, a frame in progress goes to scratch)."""
        return True

    @abc.abstractmethod
    async def close(self) -> None:
        """Fail open rooms, close connections; no task, thread or fd left behind."""

    async def __aenter__(self) -> "Transport":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
