"""The connector's worker side: vLLM's paged KV cache on a pdgrpc transport.

Every worker registers its KV cache (one region per attention layer; a vLLM block is
a page) and a few metadata rows with its transport, and serves pdgrpc's
``HandshakeService``. Both roles run on one asyncio loop in a thread of their own;
vLLM's thread only hands jobs over (:meth:`WorkerSide.submit`) and collects
completions (:meth:`WorkerSide.take_finished`).

- **Prefill (sender).** A :class:`~pdgrpc.integrations.vllm.jobs.SendJob` keeps a
  finished request's blocks for one room. The decode's ``Handshake`` must prove the
  room's secret, match the compatibility hash and name pages the room can hold; the
  worker then writes the blocks straight into the decode's granted blocks and the
  metadata row last, and reports the request sent once the decode acknowledged the row
  (or the room failed, or its lease ran out with no handshake).
- **Decode (receiver).** A :class:`~pdgrpc.integrations.vllm.jobs.LoadJob` grants the
  room its blocks and a metadata slot (bound to the prefill's transport instance),
  sends the signed handshake, and reports the request received when the row landed,
  with the room in it: a row naming another room is corruption and fails the load.
  A failed load is reported failed, so vLLM recomputes or fails the request (its
  ``kv_load_failure_policy``); either way its blocks come back only after the room was
  released here, so no late byte lands in them.
- **Aborts.** A :class:`~pdgrpc.integrations.vllm.jobs.ReleaseJob` ends a load: the
  prefill acknowledges ``AbortRoom`` (it writes nothing more), or its connection is
  gone, and the room is released before the request is reported finished.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import threading
from typing import Any, Coroutine, Mapping

import grpc
import torch

from pdgrpc.errors import BadDescriptor, ConfigError, PdgrpcError, RequestFailed
from pdgrpc.integrations.vllm.jobs import Jobs, LoadJob, ReleaseJob, SendJob
from pdgrpc.kvpoll import KVPoll
from pdgrpc.rpc.channels import ChannelPool
from pdgrpc.rpc.server import RpcServer, start_server
from pdgrpc.serving import room_proof
from pdgrpc.serving.metadata import metadata_layout
from pdgrpc.state.metadata import MetadataBuffers, MetadataRow
from pdgrpc.state.room import Room, as_room
from pdgrpc.transport import registry
from pdgrpc.transport.base import Descriptor, MemoryRegion, Peer, RoomGrant, Transport
from pdgrpc.transport.pages import K, METADATA_REGION_ID, kv_region_id, metadata_op, metadata_region, page_ops, region_pairs
from pdgrpc.v1 import handshake_pb2, handshake_pb2_grpc

__all__ = ["Finished", "WorkerOptions", "WorkerSide", "compat_hash"]

log = logging.getLogger("pdgrpc.integrations.vllm")

PROTOCOL = "pdgrpc-vllm/1"
# Handshake errors after which the prefill may still have taken the room.
_OUTCOME_UNKNOWN = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)
HANDSHAKE_SERVICE = handshake_pb2.DESCRIPTOR.services_by_name["HandshakeService"].full_name


@dataclasses.dataclass(frozen=True)
class WorkerOptions:
    """The worker side's settings (``kv_connector_extra_config``, parsed by the connector)."""

    transport: str = "tcp"
    transport_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    host: str = "127.0.0.1"  # the HandshakeService (and tcp transport) listen here
    port: int = 0  # 0: any free port; the scheduler learns the bound one
    slots: int = 256  # metadata rows: in-flight loads (decode) and sends (prefill)
    # prefill: how long a handshake waits for its room's job, which comes with the step
    # after the request finished (with async scheduling, after one whole busy step).
    handshake_wait_s: float = 120.0
    # decode: the Handshake call's deadline; above the prefill's handshake_wait_s, so a
    # prefill that waits for its job answers before the decode gives up on it.
    handshake_timeout_s: float = 130.0
    transfer_timeout_s: float = 30.0  # decode: handshake to metadata row, at most
    abort_timeout_s: float = 2.0  # decode: AbortRoom's deadline (the transport guards past it)


@dataclasses.dataclass
class Finished:
    """Completions since the last :meth:`WorkerSide.take_finished`."""

    sending: set[str] = dataclasses.field(default_factory=set)
    recving: set[str] = dataclasses.field(default_factory=set)
    failed_recving: set[str] = dataclasses.field(default_factory=set)


