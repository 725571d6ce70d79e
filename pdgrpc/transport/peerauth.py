"""Who is on the other end of a data-plane connection: challenge-response proofs of a
credential that travelled only over the authenticated control plane. Pure: no I/O, no
clock, no sockets.

Roles
-----
* The **receiver** (a decode rank's transport) holds a random per-process ``key``
  (:func:`new_key`), never sent anywhere.
* For each writer (a prefill worker's transport, named by its instance id) the receiver
  issues a **credential** ``C = HMAC(key, writer_id, receiver_id)`` (:func:`credential`).
  The decode sends it to that worker inside its ``HandshakeRequest``
  (``transport_credential``), over the control plane (TLS/mTLS when configured). It names
  its writer, so it is useless to anyone else. Nothing public (``GetWorkers``,
  descriptors) carries a key or a credential.
* Each data-plane connection the writer opens (tcp connection, rdma liveness link) starts
  with a fresh **nonce** from the receiver (:func:`new_nonce`); the writer answers with
  ``proof = HMAC(C, channel, nonce, writer_id, receiver_id)`` (:func:`proof`), and the
  receiver recomputes it from its key (:func:`verify`). A replayed answer fails (another
  nonce), a credential of one writer proves nothing for another (it names the writer),
  and a proof for one channel kind is not one for another.

The receiver takes a connection's identity only after :func:`verify`; a connection that
fails it is closed and changes nothing for anyone. Only proven connections may fail or
release a peer's rooms (:class:`WriterTable` counts them per writer).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import secrets

__all__ = [
    "CREDENTIAL_BYTES", "KEY_BYTES", "NONCE_BYTES", "PROOF_BYTES", "CredentialStore", "RoomWriters", "WriterTable",
    "credential", "known_credential", "new_key", "new_nonce", "proof", "remember_key", "verify",
]

KEY_BYTES = 32
NONCE_BYTES = 16
CREDENTIAL_BYTES = PROOF_BYTES = 32  # HMAC-SHA256 outputs

_CREDENTIAL = b"pdgrpc.v1 transport credential\0"
_PROOF = b"pdgrpc.v1 transport proof\0"


def new_key() -> bytes:
    """A receiver's fresh per-process key (32 random bytes)."""
    return secrets.token_bytes(KEY_BYTES)


def new_nonce() -> bytes:
    """A fresh challenge for one connection (16 random bytes)."""
    return secrets.token_bytes(NONCE_BYTES)


def _ids(writer_id: str, receiver_id: str) -> bytes:
    w, r = writer_id.encode(), receiver_id.encode()
    return len(w).to_bytes(2, "little") + w + len(r).to_bytes(2, "little") + r


def credential(key: bytes, writer_id: str, receiver_id: str) -> bytes:
    """The credential the receiver ``receiver_id`` (holding ``key``) issues to the writer
    ``writer_id``."""
    return hmac.new(key, _CREDENTIAL + _ids(writer_id, receiver_id), hashlib.sha256).digest()


def proof(cred: bytes, channel: bytes, nonce: bytes, writer_id: str, receiver_id: str) -> bytes:
    """The writer's answer to ``nonce`` on a connection of kind ``channel`` (``b"tcp"``,
    ``b"liveness"``)."""
    msg = _PROOF + len(channel).to_bytes(1, "little") + channel + nonce + _ids(writer_id, receiver_id)
    return hmac.new(cred, msg, hashlib.sha256).digest()


def verify(key: bytes, channel: bytes, nonce: bytes, writer_id: str, receiver_id: str, answer: bytes) -> bool:
    """Whether ``answer`` proves that ``writer_id`` holds the credential this receiver
    issued to it (constant-time compare). An empty nonce never verifies."""
    if len(nonce) != NONCE_BYTES or not writer_id:
        return False
    want = proof(credential(key, writer_id, receiver_id), channel, nonce, writer_id, receiver_id)
    return hmac.compare_digest(want, answer)


