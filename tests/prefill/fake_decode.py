"""A fake decode for prefill tests, in the test's event loop.

Real parts: a transport *receiver* (the backend under test) holding a KV pool with the
decode's layout and metadata rows of the shared layout, and real gRPC calls --
``QueryDpRanks`` / ``GetWorkers`` to the prefill's bootstrap, ``Handshake`` / ``AbortRoom``
to the worker. What is fake is the scheduling: the test says which room goes where.

Like the router, the tests give each room a secret (:func:`room_secret`, derived from the
room so that the ``Prefill`` a test sends and the fake decode's handshake agree); the
fake decode signs its handshakes with it unless a test passes its own ``room_proof``.
"""

from __future__ import annotations

import dataclasses
import hashlib

import grpc
import torch

from pdgrpc.engine.base import PrefillRequest, SampledToken, SamplingParams
from pdgrpc.engine.config import EngineConfig
from pdgrpc.engine.reference import ReferenceEngine
from pdgrpc.kvpoll import KVPoll
from pdgrpc.serving.metadata import compat_hash_bytes, metadata_layout
from pdgrpc.state.metadata import MetadataBuffers, MetadataRow
from pdgrpc.transport import registry
from pdgrpc.transport.base import BadDescriptor, Descriptor, RoomGrant, RoomStatus, Transport
from pdgrpc.transport.base import MemoryRegion, RegionKind
from pdgrpc.transport.pages import kv_regions, metadata_region
from pdgrpc.serving.room_proof import abort_proof, handshake_proof
from pdgrpc.serving.tp import METADATA_SINK_REGION_ID
from pdgrpc.v1 import bootstrap_pb2 as bpb
from pdgrpc.v1 import bootstrap_pb2_grpc as bpb_grpc
from pdgrpc.v1 import handshake_pb2 as hpb
from pdgrpc.v1 import handshake_pb2_grpc as hpb_grpc
from tests.eventually import eventually_async


def room_secret(room: int) -> bytes:
    """The tests' per-room secret (32 bytes, as the router draws them)."""
    return hashlib.sha256(b"pdgrpc tests: room secret %d" % room).digest()


def abort_request(room: int, reason: str) -> hpb.AbortRoomRequest:
    """An ``AbortRoom`` for ``room`` with the chosen decode's proof."""
    return hpb.AbortRoomRequest(bootstrap_room=room, reason=reason, room_proof=abort_proof(room_secret(room), room))


# Bootstrap addresses of the prefills this test process started (tests.prefill.procs
# adds them): where a fake decode looks up a worker's transport instance id.
KNOWN_BOOTSTRAPS: list[str] = []


class _CredentialingStub:
    """A ``HandshakeService`` stub that, like decode, puts the data-plane credential for
    the worker it calls into each ``Handshake`` that carries none."""

    def __init__(self, owner: "FakeDecode", address: str) -> None:
        self._owner = owner
        self._stub = hpb_grpc.HandshakeServiceStub(owner.channel(address))
        self._address = address
        self.AbortRoom = self._stub.AbortRoom
        self.WatchRoom = self._stub.WatchRoom

    async def Handshake(self, request: hpb.HandshakeRequest, **kwargs: object) -> hpb.HandshakeResponse:  # noqa: N802
        if not request.transport_credential and self._owner.transport.moves_bytes:
            writer = await self._owner.writer_id(self._address)
            if writer:
                # The proof covers the credential: one made under a secret this fake decode
                # knows is made again, as decode signs after adding the credential.
                secret = self._owner.secrets.get(request.bootstrap_room) or room_secret(request.bootstrap_room)
                resign = request.room_proof == handshake_proof(secret, request)
                request.transport_credential = self._owner.transport.issue_credential(writer)
                if resign:
                    request.room_proof = handshake_proof(secret, request)
        return await self._stub.Handshake(request, **kwargs)  # type: ignore[arg-type]


@dataclasses.dataclass
class Room:
    room: int
    pages: list[int]
    slot: int
    worker: str = ""  # transfer address the handshake went to
    keys: list[int] = dataclasses.field(default_factory=list)  # transport keys granted