def compat_hash(kv_caches: Mapping[str, torch.Tensor], block_size: int, vllm_version: str) -> bytes:
    """What must agree between a prefill and a decode for a block to mean the same KV:
    the protocol, vLLM's version, the block size and each layer's name, dtype and block
    shape (not the block count, which each server sizes for itself)."""
    doc = {
        "protocol": PROTOCOL,
        "vllm": vllm_version,
        "block_size": block_size,
        "layers": [[name, str(t.dtype), list(t.shape[1:])] for name, t in kv_caches.items()],
    }
    return hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).digest()


def kv_cache_regions(kv_caches: Mapping[str, torch.Tensor]) -> list[MemoryRegion]:
    """One KV region per layer, in the model's layer order: a block (K and V of its
    tokens, vLLM's page) is one page. Raises ConfigError naming a layer whose cache is
    not blocks-first and contiguous."""
    regions = []
    for layer, (name, t) in enumerate(kv_caches.items()):
        if not t.is_contiguous():
            raise ConfigError(f"PdgrpcConnector: KV cache of layer {name!r} is not contiguous (shape {tuple(t.shape)}, "
                              f"stride {t.stride()}); this vLLM's cache layout is not supported")
        regions.append(MemoryRegion(kv_region_id(layer, K), t, name=name))
    return regions


class _Slots:
    def __init__(self, n: int) -> None:
        self.rows = MetadataBuffers(n, metadata_layout())
        self._free = list(range(n - 1, -1, -1))

    def take(self) -> int | None:
        return self._free.pop() if self._free else None

    def give(self, slot: int) -> None:
        self.rows.clear_room(slot)
        self._free.append(slot)


@dataclasses.dataclass
class _Send:
    job: SendJob
    known: asyncio.Event
    slot: int | None = None
    task: "asyncio.Task[None] | None" = None  # the transfer, once a handshake started it
    lease: asyncio.TimerHandle | None = None


@dataclasses.dataclass
class _Load:
    job: LoadJob
    task: "asyncio.Task[None] | None" = None
    aborted: str = ""  # why the load was ended from this side