class CredentialStore:
    """The writer's side: credentials received over the control plane, by receiver
    instance id (bounded: the oldest go first; a receiver no longer talked to needs none)."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._by_receiver: collections.OrderedDict[str, bytes] = collections.OrderedDict()

    def put(self, receiver_id: str, cred: bytes) -> None:
        self._by_receiver[receiver_id] = bytes(cred)
        self._by_receiver.move_to_end(receiver_id)
        while len(self._by_receiver) > self.limit:
            self._by_receiver.popitem(last=False)

    def get(self, receiver_id: str) -> bytes:
        """The credential for ``receiver_id``; empty when none arrived (the proof then fails
        at the receiver, which refuses the connection)."""
        return self._by_receiver.get(receiver_id, b"")


class WriterTable:
    """The receiver's side: how many proven connections each writer has open, and which
    writers are **gone**: every proven connection of theirs ended by the writer's side
    (EOF or reset: the kernel closes a dead process's sockets) and was drained, with no
    proven connection since. A connection this side closed (a missed heartbeat: the writer
    may merely hang; a protocol error) never makes a writer gone, so a hung writer stays
    under the lease rule. Bounded: the oldest gone writers are forgotten first."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self.open: collections.Counter[str] = collections.Counter()
        self._gone: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._held: set[str] = set()  # writers with a connection this side cut (not gone)

    def opened(self, writer_id: str) -> None:
        """A connection of ``writer_id`` proved its identity."""
        self.open[writer_id] += 1
        self._gone.pop(writer_id, None)
        self._held.discard(writer_id)

    def closed(self, writer_id: str, *, by_peer: bool) -> None:
        """A proven connection of ``writer_id`` closed and its bytes are drained;
        ``by_peer``: the writer's side ended it (EOF, reset), not this side."""
        if self.open[writer_id] <= 0:
            return
        self.open[writer_id] -= 1
        if not by_peer:
            self._held.add(writer_id)
        if self.open[writer_id] == 0:
            del self.open[writer_id]
            if writer_id not in self._held:
                self._gone[writer_id] = None
                while len(self._gone) > self.limit:
                    self._gone.popitem(last=False)
            self._held.discard(writer_id)

    def gone(self, writer_id: str) -> bool:
        """Whether ``writer_id`` can no longer write here (see the class docstring)."""
        return writer_id in self._gone



class RoomWriters:
    """The receiver's side: which writers each room is bound to. A room advertised as
    bound (``RoomGrant.bound``) admits only the writers its control plane binds to it
    (:meth:`bind`, before its handshake goes out: the writers it names), none before,
    while it is open and after it ended; so a credential alone never reaches another
    writer's room. An unbound room admits every proven writer (a receiver whose control
    plane does not bind, such as a test driving a transport directly). Refusals are
    counted in :attr:`foreign`. Bounded: the bindings of the oldest ended rooms go first."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self.foreign = 0  # writes refused because their writer is not the room's
        self._live: dict[int, set[str]] = {}
        self._ended: collections.OrderedDict[int, frozenset[str]] = collections.OrderedDict()

    def opened(self, room: int, *, bound: bool) -> None:
        """``room`` was advertised; ``bound``: it admits only the writers bound to it."""
        self._ended.pop(room, None)
        if bound:
            self._live.setdefault(room, set())
        else:
            self._live.pop(room, None)

    def bind(self, room: int, writer_id: str) -> None:
        """Admit ``writer_id`` into ``room`` too (a room has one writer per prefill rank)."""
        self._live.setdefault(room, set()).add(writer_id)

    def admits(self, room: int, writer_id: str) -> bool:
        """Whether ``writer_id`` may write into ``room``; a refusal is counted."""
        writers: set[str] | frozenset[str] | None = self._live.get(room)
        if writers is None:
            writers = self._ended.get(room)
        if writers is None or writer_id in writers:
            return True
        self.foreign += 1
        return False

    def ended(self, room: int) -> None:
        """``room`` was released: its binding still refuses other writers for a while."""
        writers = self._live.pop(room, None)
        if writers is not None:
            self._ended[room] = frozenset(writers)
            while len(self._ended) > self.limit:
                self._ended.popitem(last=False)


# Keys of receivers this process holds or spawned (its own transports; a test harness's
# child processes), by receiver instance id: a writer in this process needs no control
# plane to get their credentials (a process cannot be impersonated to itself).
_KNOWN_KEYS: collections.OrderedDict[str, bytes] = collections.OrderedDict()
_KNOWN_LIMIT = 4096


def remember_key(receiver_id: str, key: bytes) -> None:
    """Note the key of a receiver that lives in (or was spawned by) this process."""
    _KNOWN_KEYS[receiver_id] = key
    _KNOWN_KEYS.move_to_end(receiver_id)
    while len(_KNOWN_KEYS) > _KNOWN_LIMIT:
        _KNOWN_KEYS.popitem(last=False)


def known_credential(receiver_id: str, writer_id: str) -> bytes:
    """The credential ``receiver_id`` would issue to ``writer_id``, when this process knows
    its key (:func:`remember_key`); empty otherwise."""
    key = _KNOWN_KEYS.get(receiver_id)
    return credential(key, writer_id, receiver_id) if key is not None else b""