class FakeDecode:
    """One decode rank. ``tp_size > 1``: its pool holds KV heads ``heads_of(tp_rank)``
    only; ``sink``: it also registers a metadata sink region (rows in :attr:`sink`)."""

    def __init__(self, config: EngineConfig, transport: str = "tcp", num_slots: int = 16, *,
                 tp_rank: int = 0, tp_size: int = 1, sink: bool = False) -> None:
        self.tp_rank, self.tp_size = tp_rank, tp_size
        if tp_size > 1:
            config = dataclasses.replace(config, tp_rank=tp_rank, tp_size=tp_size)
        # only its KV pool and page allocator are used (the all-reduce never runs)
        self.engine = ReferenceEngine(config, all_reduce=(lambda t: t) if tp_size > 1 else None)
        self.rows = MetadataBuffers(num_slots, metadata_layout())
        self.sink = MetadataBuffers(num_slots, metadata_layout()) if sink else None
        self.transport: Transport = registry.create(transport)
        self.transport_name = transport
        self.compat_hash = compat_hash_bytes(self.engine)
        self.descriptor = b""
        self._free_slots = list(range(num_slots))
        self._channels: dict[str, grpc.aio.Channel] = {}
        # Rooms whose handshakes a test signs under its own secret (not room_secret(room)).
        self.secrets: dict[int, bytes] = {}

    async def start(self) -> None:
        bufs = self.engine.kv_buffers()
        regions = [*kv_regions(bufs.k, bufs.v), metadata_region(self.rows.tensor)]
        if self.sink is not None:
            regions.append(MemoryRegion(METADATA_SINK_REGION_ID, self.sink.tensor, RegionKind.METADATA, "metadata_sink"))
        self.descriptor = await self.transport.register(regions)

    async def __aenter__(self) -> FakeDecode:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.transport.close()
        for ch in self._channels.values():
            await ch.close()

    def channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(address)
        return self._channels[address]

    def stub(self, address: str) -> "_CredentialingStub":
        return _CredentialingStub(self, address)

    async def writer_id(self, address: str) -> str:
        """The transport instance id of the prefill worker at ``address``, from the
        bootstraps of the prefills this test process started (as decode learns it)."""
        for bootstrap in reversed(KNOWN_BOOTSTRAPS):
            try:
                stub = self.bootstrap_stub(bootstrap)
                info = await stub.GetParallelInfo(bpb.GetParallelInfoRequest(), timeout=5)
                for rank in range(max(1, info.parallel_info.dp_size)):
                    for w in (await stub.GetWorkers(bpb.GetWorkersRequest(dp_rank=rank), timeout=5)).workers:
                        if w.transfer_address == address:
                            return Descriptor.from_bytes(w.transport_endpoint).instance_id
            except (grpc.RpcError, BadDescriptor):
                continue
        return ""

    # -- a room's life on the decode side ---------------------------------------------------

    def allocate(self, room: int, num_tokens: int, keys: list[int] | None = None) -> Room:
        """Pages and a slot for ``room``, granted under each transport key in ``keys``
        (default: the room itself; a TP pair's key is ``transfer_room(room, p, d)``)."""
        pages = self.engine.alloc_pages(self.engine.pages_needed(num_tokens))
        assert pages is not None, "fake decode pool exhausted"
        slot = self._free_slots.pop(0)
        for key in keys or [room]:
            self.transport.advertise(RoomGrant.of(key, pages, slot))
        return Room(room, pages, slot, keys=list(keys or [room]))

    async def worker_for(self, bootstrap: str, room: int, *, query: bool, dp_size: int, timeout: float = 20.0) -> str:
        """The transfer address of the worker holding ``room``, found the way decode does:
        ``room % dp_size`` on the fast path, else QueryDpRanks until bootstrap knows it."""
        stub = self.bootstrap_stub(bootstrap)
        rank = room % dp_size
        if query:
            async def entries() -> list[bpb.DpRankEntry]:
                return list((await stub.QueryDpRanks(bpb.QueryDpRanksRequest(bootstrap_rooms=[room]), timeout=5)).entries)

            rank = (await eventually_async(entries, timeout, what=f"room {room} registered with bootstrap"))[0].dp_rank
        return (await self.workers(bootstrap, rank))[0].transfer_address

    async def workers(self, bootstrap: str, rank: int) -> list[bpb.WorkerInfo]:
        res = await self.bootstrap_stub(bootstrap).GetWorkers(bpb.GetWorkersRequest(dp_rank=rank), timeout=5)
        return list(res.workers)

    async def registered(self, bootstrap: str, room: int) -> bool:
        res = await self.bootstrap_stub(bootstrap).QueryDpRanks(bpb.QueryDpRanksRequest(bootstrap_rooms=[room]), timeout=5)
        return bool(res.entries)

    def bootstrap_stub(self, address: str) -> bpb_grpc.BootstrapServiceStub:
        return bpb_grpc.BootstrapServiceStub(self.channel(address))

    def handshake_request(self, r: Room, **override: object) -> hpb.HandshakeRequest:
        fields: dict[str, object] = dict(
            bootstrap_room=r.room, dst_pages=r.pages, dst_slot=r.slot, transport=self.transport_name,
            transport_descriptor=self.descriptor, compatibility_hash=self.compat_hash,
            decode_tp_rank=self.tp_rank, decode_tp_size=self.tp_size, wants_metadata=True,
        )
        fields.update(override)
        req = hpb.HandshakeRequest(**fields)  # type: ignore[arg-type]
        if "room_proof" not in override:  # signed like the chosen decode signs it
            req.room_proof = handshake_proof(room_secret(req.bootstrap_room), req)
        return req

    async def handshake(self, worker: str, r: Room, **override: object) -> hpb.HandshakeResponse:
        r.worker = worker
        return await self.stub(worker).Handshake(self.handshake_request(r, **override), timeout=10.0)

    async def wait(self, r: Room, timeout: float = 60.0) -> RoomStatus:
        return await self.transport.wait(r.room, timeout)

    def free(self, r: Room) -> None:
        """Release the room like decode does: revoke the grant, zero the slot's room, free."""
        for key in r.keys or [r.room]:
            self.transport.release(key)
        self.rows.clear_room(r.slot)
        if self.sink is not None:
            self.sink.clear_room(r.slot)
        self._free_slots.append(r.slot)
        self.engine.free_pages(r.pages)

    # -- what landed ------------------------------------------------------------------------

    def kv_of(self, pages: list[int], num_tokens: int, engine: ReferenceEngine | None = None) -> list[torch.Tensor]:
        """Per layer and K/V, the first ``num_tokens`` token rows held in ``pages``:
        ``[heads, num_tokens, head_dim]`` (stale rows past the prompt are left out)."""
        bufs = (engine or self.engine).kv_buffers()
        out = []
        for pool in (*bufs.k, *bufs.v):
            rows = pool[pages]  # [n_pages, heads, page_size, head_dim]
            rows = rows.permute(1, 0, 2, 3).reshape(pool.shape[1], -1, pool.shape[3])
            out.append(rows[:, :num_tokens].clone())
        return out

    def row(self, r: Room) -> MetadataRow:
        return self.rows.read_row(r.slot)


def reference_prefill(config: EngineConfig, ids: list[int], sampling: SamplingParams) -> tuple[ReferenceEngine, list[int], SampledToken]:
    """The prompt prefilled by a local engine in one chunk: (engine, pages, first token)."""
    eng = ReferenceEngine(config)
    pages = eng.alloc_pages(eng.pages_needed(len(ids)))
    assert pages is not None
    tok = eng.prefill_chunk(PrefillRequest(tuple(ids), tuple(pages), sampling), 0, len(ids))
    assert tok is not None
    return eng, pages, tok


__all__ = ["FakeDecode", "KVPoll", "Room", "reference_prefill"]
