"""A fake prefill instance for decode tests, in the test's event loop.

Real parts: a :class:`~pdgrpc.bootstrap.service.BootstrapServer`, one
``HandshakeService`` gRPC server per dp rank, a real ``tcp`` transport per worker and a
local :class:`~pdgrpc.engine.reference.ReferenceEngine` (the same config as the decode
under test) that computes the prompt's KV and first token. What is fake is the
scheduling: the test tells it each request's prompt (as a router would send it to a
prefill) and how to misbehave (``mode``):

* ``"ok"``       -- accept the handshake, prefill, write the pages (all but the leading
  ``cached_pages`` the decode holds already), then the metadata row;
* ``"corrupt"``  -- the same, but the row carries another request's bootstrap_room;
* ``"hang"``     -- never answer the handshake;
* ``"hold"``     -- accept the handshake and never write (a prefill still computing);
* ``"stray"``    -- write the pages 100 pages away from where decode said (the decode's
  transport must reject the write and fail the room);
* ``"late"``     -- accept the handshake, write only once the decode's AbortRoom came (a
  prefill rank whose write trails the decode's abort).

``protocol_version=1`` makes it a prefill older than delta transfer: it advertises that
version's compatibility hash and writes every page, whatever ``cached_pages`` says.

``row_overrides[room]`` replaces fields of that room's metadata row (a bad row: a token id
outside the vocabulary, a NaN logprob), whatever the mode.

Each room's final status as the sender saw it is kept in ``FakeWorker.sent``.

``transport="fake"`` builds workers on the fake backend; they accept handshakes and
write nothing (the fake backend moves no bytes).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Callable

import grpc

from pdgrpc.bootstrap.client import BootstrapClient
from pdgrpc.bootstrap import service as bootstrap_service
from pdgrpc.bootstrap.registry import WorkerRegistry
from pdgrpc.bootstrap.service import SERVICE_NAME as BOOTSTRAP_SERVICE
from pdgrpc.bootstrap.service import BootstrapConfig, BootstrapServer, BootstrapServicer
from pdgrpc.bootstrap.table import RoomTable
from pdgrpc.engine.base import PrefillRequest, SamplingParams
from pdgrpc.engine.layout import DELTA_PROTOCOL_VERSION, PROTOCOL_VERSION
from pdgrpc.engine.reference import ReferenceEngine
from pdgrpc.rpc.server import RpcServer, start_server
from pdgrpc.serving.metadata import compat_hash_bytes, metadata_layout, row_from_token
from pdgrpc.state.metadata import MetadataBuffers
from pdgrpc.transport.descriptor import Descriptor
from pdgrpc.transport.pages import METADATA_REGION_ID, kv_regions, metadata_op, metadata_region, page_ops, region_pairs
from pdgrpc.transport import registry
from pdgrpc.transport.base import RoomStatus
from pdgrpc.v1 import bootstrap_pb2 as bpb
from pdgrpc.v1 import bootstrap_pb2_grpc as bpb_grpc
from pdgrpc.v1 import handshake_pb2 as hpb
from pdgrpc.v1 import handshake_pb2_grpc as hpb_grpc

_SEND_SLOTS = 8


@dataclasses.dataclass
class Prompt:
    input_ids: tuple[int, ...]
    sampling: SamplingParams


class RecordingBootstrap(BootstrapServicer):
    """The real bootstrap servicer, recording every QueryDpRanks: (rooms asked, rooms missing)."""

    def __init__(self) -> None:
        cfg = BootstrapConfig()
        super().__init__(RoomTable(ttl=cfg.ttl, max_rooms=1024, max_batch=1024), WorkerRegistry())
        self.queries: list[tuple[list[int], list[int]]] = []
        self.queried = asyncio.Event()
        self.failing = False  # answer every QueryDpRanks UNAVAILABLE (a bootstrap going down)
        self.failed = 0  # QueryDpRanks calls answered so

    async def QueryDpRanks(self, request: bpb.QueryDpRanksRequest, context: grpc.aio.ServicerContext) -> bpb.QueryDpRanksResponse:  # noqa: N802
        if self.failing:
            self.failed += 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "bootstrap is going down")
        resp = await super().QueryDpRanks(request, context)
        self.queries.append((list(request.bootstrap_rooms), list(resp.missing_rooms)))
        self.queried.set()
        return resp


class FakeWorker(hpb_grpc.HandshakeServiceServicer):
    """One prefill worker (dp rank ``dp_rank``, tp rank 0)."""

    def __init__(self, owner: "FakePrefill", dp_rank: int) -> None:
        self.owner = owner
        self.dp_rank = dp_rank
        self.transport = registry.create(owner.transport)
        self.handshakes: list[hpb.HandshakeRequest] = []
        self.aborts: list[hpb.AbortRoomRequest] = []
        self.got_handshake = asyncio.Event()
        self.got_abort = asyncio.Event()
        self.sent: dict[int, RoomStatus] = {}  # room -> the sender's final status
        self.rpc: RpcServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._send = MetadataBuffers(_SEND_SLOTS, metadata_layout())

    async def start(self) -> None:
        kv = self.owner.engine.kv_buffers()
        self.regions = [*kv_regions(kv.k, kv.v), metadata_region(self._send.tensor)]
        self.descriptor = await self.transport.register(self.regions)
        self.rpc = await start_server(
            [("pdgrpc.v1.HandshakeService", lambda s: hpb_grpc.add_HandshakeServiceServicer_to_server(self, s))],
            what=f"fake prefill worker dp{self.dp_rank}",
        )

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.rpc is not None:
            await self.rpc.stop(grace=0.5)
        await self.transport.close()

    async def Handshake(self, request: hpb.HandshakeRequest, context: grpc.aio.ServicerContext) -> hpb.HandshakeResponse:  # noqa: N802
        self.handshakes.append(request)
        self.got_handshake.set()
        if request.compatibility_hash != self.owner.compat_hash:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "compatibility hash mismatch")
        mode = self.owner.mode
        if mode == "hang":
            await asyncio.Event().wait()  # until the decode gives up and cancels the call
        if request.transport_credential:  # as a real prefill worker does (pdgrpc.transport.peerauth)
            self.transport.set_credential(Descriptor.from_bytes(request.transport_descriptor).instance_id,
                                          request.transport_credential)
        peer = await self.transport.connect(request.transport_descriptor)
        if mode != "hold" and self.transport.moves_bytes:
            # Its own send row, chosen now: rooms computed at once must not share one.
            slot = (len(self.handshakes) - 1) % _SEND_SLOTS
            task = asyncio.ensure_future(self._prefill_and_send(request, peer, slot))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return hpb.HandshakeResponse(generation=self.owner.generation[self.dp_rank])

    async def AbortRoom(self, request: hpb.AbortRoomRequest, context: grpc.aio.ServicerContext) -> hpb.AbortRoomResponse:  # noqa: N802
        self.aborts.append(request)
        self.got_abort.set()
        return hpb.AbortRoomResponse(was_active=any(h.bootstrap_room == request.bootstrap_room for h in self.handshakes))

    async def _prefill_and_send(self, request: hpb.HandshakeRequest, peer, slot: int) -> None:  # type: ignore[no-untyped-def]
        engine = self.owner.engine
        room = request.bootstrap_room
        prompt = self.owner.prompts[room]
        pages = engine.alloc_pages(engine.pages_needed(len(prompt.input_ids)))
        assert pages is not None, "fake prefill ran out of pages"
        try:
            if self.owner.send_delay_s:
                await asyncio.sleep(self.owner.send_delay_s)
            if self.owner.mode == "late":
                await self.got_abort.wait()
            first = engine.prefill_chunk(PrefillRequest(prompt.input_ids, tuple(pages), prompt.sampling), 0, len(prompt.input_ids))
            assert first is not None
            dst = [p + 100 for p in request.dst_pages] if self.owner.mode == "stray" else list(request.dst_pages)
            # The decode holds these already: a prefill never writes them (one older than
            # the field writes them all).
            k = request.cached_pages if self.owner.protocol_version >= DELTA_PROTOCOL_VERSION else 0
            ops = page_ops(region_pairs(self.regions, peer.descriptor.regions), pages[k:], dst[k:])
            written_room = room + 1 if self.owner.mode == "corrupt" else room
            row = row_from_token(first)
            if room in self.owner.row_overrides:  # a prefill writing a bad row for this room
                row = dataclasses.replace(row, **self.owner.row_overrides[room])
            self._send.write_row(slot, row, written_room)
            meta_dst = peer.descriptor.region(METADATA_REGION_ID)
            meta = metadata_op(self.regions[-1], slot, meta_dst, request.dst_slot)
            await self.transport.write(peer, room, ops, metadata=meta)
            self.sent[room] = await self.transport.wait(room, 10.0)
        finally:
            self.transport.release(room)
            engine.free_pages(pages)


class FakePrefill:
    """A bootstrap service and ``dp_size`` fake workers sharing one engine."""

    def __init__(
        self,
        engine: ReferenceEngine,
        dp_size: int = 1,
        method: int = bpb.LOAD_BALANCE_METHOD_FOLLOW_BOOTSTRAP_ROOM,
        compat_hash: bytes | None = None,
        transport: str = "tcp",
        port: int = 0,
        protocol_version: int = PROTOCOL_VERSION,
    ) -> None:
        self.engine = engine
        self.port = port  # the bootstrap's port; 0 picks a free one
        self.transport = transport
        self.dp_size = dp_size
        self.method = method
        self.protocol_version = protocol_version
        self.compat_hash = compat_hash if compat_hash is not None else compat_hash_bytes(engine, protocol_version)
        self.mode = "ok"
        self.send_delay_s = 0.0  # seconds between accepting a handshake and computing + writing
        self.prompts: dict[int, Prompt] = {}
        self.row_overrides: dict[int, dict[str, object]] = {}  # room -> MetadataRow fields written instead
        self.generation: dict[int, int] = {}
        self.workers = [FakeWorker(self, r) for r in range(dp_size)]
        self.bootstrap: BootstrapServer | None = None
        self.recorder_factory: Callable[[], RecordingBootstrap] = RecordingBootstrap  # the bootstrap servicer to run

    @property
    def address(self) -> str:
        assert self.bootstrap is not None
        return self.bootstrap.address

    async def start(self) -> "FakePrefill":
        self.recorder = self.recorder_factory()
        # Register it the way start_bootstrap_server does (its own (de)serializers, if any).
        add = getattr(bootstrap_service, "add_bootstrap_servicer", bpb_grpc.add_BootstrapServiceServicer_to_server)
        rpc = await start_server(
            [(BOOTSTRAP_SERVICE, lambda server: add(self.recorder, server))],
            what="fake prefill bootstrap",
            port=self.port,
        )
        self.bootstrap = BootstrapServer(rpc, self.recorder, BootstrapConfig())
        for w in self.workers:
            await self._start_worker(w)
        return self

    async def _start_worker(self, w: FakeWorker) -> None:
        layout = self.engine.kv_layout
        info = bpb.ParallelInfo(
            tp_size=1, dp_size=self.dp_size, pp_size=1, page_size=layout.page_size, kv_dtype=self.engine.config.kv_dtype,
            kv_layout="HND", compatibility_hash=self.compat_hash, load_balance_method=self.method,
        )
        await w.start()
        assert w.rpc is not None
        resp = await BootstrapClient(self.address).register_worker(
            bpb.WorkerInfo(
                dp_rank=w.dp_rank, tp_rank=0, pp_rank=0, transfer_address=w.rpc.address, transport=self.transport,
                transport_endpoint=w.descriptor,
            ),
            info,
        )
        self.generation[w.dp_rank] = resp.generation

    async def restart_worker(self, dp_rank: int) -> FakeWorker:
        """Stop the worker and start a fresh one (new port, new transport instance) that
        registers again: bootstrap bumps its generation."""
        await self.workers[dp_rank].stop()
        w = self.workers[dp_rank] = FakeWorker(self, dp_rank)
        await self._start_worker(w)
        return w

    async def register_rank(self, room: int, dp_rank: int) -> None:
        await BootstrapClient(self.address).register_dp_ranks({room: dp_rank})

    async def stop(self) -> None:
        for w in self.workers:
            await w.stop()
        if self.bootstrap is not None:
            await self.bootstrap.stop(grace=0.5)