class WorkerSide:
    def __init__(self, options: WorkerOptions) -> None:
        self.options = options
        self._lock = threading.Lock()
        self._finished = Finished()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pdgrpc-vllm", daemon=True)
        self._thread.start()
        self._transport: Transport | None = None
        self._server: RpcServer | None = None
        self._channels: ChannelPool | None = None
        self._regions: list[MemoryRegion] = []
        self._descriptor = b""
        self._compat = b""
        self._slots = _Slots(options.slots)
        self._sends: dict[int, _Send] = {}
        self._loads: dict[str, _Load] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # AbortRoom calls nobody waits for
        self.address = ""

    # -- vLLM's thread -------------------------------------------------------------------
    def _call(self, coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def register(self, kv_caches: Mapping[str, torch.Tensor], compat: bytes) -> None:
        self._compat = compat
        self._regions = kv_cache_regions(kv_caches)
        self._call(self._start())

    @property
    def writer_id(self) -> str:
        assert self._transport is not None
        return self._transport.instance_id

    def submit(self, jobs: Jobs) -> None:
        if jobs:
            self._loop.call_soon_threadsafe(self._run_jobs, jobs)

    def take_finished(self) -> Finished:
        with self._lock:
            done, self._finished = self._finished, Finished()
        return done

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._call(self._stop(), timeout=15.0)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5.0)
            if not self._thread.is_alive():
                self._loop.close()

    # -- the loop --------------------------------------------------------------------------
    async def _start(self) -> None:
        opts = self.options
        transport_options = dict(opts.transport_options)
        if opts.transport == "tcp":
            transport_options.setdefault("host", opts.host)
        self._transport = registry.create(opts.transport, **transport_options)
        self._descriptor = await self._transport.register([*self._regions, metadata_region(self._slots.rows.tensor)])
        self._channels = ChannelPool()
        servicer = _HandshakeServicer(self)
        self._server = await start_server(
            [(HANDSHAKE_SERVICE, lambda s: handshake_pb2_grpc.add_HandshakeServiceServicer_to_server(servicer, s))],
            host=opts.host, port=opts.port, what="pdgrpc vLLM connector",
            flags=("kv_connector_extra_config.host", "kv_connector_extra_config.port"),
        )
        self.address = f"{opts.host}:{self._server.port}"
        log.info("pdgrpc vLLM connector: %d KV regions on %s, handshakes on %s", len(self._regions),
                 opts.transport, self.address)

    async def _stop(self) -> None:
        for load in list(self._loads.values()):
            if load.task is not None:
                load.task.cancel()
        for send in list(self._sends.values()):
            if send.task is not None:
                send.task.cancel()
        for task in list(self._tasks):
            task.cancel()
        if self._server is not None:
            await self._server.stop(grace=1.0)
        if self._channels is not None:
            await self._channels.close()
        if self._transport is not None:
            await self._transport.close()

    def _run_jobs(self, jobs: Jobs) -> None:
        for send in jobs.sends:
            self._add_send(send)
        for load in jobs.loads:
            self._start_load(load)
        for release in jobs.releases:
            self._release(release)

    def _report(self, *, sent: str = "", received: str = "", failed: bool = False) -> None:
        with self._lock:
            if sent:
                self._finished.sending.add(sent)
            if received:
                self._finished.recving.add(received)
                if failed:
                    self._finished.failed_recving.add(received)

    # -- prefill: keep blocks for a room, write them when the decode asks -----------------
    def _add_send(self, job: SendJob) -> None:
        send = self._sends.get(job.room)
        if send is None:
            send = self._sends[job.room] = _Send(job, asyncio.Event())
        else:  # a handshake came first and waits on the event
            send.job = job
        send.known.set()
        send.lease = self._loop.call_later(job.lease_s, self._expire, job.room)

    def _expire(self, room: int) -> None:
        send = self._sends.get(room)
        if send is not None and send.task is None:
            log.warning("pdgrpc vLLM connector: room %d: no decode handshake within %.0f s; its blocks are freed",
                        room, send.job.lease_s)
            self._end_send(room)

    def _end_send(self, room: int) -> None:
        send = self._sends.pop(room, None)
        if send is None:
            return
        if send.lease is not None:
            send.lease.cancel()
        if send.slot is not None:
            self._slots.give(send.slot)
        if send.job.req_id:
            self._report(sent=send.job.req_id)

    async def handshake(self, req: handshake_pb2.HandshakeRequest) -> None:
        """Start the room's transfer, or raise :class:`RequestFailed` (the call's status)."""
        room = _room(req.bootstrap_room)
        send = self._sends.get(room)
        if send is None:  # the decode may ask before this step's jobs arrived
            send = self._sends[room] = _Send(SendJob("", room, b"", (), 0.0), asyncio.Event())
        try:
            await asyncio.wait_for(send.known.wait(), self.options.handshake_wait_s)
        except asyncio.TimeoutError:
            if self._sends.get(room) is send and not send.known.is_set():
                del self._sends[room]
            raise RequestFailed(grpc.StatusCode.NOT_FOUND, f"room {room} is not held here (never prefilled, or its lease expired)")
        job = send.job
        if not room_proof.verify(job.room_secret, room_proof.handshake_message(req), bytes(req.room_proof)):
            raise RequestFailed(grpc.StatusCode.PERMISSION_DENIED, f"room {room}: room_proof does not prove the room's secret")
        if send.task is not None:
            raise RequestFailed(grpc.StatusCode.ALREADY_EXISTS, f"room {room}: its transfer already started")
        assert self._transport is not None
        if req.transport != self._transport.name:
            raise RequestFailed(grpc.StatusCode.FAILED_PRECONDITION,
                           f"transport {req.transport!r} does not match this worker's {self._transport.name!r}")
        if bytes(req.compatibility_hash) != self._compat:
            raise RequestFailed(grpc.StatusCode.FAILED_PRECONDITION,
                           f"compatibility_hash {bytes(req.compatibility_hash).hex()[:16]} does not match this worker's "
                           f"{self._compat.hex()[:16]} (model, dtype, block size or vLLM version differ)")
        dst = list(req.dst_pages)
        if len(dst) > len(job.block_ids):
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT,
                           f"dst_pages has {len(dst)} pages, room {room} holds {len(job.block_ids)}")
        if req.cached_pages > len(dst):
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, f"cached_pages {req.cached_pages} > {len(dst)} dst_pages")
        slot = self._slots.take()
        if slot is None:
            raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, f"all {self.options.slots} send rows are busy")
        send.slot = slot
        try:
            desc = Descriptor.from_bytes(bytes(req.transport_descriptor))
            self._transport.set_credential(desc.instance_id, bytes(req.transport_credential))
            peer = await self._transport.connect(bytes(req.transport_descriptor))
            first = int(req.cached_pages)
            ops = page_ops(region_pairs(self._regions, peer.descriptor.regions), job.block_ids[first:len(dst)], dst[first:])
            self._slots.rows.write_row(slot, MetadataRow(output_id=0, cached_tokens=first), room)
            meta = metadata_op(metadata_region(self._slots.rows.tensor), slot,
                               peer.descriptor.require_region(METADATA_REGION_ID), req.dst_slot)
            await self._transport.write(peer, room, ops, metadata=meta)
        except (BadDescriptor, ConfigError) as exc:
            self._forget_room(room)
            self._end_send(room)
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        except PdgrpcError as exc:
            self._forget_room(room)
            self._end_send(room)
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, f"room {room}: {exc}") from None
        if send.lease is not None:
            send.lease.cancel()
        send.task = asyncio.ensure_future(self._finish_send(room, peer))

    async def _finish_send(self, room: Room, peer: Peer) -> None:
        assert self._transport is not None
        try:
            status = await self._transport.wait(room, self.options.transfer_timeout_s)
            if status.state is not KVPoll.SUCCESS:
                log.warning("pdgrpc vLLM connector: room %d to %s ended %s: %s", room, peer.instance_id,
                            status.state.name, status.reason)
        finally:
            self._forget_room(room)
            self._end_send(room)

    def _forget_room(self, room: int) -> None:
        assert self._transport is not None
        if room in self._transport.rooms:
            self._transport.release(room)

    def holds(self, room: int) -> bool:
        """Whether this worker holds blocks for ``room`` (a job or a transfer)."""
        return room in self._sends

    async def abort_room(self, room: Room, proof: bytes, reason: str) -> bool:
        """Once this returns, nothing of this worker's can land in the room's pages."""
        send = self._sends.get(room)
        if send is None or not send.known.is_set():
            return False
        if not room_proof.verify(send.job.room_secret, room_proof.abort_message(room), proof):
            raise RequestFailed(grpc.StatusCode.PERMISSION_DENIED, f"room {room}: room_proof does not prove the room's secret")
        assert self._transport is not None
        if send.task is not None:
            send.task.cancel()
            if not await self._transport.drain(room, self.options.abort_timeout_s):
                log.warning("pdgrpc vLLM connector: room %d: writes still queued at abort", room)
            if room in self._transport.rooms:
                self._transport.release_because(room, f"aborted by the decode: {reason}")
        self._end_send(room)
        return True

    # -- decode: grant blocks, handshake, wait for the row --------------------------------
    def _start_load(self, job: LoadJob) -> None:
        load = self._loads[job.req_id] = _Load(job)
        load.task = asyncio.ensure_future(self._load(load))

    async def _load(self, load: _Load) -> None:
        job = load.job
        params = job.params
        room = params.room
        transport = self._transport
        assert transport is not None and self._channels is not None
        n = min(len(job.block_ids), len(params.block_ids))
        cached = min(job.cached_blocks, n)
        slot = self._slots.take()
        problem = "" if slot is not None else f"all {self.options.slots} metadata slots are busy"
        granted = False
        # Whether the prefill may still write into the room: then its AbortRoom
        # acknowledgement comes before the blocks go back to vLLM.
        may_write = False
        try:
            if slot is not None:
                transport.bind_writer(room, params.writer_id)
                transport.advertise(RoomGrant.of(room, job.block_ids[cached:n], slot, bound=True))
                granted = True
                req = handshake_pb2.HandshakeRequest(
                    bootstrap_room=room, dst_pages=job.block_ids[:n], dst_slot=slot, transport=transport.name,
                    transport_descriptor=self._descriptor, compatibility_hash=self._compat, decode_tp_rank=0,
                    decode_tp_size=1, wants_metadata=True, transport_credential=transport.issue_credential(params.writer_id),
                    cached_pages=cached,
                )
                req.room_proof = room_proof.handshake_proof(params.room_secret, req)
                stub = handshake_pb2_grpc.HandshakeServiceStub(self._channels.get(params.address))
                may_write = True  # from here on, until the prefill's answer says otherwise
                try:
                    await stub.Handshake(req, timeout=self.options.handshake_timeout_s)
                except grpc.aio.AioRpcError as exc:
                    # Refused, or the prefill unreachable: it writes nothing. A call that
                    # timed out may still be served: only then may it write.
                    may_write = exc.code() in _OUTCOME_UNKNOWN
                    problem = f"handshake with {params.address} failed: {exc.code().name}: {exc.details()}"
                else:
                    status = await transport.wait(room, self.options.transfer_timeout_s)
                    if status.state is not KVPoll.SUCCESS:
                        may_write = not status.peer_lost
                        problem = f"transfer {status.state.name}: {status.reason or 'timed out'}"
                    elif self._slots.rows.room(slot) != room:
                        problem = f"metadata row names room {self._slots.rows.room(slot)}, not {room}: corrupt, discarded"
        except asyncio.CancelledError:
            problem = load.aborted or "cancelled"
        except PdgrpcError as exc:
            problem = str(exc)
        if problem:
            log.warning("pdgrpc vLLM connector: request %s (room %d) not loaded: %s", job.req_id, room, problem)
            if may_write:
                await self._abort_remote(params, problem)
            else:  # nothing of the prefill's can land; it frees its blocks when told
                self._background(self._abort_remote(params, problem))
        if granted:
            if problem:
                transport.release_because(room, problem)
            else:
                transport.release(room)
        if slot is not None:
            self._slots.give(slot)
        self._loads.pop(job.req_id, None)
        self._report(received=job.req_id, failed=bool(problem))

    async def _abort_remote(self, params: Any, reason: str) -> None:
        """Tell the prefill to drop the room: it acknowledges once it writes nothing more
        (bounded; a prefill that cannot answer is gone, and its connection with it)."""
        assert self._channels is not None
        stub = handshake_pb2_grpc.HandshakeServiceStub(self._channels.get(params.address))
        msg = handshake_pb2.AbortRoomRequest(bootstrap_room=params.room, reason=reason[:200],
                                             room_proof=room_proof.abort_proof(params.room_secret, params.room))
        try:
            await stub.AbortRoom(msg, timeout=self.options.abort_timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.info("pdgrpc vLLM connector: AbortRoom for room %d at %s: %s", params.room, params.address, exc.code().name)

    def _release(self, job: ReleaseJob) -> None:
        load = self._loads.get(job.req_id) if job.req_id else None
        if load is not None and load.task is not None:
            load.aborted = "request aborted"
            load.task.cancel()  # its cleanup aborts the room at the prefill, then reports it
        elif job.req_id is None:
            self._background(self._abort_remote(job.params, "nothing to fetch"))

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _room(value: int) -> Room:
    try:
        return as_room(value)
    except ConfigError as exc:
        raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None


class _HandshakeServicer(handshake_pb2_grpc.HandshakeServiceServicer):
    def __init__(self, worker: WorkerSide) -> None:
        self.worker = worker

    async def Handshake(self, request: handshake_pb2.HandshakeRequest, context: grpc.aio.ServicerContext) -> handshake_pb2.HandshakeResponse:
        try:
            await self.worker.handshake(request)
        except RequestFailed as exc:
            await context.abort(exc.code, exc.message)
        return handshake_pb2.HandshakeResponse(generation=0)

    async def AbortRoom(self, request: handshake_pb2.AbortRoomRequest, context: grpc.aio.ServicerContext) -> handshake_pb2.AbortRoomResponse:
        try:
            active = await self.worker.abort_room(_room(request.bootstrap_room), bytes(request.room_proof), request.reason)
        except RequestFailed as exc:
            await context.abort(exc.code, exc.message)
        return handshake_pb2.AbortRoomResponse(was_active=active)

    async def WatchRoom(self, request: handshake_pb2.WatchRoomRequest, context: grpc.aio.ServicerContext) -> handshake_pb2.WatchRoomResponse:
        """Deprecated in the protocol; answered at once: PENDING while the room is held here."""
        held = self.worker.holds(request.bootstrap_room)
        return handshake_pb2.WatchRoomResponse(
            outcome=handshake_pb2.ROOM_OUTCOME_PENDING if held else handshake_pb2.ROOM_OUTCOME_NOT_FAILED
        )
