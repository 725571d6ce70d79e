"""``BootstrapService`` over grpc.aio: the servicer and a server that runs it.

The servicer is a thin adapter: it decodes requests, calls the pure
:class:`~pdgrpc.bootstrap.table.RoomTable` and
:class:`~pdgrpc.bootstrap.registry.WorkerRegistry`, and maps their errors to status
codes (:data:`STATUS_OF`). A background task sweeps expired rooms in small steps so the
event loop never stalls (each step frees at most ``expire_budget`` records).

    server = await start_bootstrap_server(host="127.0.0.1", port=0, ttl=120.0)
    ...   # server.address, server.table.stats
    await server.stop()
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import struct
import time
from typing import Callable, NoReturn, Sequence

import grpc
from google.protobuf.message import DecodeError

import numpy as np

from pdgrpc.bootstrap import wire
from pdgrpc.bootstrap.failures import RoomFailures
from pdgrpc.bootstrap.errors import InvalidBootstrapRequest, RoomConflict, RoomTableFull, SlotTaken, TopologyMismatch, WorkersPending
from pdgrpc.bootstrap.registry import WorkerRegistry
from pdgrpc.bootstrap.table import DEFAULT_MAX_BATCH, DEFAULT_MAX_ROOMS, DEFAULT_TTL_S, MISSING_RANK, RoomTable
from pdgrpc.errors import PdgrpcError
from pdgrpc.metrics import BootstrapMetrics
from pdgrpc.rpc.security import current, peer_identity
from pdgrpc.rpc.server import RpcServer, start_server
from pdgrpc.v1 import bootstrap_pb2 as pb

log = logging.getLogger("pdgrpc.bootstrap")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["BootstrapService"].full_name
_SMALL_BATCH = 16  # rooms; smaller calls use the generated classes, larger the numpy codec
_SMALL_MESSAGE = 256  # bytes; ditto for requests
# Packed calls of up to this many rooms are read and answered with struct and lists, no
# numpy call: between two calls numpy's code is cold, and its fixed cost (a score of numpy
# calls) is then most of a 32-room call's. Larger ones take the numpy path.
_STRUCT_ROOMS = 64

STATUS_OF: dict[type[PdgrpcError], grpc.StatusCode] = {
    InvalidBootstrapRequest: grpc.StatusCode.INVALID_ARGUMENT,
    RoomConflict: grpc.StatusCode.ALREADY_EXISTS,
    RoomTableFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    TopologyMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    WorkersPending: grpc.StatusCode.UNAVAILABLE,
    SlotTaken: grpc.StatusCode.PERMISSION_DENIED,
}


async def _abort(context: grpc.aio.ServicerContext, exc: PdgrpcError) -> NoReturn:
    code = next((c for t, c in STATUS_OF.items() if isinstance(exc, t)), grpc.StatusCode.INTERNAL)
    await context.abort(code, str(exc))
    raise AssertionError("unreachable")  # context.abort raises


class BootstrapServicer:
    """Serves one prefill instance's registry and its room table.

    Register it with :func:`add_bootstrap_servicer`, not the generated
    ``add_BootstrapServiceServicer_to_server``: ``RegisterDpRanks`` receives the raw
    request bytes and ``QueryDpRanks`` returns raw response bytes, so that large
    batches go through the vectorised codec (:mod:`pdgrpc.bootstrap.wire`).
    """

    def __init__(
        self,
        table: RoomTable,
        registry: WorkerRegistry,
        clock: Callable[[], float] = time.monotonic,
        metrics: BootstrapMetrics | None = None,
        owners: bool | None = None,
    ) -> None:
        self.table = table
        # Whether a slot is bound to the identity that registered it (SlotTaken for any
        # other): on by default where callers are authenticated (pdgrpc.rpc.security).
        self.owners = current().authenticated if owners is None else owners
        self.registry = registry
        self.clock = clock
        # Calls are counted here; table size, expirations and evictions are read from the
        # table itself at scrape time (whoever serves the endpoint calls bind_table).
        self.metrics = metrics or BootstrapMetrics()
        self.failures = RoomFailures()  # rooms whose prefill failed in its controller
        # Drawn once per process: a client that sees another value from this address knows
        # the instance restarted and drops what it cached (pdgrpc.decode.prefills).
        self.instance_id = secrets.randbits(64) | 1
        # QueryDpRanks answers are built as bytes; protobuf reads a field appended to a
        # message as part of it, so the id goes on the end of each (field 5, fixed64).
        self._instance_field = b"\x29" + struct.pack("<Q", self.instance_id)

    async def RecordRoomFailures(self, request: pb.RecordRoomFailuresRequest, context: grpc.aio.ServicerContext) -> pb.RecordRoomFailuresResponse:
        try:
            n = self.failures.record(request.failures, self.clock())
        except InvalidBootstrapRequest as exc:
            await _abort(context, exc)
        return pb.RecordRoomFailuresResponse(recorded=n)

    async def QueryRoomFailures(self, request: pb.QueryRoomFailuresRequest, context: grpc.aio.ServicerContext) -> pb.QueryRoomFailuresResponse:
        try:
            found = self.failures.query(request.keys, self.clock())
        except InvalidBootstrapRequest as exc:
            await _abort(context, exc)
        return pb.QueryRoomFailuresResponse(failures=found)

    async def RegisterDpRanks(self, data: bytes, context: grpc.aio.ServicerContext) -> pb.RegisterDpRanksResponse:
        n = 0  # rooms in the call, once decoded (a call that did not decode counts 0)
        try:
            # Entries from clients that predate the packed form: large batches through
            # the numpy codec (they start with field 1's tag, 0x0A).
            fast = wire.decode_register_request(data) if len(data) > _SMALL_MESSAGE and data[0] == 0x0A else None
            rooms: np.ndarray | Sequence[int]
            ranks: np.ndarray | Sequence[int]
            packed = 0
            one = wire.decode_one_room(data)  # the commonest call: one struct.unpack
            if one is not None:
                rooms, ranks = (one[0],), (one[1],)
                packed = 1
            elif fast is not None:
                rooms, ranks = fast
            else:
                request = pb.RegisterDpRanksRequest.FromString(data)
                if request.packed_rooms or request.packed_dp_ranks:
                    rooms, ranks = _unpack_register(request)
                    packed = len(rooms)
                else:
                    entries = request.entries
                    self._check_batch(len(entries))
                    rooms = [e.bootstrap_room for e in entries]
                    ranks = [e.dp_rank for e in entries]
            n = len(rooms)
            self._check_batch(n)
            if n and (int(ranks.max()) if isinstance(ranks, np.ndarray) else max(ranks)) == MISSING_RANK:  # packed answers use it for "not known"
                raise InvalidBootstrapRequest(f"dp_rank {MISSING_RANK} is invalid: packed answers use it for a room not known")
            result = self.table.register(rooms, ranks, self.clock(), dp_size=self.registry.dp_size)
        except DecodeError as exc:  # raw bytes: pdgrpc.rpc.limits' interceptor does not parse them
            self.metrics.on_dp_rank_registration_failed(n)
            await _abort(context, InvalidBootstrapRequest(f"RegisterDpRanks: the request is not a valid pdgrpc.v1.RegisterDpRanksRequest: {exc}"))
        except (InvalidBootstrapRequest, RoomConflict, RoomTableFull) as exc:
            self.metrics.on_dp_rank_registration_failed(n)
            await _abort(context, exc)
        self.metrics.on_dp_rank_registration(n)
        return pb.RegisterDpRanksResponse(added=result.added, unchanged=result.unchanged, packed_rooms_read=packed)

    async def QueryDpRanks(self, request: pb.QueryDpRanksRequest, context: grpc.aio.ServicerContext) -> bytes:
        return await self._query(request, context) + self._instance_field

    async def _query(self, request: pb.QueryDpRanksRequest, context: grpc.aio.ServicerContext) -> bytes:
        if request.packed_rooms or request.packed_reply:
            return await self._query_packed(request, context)
        rooms = request.bootstrap_rooms
        try:
            self._check_batch(len(rooms))
            if len(rooms) <= _SMALL_BATCH:
                found, ranks, missing = self.table.query(rooms, self.clock())
                self.metrics.on_dp_rank_query(len(rooms), missing=len(missing))
                if request.found_ranks_only:
                    return pb.QueryDpRanksResponse(found_dp_ranks=ranks, missing_rooms=missing).SerializeToString()
                entries = [pb.DpRankEntry(bootstrap_room=r, dp_rank=k) for r, k in zip(found, ranks)]
                return pb.QueryDpRanksResponse(entries=entries, missing_rooms=missing).SerializeToString()
            found_a, ranks_a, missing_a = self.table.query_array(np.array(rooms, np.uint64), self.clock())
            self.metrics.on_dp_rank_query(len(rooms), missing=len(missing_a))
        except InvalidBootstrapRequest as exc:
            self.metrics.on_dp_rank_query_failed(len(rooms))
            await _abort(context, exc)
        if request.found_ranks_only:  # packed arrays: protobuf's C encoder is fast for these
            return pb.QueryDpRanksResponse(found_dp_ranks=ranks_a.tolist(), missing_rooms=missing_a.tolist()).SerializeToString()
        return wire.encode_query_response(found_a, ranks_a, missing_a)

    async def _query_packed(self, request: pb.QueryDpRanksRequest, context: grpc.aio.ServicerContext) -> bytes:
        """QueryDpRanks with packed rooms in, or a packed answer out, or both."""
        n = len(request.bootstrap_rooms)
        data = request.packed_rooms
        if request.packed_reply and not n and len(data) <= 8 * _STRUCT_ROOMS and len(data) % 8 == 0:
            # A few rooms: struct and per-room Python, no numpy call at all.
            n = len(data) // 8
            try:
                small = self.table.lookup_rooms(struct.unpack(f"<{n}Q", data), self.clock())
            except InvalidBootstrapRequest as exc:
                self.metrics.on_dp_rank_query_failed(n)
                await _abort(context, exc)
            self.metrics.on_dp_rank_query(n, missing=small.count(MISSING_RANK))
            return pb.QueryDpRanksResponse(packed_dp_ranks=struct.pack(f"<{n}I", *small)).SerializeToString()
        try:
            if request.packed_rooms:
                if n:
                    raise InvalidBootstrapRequest("QueryDpRanksRequest: set bootstrap_rooms or packed_rooms, not both")
                keys = _le_array(request.packed_rooms, "QueryDpRanksRequest.packed_rooms", "<u8")
            else:
                keys = np.array(request.bootstrap_rooms, np.uint64)
            n = len(keys)
            self._check_batch(n)
            ranks = self.table.lookup(keys, self.clock())
            missing = ranks == MISSING_RANK
            self.metrics.on_dp_rank_query(n, missing=int(np.count_nonzero(missing)))
        except InvalidBootstrapRequest as exc:
            self.metrics.on_dp_rank_query_failed(n)
            await _abort(context, exc)
        if request.packed_reply:
            return pb.QueryDpRanksResponse(packed_dp_ranks=ranks.astype("<u4").tobytes()).SerializeToString()
        found = ~missing  # packed rooms in, the answer of found_ranks_only or entries out
        if request.found_ranks_only:
            return pb.QueryDpRanksResponse(found_dp_ranks=ranks[found].tolist(), missing_rooms=keys[missing].tolist()).SerializeToString()
        return wire.encode_query_response(keys[found], ranks[found], keys[missing])

    def _check_batch(self, n: int) -> None:
        if n > self.table.max_batch:
            raise InvalidBootstrapRequest(f"batch of {n} rooms is over the limit of {self.table.max_batch} per call; split it")

    async def RegisterWorker(self, request: pb.RegisterWorkerRequest, context: grpc.aio.ServicerContext) -> pb.RegisterWorkerResponse:
        try:
            owner = peer_identity(context) if self.owners else None
            generation, registered, expected = self.registry.register(request.worker, request.parallel_info, owner)
        except (InvalidBootstrapRequest, TopologyMismatch, SlotTaken) as exc:
            await _abort(context, exc)
        w = request.worker
        log.info(
            "worker dp%d/tp%d/pp%d registered at %s (%s), generation %d; %d of %d workers",
            w.dp_rank, w.tp_rank, w.pp_rank, w.transfer_address, w.transport or "?", generation, registered, expected,
        )
        return pb.RegisterWorkerResponse(generation=generation, registered_workers=registered, expected_workers=expected)

    async def GetParallelInfo(self, request: pb.GetParallelInfoRequest, context: grpc.aio.ServicerContext) -> pb.GetParallelInfoResponse:
        try:
            info = self.registry.parallel_info()
        except WorkersPending as exc:
            await _abort(context, exc)
        n = self.registry.registered
        return pb.GetParallelInfoResponse(parallel_info=info, registered_workers=n, expected_workers=n, instance_id=self.instance_id)

    async def GetWorkers(self, request: pb.GetWorkersRequest, context: grpc.aio.ServicerContext) -> pb.GetWorkersResponse:
        try:
            workers = self.registry.workers(request.dp_rank, request.tp_ranks)
        except (InvalidBootstrapRequest, WorkersPending) as exc:
            await _abort(context, exc)
        return pb.GetWorkersResponse(workers=workers, instance_id=self.instance_id)


def _le_array(data: bytes, field: str, dtype: str) -> np.ndarray:
    """A packed little-endian field as an array (no copy); INVALID_ARGUMENT naming
    ``field`` if its length is not a whole number of items."""
    size = np.dtype(dtype).itemsize
    if len(data) % size:
        raise InvalidBootstrapRequest(f"{field}: {len(data)} bytes is not a multiple of {size} (little-endian, {size} bytes per room)")
    return np.frombuffer(data, dtype)


def _unpack_register(request: pb.RegisterDpRanksRequest) -> tuple[np.ndarray | Sequence[int], np.ndarray | Sequence[int]]:
    """(rooms, ranks) of a packed RegisterDpRanksRequest, checked: tuples for a few
    rooms (struct), arrays beyond."""
    if request.entries:
        raise InvalidBootstrapRequest("RegisterDpRanksRequest: set entries or packed_rooms with packed_dp_ranks, not both")
    data, ranks_data = request.packed_rooms, request.packed_dp_ranks
    n = len(data) // 8
    if len(data) <= 8 * _STRUCT_ROOMS and len(data) == 8 * n and len(ranks_data) == 4 * n:
        return struct.unpack(f"<{n}Q", data), struct.unpack(f"<{n}I", ranks_data)
    rooms = _le_array(request.packed_rooms, "RegisterDpRanksRequest.packed_rooms", "<u8")
    ranks = _le_array(request.packed_dp_ranks, "RegisterDpRanksRequest.packed_dp_ranks", "<u4")
    if len(rooms) != len(ranks):
        raise InvalidBootstrapRequest(
            f"RegisterDpRanksRequest: packed_rooms holds {len(rooms)} rooms but packed_dp_ranks {len(ranks)} ranks"
        )
    return rooms, ranks


def add_bootstrap_servicer(servicer: BootstrapServicer, server: grpc.aio.Server) -> None:
    """Add ``servicer`` to ``server`` as ``pdgrpc.v1.BootstrapService``."""
    raw = None  # raw bytes in or out: the servicer does its own (de)serialization
    handlers = {
        "RegisterDpRanks": grpc.unary_unary_rpc_method_handler(
            servicer.RegisterDpRanks, request_deserializer=raw, response_serializer=pb.RegisterDpRanksResponse.SerializeToString
        ),
        "QueryDpRanks": grpc.unary_unary_rpc_method_handler(
            servicer.QueryDpRanks, request_deserializer=pb.QueryDpRanksRequest.FromString, response_serializer=raw
        ),
        "RegisterWorker": grpc.unary_unary_rpc_method_handler(
            servicer.RegisterWorker, request_deserializer=pb.RegisterWorkerRequest.FromString, response_serializer=pb.RegisterWorkerResponse.SerializeToString
        ),
        "GetParallelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetParallelInfo, request_deserializer=pb.GetParallelInfoRequest.FromString, response_serializer=pb.GetParallelInfoResponse.SerializeToString
        ),
        "GetWorkers": grpc.unary_unary_rpc_method_handler(
            servicer.GetWorkers, request_deserializer=pb.GetWorkersRequest.FromString, response_serializer=pb.GetWorkersResponse.SerializeToString
        ),
        "RecordRoomFailures": grpc.unary_unary_rpc_method_handler(
            servicer.RecordRoomFailures, request_deserializer=pb.RecordRoomFailuresRequest.FromString,
            response_serializer=pb.RecordRoomFailuresResponse.SerializeToString,
        ),
        "QueryRoomFailures": grpc.unary_unary_rpc_method_handler(
            servicer.QueryRoomFailures, request_deserializer=pb.QueryRoomFailuresRequest.FromString,
            response_serializer=pb.QueryRoomFailuresResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


@dataclasses.dataclass(frozen=True)
class BootstrapConfig:
    ttl: float = DEFAULT_TTL_S  # seconds a room → rank entry lives after its last registration
    max_rooms: int = DEFAULT_MAX_ROOMS  # hard cap; the oldest rooms are evicted beyond it
    max_batch: int = DEFAULT_MAX_BATCH  # rooms per RegisterDpRanks / QueryDpRanks call
    sweep_interval: float = 1.0  # seconds between expiry sweeps
    expire_budget: int = 16384  # records one sweep step may free before yielding the loop


class BootstrapServer:
    """A running bootstrap service: ``address``, ``table``, ``registry``, ``stop()``."""

    def __init__(self, rpc: RpcServer, servicer: BootstrapServicer, config: BootstrapConfig) -> None:
        self.rpc = rpc
        self.servicer = servicer
        self.config = config
        self.table = servicer.table
        self.registry = servicer.registry
        # Expiry sweep steps: how many, and the longest one (wall clock, and CPU time of
        # the thread, which excludes time the OS gave to other processes).
        self.sweep_steps = 0
        self.longest_sweep_step_s = 0.0
        self.longest_sweep_step_cpu_s = 0.0
        self._sweeper = asyncio.ensure_future(self._sweep())
        rpc.on_stop(self._stop_sweeper)

    @property
    def address(self) -> str:
        return self.rpc.address

    @property
    def port(self) -> int:
        return self.rpc.port

    async def stop(self, grace: float | None = 5.0) -> None:
        await self.rpc.stop(grace)

    async def __aenter__(self) -> "BootstrapServer":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop(grace=1.0)

    async def _stop_sweeper(self) -> None:
        self._sweeper.cancel()
        try:
            await self._sweeper
        except asyncio.CancelledError:
            pass

    async def _sweep(self) -> None:
        table, clock, budget = self.table, self.servicer.clock, self.config.expire_budget
        while True:
            await asyncio.sleep(self.config.sweep_interval)
            while True:
                t0, c0 = time.perf_counter(), time.thread_time()
                done = table.expire(clock(), budget)
                if done:
                    self.sweep_steps += 1
                    self.longest_sweep_step_s = max(self.longest_sweep_step_s, time.perf_counter() - t0)
                    self.longest_sweep_step_cpu_s = max(self.longest_sweep_step_cpu_s, time.thread_time() - c0)
                if done < budget:
                    break
                await asyncio.sleep(0)  # let calls in between: no step is long


async def start_bootstrap_server(
    host: str = "127.0.0.1",
    port: int = 0,
    config: BootstrapConfig = BootstrapConfig(),
    *,
    clock: Callable[[], float] = time.monotonic,
    registry: WorkerRegistry | None = None,
    metrics: BootstrapMetrics | None = None,
) -> BootstrapServer:
    """Start ``BootstrapService`` (with health and reflection) on ``host:port``."""
    table = RoomTable(ttl=config.ttl, max_rooms=config.max_rooms, max_batch=config.max_batch)
    servicer = BootstrapServicer(table, registry or WorkerRegistry(), clock, metrics)
    rpc = await start_server(
        [(SERVICE_NAME, lambda server: add_bootstrap_servicer(servicer, server))],
        host=host,
        port=port,
        what="pdgrpc bootstrap",
    )
    return BootstrapServer(rpc, servicer, config)
