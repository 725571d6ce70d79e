"""Which memory a registered region lives in (host or CUDA), what a backend can move, and
what two peers with different memory do at the handshake.

Every descriptor says, per region, the memory kind of its tensor, and which kinds its
backend instance moves (:class:`MemoryProfile`; a descriptor that says nothing is an
older, host-only peer). Both built-in data paths move each side's *own* memory only:

* ``rdma`` posts tag sends and receives whose iov entries point into the local tensors;
  UCX (a CUDA-enabled ``libucx``, as ``ucxx-cu12`` ships) detects CUDA pointers and picks
  ``cuda_ipc`` between processes on one host, GPUDirect RDMA over verbs where the NIC
  allows it, and a staged ``cuda_copy`` otherwise;
* ``tcp`` stages CUDA regions through pinned host buffers on each side
  (:mod:`pdgrpc.transport.staging`); the socket only ever carries host bytes.

So a host-memory peer and a GPU-memory peer interoperate: what crosses the wire is the
same bytes whatever each side's memory. What is refused, at the handshake
(:func:`negotiate`, called when a descriptor is parsed), with a message naming the
peer and the kind: a peer that advertises a memory kind this build does not know (a
newer peer with, say, ROCm memory), or regions in a kind its own backend says it
cannot move (an inconsistent, untrusted descriptor). Locally, :func:`check_registrable`
refuses to register a tensor whose memory the backend cannot move, naming the backend
and the device.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Iterable

from pdgrpc.errors import BadDescriptor, ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["HOST_ONLY", "MemoryKind", "MemoryProfile", "check_peer_memory", "check_registrable", "memory_kind", "negotiate"]


class MemoryKind(str, enum.Enum):
    HOST = "host"  # CPU memory (pageable or pinned)
    CUDA = "cuda"  # NVIDIA GPU memory (cudaMalloc'd, as torch's caching allocator hands out)


HOST_ONLY = frozenset({MemoryKind.HOST})


def memory_kind(tensor: "torch.Tensor") -> MemoryKind:
    """The memory kind of ``tensor``; raises :class:`ConfigError` for other devices."""
    t = tensor.device.type
    if t == "cpu":
        return MemoryKind.HOST
    if t == "cuda":
        return MemoryKind.CUDA
    raise ConfigError(f"transport regions must be host or cuda tensors, got one on {tensor.device}")


def check_registrable(backend: str, kind: MemoryKind, moves: Iterable[MemoryKind], label: str, why: str = "") -> None:
    """Raise :class:`ConfigError` unless ``backend`` (which moves ``moves``) can register a
    region of memory ``kind``; ``why`` says what would make it possible."""
    moves = frozenset(moves)
    if kind not in moves:
        can = ", ".join(sorted(k.value for k in moves))
        raise ConfigError(
            f"{backend} transport cannot register {label}: it is {kind.value} memory and this backend moves {can}"
            + (f" ({why})" if why else "")
        )


@dataclasses.dataclass(frozen=True)
class MemoryProfile:
    """One transport instance's memory, as its descriptor says: ``kinds`` of its
    registered regions, and the kinds its backend ``moves``."""

    kinds: frozenset[str]
    moves: frozenset[str]

    @classmethod
    def host(cls) -> "MemoryProfile":
        return cls(frozenset({MemoryKind.HOST.value}), frozenset({MemoryKind.HOST.value}))

    def describe(self) -> str:
        return "+".join(sorted(self.kinds)) or "no regions"


_KNOWN = frozenset(k.value for k in MemoryKind)


def negotiate(local: MemoryProfile, peer: MemoryProfile, peer_name: str) -> str:
    """What a transfer between ``local`` and ``peer`` crosses, e.g. ``"cuda <-> host"``
    (for logs), or :class:`~pdgrpc.transport.regions.BadDescriptor` naming the peer and
    the kind when the two cannot work together (see the module docstring)."""
    check_peer_memory(peer, peer_name)
    return f"{local.describe()} <-> {peer.describe()}"


def check_peer_memory(peer: MemoryProfile, peer_name: str) -> None:
    """The peer half of :func:`negotiate`: what a descriptor may say about its memory."""
    unknown = sorted((peer.kinds | peer.moves) - _KNOWN)
    if unknown:
        raise BadDescriptor(
            f"peer {peer_name} registered {', '.join(unknown)} memory; this pdgrpc moves {', '.join(sorted(_KNOWN))} "
            "only (upgrade this side, or start the peer with --device cpu or cuda)"
        )
    cannot = sorted(peer.kinds - peer.moves)
    if cannot:
        raise BadDescriptor(
            f"peer {peer_name} registered {', '.join(cannot)} memory but says its backend moves "
            f"{', '.join(sorted(peer.moves)) or 'nothing'}: refusing an inconsistent descriptor"
        )
