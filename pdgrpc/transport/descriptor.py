"""The descriptor: what one transport instance tells its peers (untrusted bytes to them),
and the :class:`Peer` that ``connect`` returns."""

from __future__ import annotations

import base64
import dataclasses
import json

from pdgrpc.transport.memkind import MemoryProfile, check_peer_memory
from pdgrpc.transport.regions import BadDescriptor, RegionInfo, RegionKind

__all__ = ["DESCRIPTOR_VERSION", "Descriptor", "Peer"]

# Descriptor wire format version; bump on incompatible changes (peers refuse others).
DESCRIPTOR_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Descriptor:
    """What one transport instance tells its peers, as bytes in the handshake.

    ``instance_id`` is fresh per transport instance (per process start): it is the
    connection-cache key and the generation that tells a restarted peer apart.
    ``endpoint`` is backend-specific (``host:port``, a UCX worker address, ...).
    ``liveness`` is the optional ``host:port`` of a :mod:`pdgrpc.transport.liveness`
    side channel ("" when the backend does not use one). Each region says its memory
    kind; a peer whose memory cannot work with ours is refused when its descriptor is
    parsed (:mod:`pdgrpc.transport.memkind`).
    """

    backend: str
    instance_id: str
    endpoint: bytes
    regions: tuple[RegionInfo, ...] = ()
    liveness: str = ""
    # Memory kinds the backend instance moves; empty: host plus its regions' kinds (a
    # backend that registered a region moves its memory). See transport.memkind.
    moves: tuple[str, ...] = ()

    def memory_profile(self) -> MemoryProfile:
        kinds = frozenset(r.memory for r in self.regions)
        moves = frozenset(self.moves) if self.moves else frozenset({"host"}) | kinds
        return MemoryProfile(kinds, moves)

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
                + ([] if r.memory == "host" else [r.memory])  # host-only descriptors stay as before
                for r in self.regions
            ],
        }
        moves = self.memory_profile().moves
        if moves != {"host"}:
            doc["moves"] = sorted(moves)
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
                RegionInfo(int(i), str(n), RegionKind(k), int(nb), int(ib), base64.b64decode(bd), str(mem[0]) if mem else "host")
                for i, n, k, nb, ib, bd, *mem in doc["regions"]
            )
            moves = doc.get("moves", [])
            if not isinstance(moves, list) or not all(isinstance(m, str) for m in moves):
                raise BadDescriptor("malformed descriptor: 'moves' must be a list of memory kinds")
            d = cls(
                backend=str(doc["backend"]),
                instance_id=str(doc["instance_id"]),
                endpoint=base64.b64decode(doc["endpoint"]),
                regions=regions,
                liveness=str(doc.get("liveness", "")),
                moves=tuple(moves),
            )
        except BadDescriptor:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise BadDescriptor(f"malformed descriptor: {exc!r}") from None
        if len({r.region_id for r in regions}) != len(regions):
            raise BadDescriptor("descriptor lists a region_id twice")
        check_peer_memory(d.memory_profile(), d.instance_id)
        if not d.instance_id:
            raise BadDescriptor("descriptor has an empty instance_id")
        return d


@dataclasses.dataclass(frozen=True)
class Peer:
    """A connected peer, as returned by :meth:`Transport.connect`."""

    instance_id: str
    descriptor: Descriptor
