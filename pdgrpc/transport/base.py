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
    :meth:`RoomStates.refusal`, so its sender reports why the room ended.

``fail_peer(instance_id, reason)`` -- the control plane, when its own liveness signal
    (bootstrap lease expired, heartbeat missed) says a peer is gone. Every non-terminal
    room that involves that peer fails at once with ``reason``, and the cached connection
    is dropped so the next ``connect`` builds a fresh one. Backends whose own channel
    does not notice peer death (``rdma`` with UCX error handling off) use
    :mod:`pdgrpc.transport.liveness` (a tiny heartbeat side channel whose address travels
    in :attr:`Descriptor.liveness`) and route its verdict into this same hook.

Data-plane identity (:mod:`pdgrpc.transport.peerauth`) -- a receiver's
    ``issue_credential(writer_id)`` is what the control plane carries to the writer (the
    decode's ``HandshakeRequest.transport_credential``); the writer hands it to its own
    transport with ``set_credential(receiver_id, credential)`` before ``connect``. A
    backend's connections and liveness links answer a receiver-chosen nonce with a proof of
    it; the receiver takes a connection's identity only once the proof verifies, and only
    proven connections may fail a peer's rooms. A room advertised with
    ``RoomGrant.bound`` admits only the writers the receiver's control plane names with
    ``bind_writer(room, writer_id)`` before its handshake goes out; another proven
    writer's write is refused as for an unknown room, leaves the room as it was, and is
    counted (``foreign_writes``). ``writer_gone(writer_id)`` (receiver) says
    whether the transport has confirmed that writer can no longer write here (every
    proven connection of its ended from its side and was drained); the decode then ends
    the quarantine of an aborted room's pages without waiting for the lease. Default
    (a backend that cannot tell): False.

``close()`` -- both sides at shutdown. Fails every non-terminal room, closes every
    connection, and leaves no task, thread or file descriptor behind.

Errors
------
Backends map every library error (``OSError``, UCX exceptions, ...) to the tree in
:mod:`pdgrpc.errors` at this boundary: :class:`~pdgrpc.errors.PeerFailure` (peer gone),
:class:`~pdgrpc.errors.UnauthorizedWrite` (a refused write, with its
:class:`~pdgrpc.errors.Refusal`; the room's ``status().refusal`` carries it),
:class:`~pdgrpc.errors.TransportUnavailable` (backend cannot load),
:class:`~pdgrpc.errors.TransportError` (anything else). Per-room data-plane failures do
not raise from ``write``; they surface as ``FAILED`` in ``poll``.

Compatibility
-------------
This contract is relied upon by out-of-tree backends. Changes stay backward
compatible: new data-type fields get defaults, new hooks get default implementations.

Source memory: a backend may read a write's source bytes at any time until the room
is terminal (``tcp`` sends straight from the tensors), so the sender must not modify
them, including the metadata row, before ``poll`` says SUCCESS or FAILED.

Receivers: :mod:`pdgrpc.transport.receiver` is the shared receiver core (grant check,
byte accounting, metadata-last commit, refusal reasons); a backend that moves bytes
drives it rather than re-implementing the rules.
"""

from __future__ import annotations

import abc
import functools
import uuid
from typing import Any, Awaitable, Callable, ClassVar, Sequence

from pdgrpc.errors import PeerFailure, Refusal
from pdgrpc.kvpoll import KVPoll
import pdgrpc.transport.peerauth as peerauth
from pdgrpc.transport.descriptor import DESCRIPTOR_VERSION, Descriptor, Peer
from pdgrpc.transport.grant import RoomGrant
from pdgrpc.transport.regions import (
    BadDescriptor, MemoryRegion, RegionInfo, RegionKind, WriteOp, WriteOps, check_source_ops,
)
from pdgrpc.transport.rooms import RoomStates, RoomStatus, UnknownRoom, after_acks, after_reactions

__all__ = [
    "DESCRIPTOR_VERSION",
    "BadDescriptor",
    "Descriptor",
    "MemoryRegion",
    "Peer",
    "Refusal",
    "RegionInfo",
    "RegionKind",
    "RoomGrant",
    "RoomStates",
    "RoomStatus",
    "Transport",
    "UnknownRoom",
    "WriteOp",
    "WriteOps",
    "after_acks",
    "after_reactions",
    "check_source_ops",
]


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
        self.rooms = RoomStates()
        self.auth_key: bytes = peerauth.new_key()  # receiver: never leaves this process
        self.credentials = peerauth.CredentialStore()  # writer: what receivers issued to it
        self.writers = peerauth.WriterTable()  # receiver: proven connections per writer
        self.room_writers = peerauth.RoomWriters()  # receiver: the writers each room admits
        peerauth.remember_key(self.instance_id, self.auth_key)

    # -- data-plane identity (pdgrpc.transport.peerauth) ---------------------------------
    def issue_credential(self, writer_id: str) -> bytes:
        """Receiver: the credential the writer ``writer_id`` proves on its connections here;
        send it to that writer over the authenticated control plane only."""
        return peerauth.credential(self.auth_key, writer_id, self.instance_id)

    def set_credential(self, receiver_id: str, credential: bytes) -> None:
        """Writer: the credential receiver ``receiver_id`` issued to this instance (it came
        over the control plane); used by the next ``connect`` to that receiver."""
        self.credentials.put(receiver_id, credential)

    def credential_for(self, receiver_id: str) -> bytes:
        """Writer: the credential to prove to ``receiver_id``. A receiver in this same
        process issues it directly (a process cannot be impersonated to itself: tests and
        benchmarks that run both ends in one process need no control plane)."""
        return self.credentials.get(receiver_id) or peerauth.known_credential(receiver_id, self.instance_id)

    def require_credential(self, receiver_id: str) -> bytes:
        """:meth:`credential_for`, for a connect that cannot do without one: raises
        :class:`~pdgrpc.errors.PeerFailure` naming what is missing."""
        cred = self.credential_for(receiver_id)
        if not cred:
            raise PeerFailure(f"{self.name}: no data-plane credential for peer {receiver_id} (its handshake "
                              "carried no transport_credential: a decode that predates it?)")
        return cred

    def verify_proof(self, channel: bytes, nonce: bytes, writer_id: str, answer: bytes) -> bool:
        """Receiver: whether ``answer`` to ``nonce`` proves ``writer_id``'s credential."""
        return peerauth.verify(self.auth_key, channel, nonce, writer_id, self.instance_id, answer)

    def bind_writer(self, room: int, writer_id: str) -> None:
        """Receiver: admit the writer ``writer_id`` into ``room``, advertised with
        ``RoomGrant.bound`` (call before the handshake that names the writer goes out).
        Writes from any other proven writer are refused as for an unknown room and
        counted in :attr:`foreign_writes`; the room is left as it was."""
        self.room_writers.bind(room, writer_id)

    @property
    def foreign_writes(self) -> int:
        """Receiver: writes refused because their writer is not bound to the room."""
        return self.room_writers.foreign

    def writer_gone(self, writer_id: str) -> bool:
        """Receiver: whether the transport confirmed ``writer_id`` can no longer write
        here (see the module docstring). Backends that cannot tell return False."""
        return self.writers.gone(writer_id)

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
        afterwards is refused with ``reason`` in the refusal (:meth:`RoomStates.refusal`),
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
