"""``BootstrapService`` over grpc.aio: the servicer and a server that runs it.

The servicer is a thin adapter: it decodes requests, calls the pure
:class:`~pdgrpc.bootstrap.table.RoomTable` and
:class:`~pdgrpc.bootstrap.registry.WorkerRegistry`, and maps their errors to status
codes (:data:`STATUS_OF`). A background task sweeps expired rooms in small steps so the
event loop never stalls (each step frees at most ``expire_budget`` records).

    server = await start_bootstrap_server("127.0.0.1", 0, BootstrapConfig(ttl=120.0))
    ...   # server.address, server.table.stats
    await server.stop()
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from typing import TYPE_CHECKING, Callable, NoReturn, Sequence

import grpc

from pdgrpc.bootstrap.defaults import DEFAULT_MAX_BATCH, DEFAULT_MAX_ROOMS, DEFAULT_TTL_S
from pdgrpc.bootstrap.failures import MAX_WAIT_MS, RoomFailures
from pdgrpc.bootstrap.errors import (
    InvalidBootstrapRequest, NotPermitted, PendingWorkersFull, RoomConflict, RoomQuotaFull, RoomTableFull, TopologyMismatch,
    WorkersPending,
)
from pdgrpc.bootstrap.registry import WorkerRegistry
from pdgrpc.errors import PdgrpcError
from pdgrpc.metrics import BootstrapMetrics
from pdgrpc.rpc.open_calls import TooManyOpenCalls
from pdgrpc.rpc.security import current, peer_identity
from pdgrpc.rpc.server import RpcServer, start_server
from pdgrpc.v1 import bootstrap_pb2 as pb
from pdgrpc.v1 import bootstrap_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from pdgrpc.bootstrap.table import RoomTable

log = logging.getLogger("pdgrpc.bootstrap")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["BootstrapService"].full_name

# The bootstrap's one mapping from its failures to statuses: its servicer raises or
# passes these, and _abort() alone picks a code (INTERNAL for anything else).
STATUS_OF: dict[type[PdgrpcError], grpc.StatusCode] = {
    InvalidBootstrapRequest: grpc.StatusCode.INVALID_ARGUMENT,
    RoomConflict: grpc.StatusCode.ALREADY_EXISTS,
    RoomTableFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    PendingWorkersFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    TopologyMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    WorkersPending: grpc.StatusCode.UNAVAILABLE,
    NotPermitted: grpc.StatusCode.PERMISSION_DENIED,
    TooManyOpenCalls: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


async def _abort(context: grpc.aio.ServicerContext, exc: PdgrpcError) -> NoReturn:
    code = next((c for t, c in STATUS_OF.items() if isinstance(exc, t)), grpc.StatusCode.INTERNAL)
    await context.abort(code, str(exc))
    raise AssertionError("unreachable")  # context.abort raises


class BootstrapServicer(pb_grpc.BootstrapServiceServicer):
    """Serves one prefill instance's registry and its room table (add it to a server
    with :func:`add_bootstrap_servicer`)."""

    def __init__(
        self,
        table: RoomTable,
        registry: WorkerRegistry,
        clock: Callable[[], float] = time.monotonic,
        metrics: BootstrapMetrics | None = None,
        owners: bool | None = None,
        max_rooms_per_registrant: int = 0,
    ) -> None:
        """``max_rooms_per_registrant``: rooms no decode has queried yet that one caller
        identity may hold (0: ``max_rooms`` divided by the identities that registered
        workers; without authentication every caller is one registrant, unlimited)."""
        if max_rooms_per_registrant < 0:
            raise InvalidBootstrapRequest(f"max_rooms_per_registrant must be >= 0, got {max_rooms_per_registrant}")
        self.table = table
        self.max_rooms_per_registrant = max_rooms_per_registrant
        self._registrants: dict[str, int] = {}  # caller identity -> the table's registrant number
        # Whether a slot is bound to the identity that registered it (NotPermitted for any
        # other): on by default where callers are authenticated (pdgrpc.rpc.security).
        self.owners = current().authenticated if owners is None else owners
        self.registry = registry
        self.clock = clock
        # Calls are counted here; table size, expirations and evictions are read from the
        # table itself at scrape time (whoever serves the endpoint calls bind_table).
        self.metrics = metrics or BootstrapMetrics()
        self.failures = RoomFailures()  # rooms whose prefill failed (the decodes ask here)
        # Drawn once per process: a client that sees another value from this address knows
        # the instance restarted and drops what it cached (pdgrpc.decode.prefills).
        self.instance_id = secrets.randbits(64) | 1

    async def _check_member(self, context: grpc.aio.ServicerContext, rpc: str) -> None:
        """With authentication on, only the identities that registered a worker of this
        instance (its prefill: the controller presents the workers' identity) register
        rooms and record failures: any other caller could fill the room table or push
        genuine failure records out. Refused with PERMISSION_DENIED before anything."""
        if not self.owners:
            return
        who = peer_identity(context)
        if not self.registry.registered_by(who):
            await _abort(context, NotPermitted(f"{rpc}: caller {who} registered no worker of this prefill instance"))

    async def RecordRoomFailures(self, request: pb.RecordRoomFailuresRequest, context: grpc.aio.ServicerContext) -> pb.RecordRoomFailuresResponse:
        await self._check_member(context, "RecordRoomFailures")
        try:
            n = self.failures.record(request.failures, self.clock())
        except InvalidBootstrapRequest as exc:
            await _abort(context, exc)
        return pb.RecordRoomFailuresResponse(recorded=n)

    async def QueryRoomFailures(self, request: pb.QueryRoomFailuresRequest, context: grpc.aio.ServicerContext) -> pb.QueryRoomFailuresResponse:
        try:
            found = await self.failures.wait(
                request.keys, self.clock, min(request.max_wait_ms, MAX_WAIT_MS) / 1000, caller=peer_identity(context)
            )
        except (InvalidBootstrapRequest, TooManyOpenCalls) as exc:
            await _abort(context, exc)
        return pb.QueryRoomFailuresResponse(failures=found)

    async def RegisterDpRanks(self, request: pb.RegisterDpRanksRequest, context: grpc.aio.ServicerContext) -> pb.RegisterDpRanksResponse:
        n = len(request.entries) or len(request.bootstrap_rooms)
        await self._check_member(context, "RegisterDpRanks")
        who, registrant, quota = self._registrant(context)
        try:
            self._check_batch(n)
            rooms: Sequence[int]
            ranks: Sequence[int]
            if request.entries:  # one message per room: what other languages' clients send
                if request.bootstrap_rooms or request.dp_ranks:
                    raise InvalidBootstrapRequest("RegisterDpRanksRequest: set entries or bootstrap_rooms with dp_ranks, not both")
                rooms = [e.bootstrap_room for e in request.entries]
                ranks = [e.dp_rank for e in request.entries]
            else:
                rooms, ranks = request.bootstrap_rooms, request.dp_ranks
                if len(rooms) != len(ranks):
                    raise InvalidBootstrapRequest(f"RegisterDpRanksRequest: {len(rooms)} bootstrap_rooms but {len(ranks)} dp_ranks")
            result = self.table.register(rooms, ranks, self.clock(), dp_size=self.registry.dp_size, registrant=registrant, quota=quota)
        except RoomQuotaFull as exc:  # name the caller: the table knows only its number
            self.metrics.on_dp_rank_registration_failed(n)
            await _abort(context, RoomQuotaFull(exc.live, exc.max_rooms, exc.new, caller=f"RegisterDpRanks: caller {who}"))
        except (InvalidBootstrapRequest, RoomConflict, RoomTableFull) as exc:
            self.metrics.on_dp_rank_registration_failed(n)
            await _abort(context, exc)
        self.metrics.on_dp_rank_registration(n)
        return pb.RegisterDpRanksResponse(added=result.added, unchanged=result.unchanged)

    def _registrant(self, context: grpc.aio.ServicerContext) -> tuple[str, int, int | None]:
        """The caller's identity, its registrant number in the table, and its quota of
        unqueried rooms: a share of the table per identity that registered workers, so one
        worker looping RegisterDpRanks cannot crowd the others' rooms out."""
        if not self.owners:
            return "(unauthenticated)", 0, self.max_rooms_per_registrant or None
        who = peer_identity(context)
        registrant = self._registrants.setdefault(who, len(self._registrants))
        quota = self.max_rooms_per_registrant or max(1, self.table.max_rooms // max(1, self.registry.identities()))
        return who, registrant, quota

    def _querier(self, context: grpc.aio.ServicerContext) -> int | None:
        """The caller's registrant number where it has registered rooms under its identity
        (its own lookups then leave those rooms in its quota, :meth:`RoomTable.query`);
        None otherwise, and without authentication, where every caller is one registrant."""
        return self._registrants.get(peer_identity(context)) if self.owners else None

    async def QueryDpRanks(self, request: pb.QueryDpRanksRequest, context: grpc.aio.ServicerContext) -> pb.QueryDpRanksResponse:
        rooms = request.bootstrap_rooms
        try:
            self._check_batch(len(rooms))
            found, ranks, missing = self.table.query(rooms, self.clock(), self._querier(context))
        except InvalidBootstrapRequest as exc:
            self.metrics.on_dp_rank_query_failed(len(rooms))
            await _abort(context, exc)
        self.metrics.on_dp_rank_query(len(rooms), missing=len(missing))
        if request.found_ranks_only:
            return pb.QueryDpRanksResponse(found_dp_ranks=ranks, missing_rooms=missing, instance_id=self.instance_id)
        entries = [pb.DpRankEntry(bootstrap_room=r, dp_rank=k) for r, k in zip(found, ranks)]
        return pb.QueryDpRanksResponse(entries=entries, missing_rooms=missing, instance_id=self.instance_id)

    def _check_batch(self, n: int) -> None:
        if n > self.table.max_batch:
            raise InvalidBootstrapRequest(f"batch of {n} rooms is over the limit of {self.table.max_batch} per call; split it")

    async def RegisterWorker(self, request: pb.RegisterWorkerRequest, context: grpc.aio.ServicerContext) -> pb.RegisterWorkerResponse:
        try:
            owner = peer_identity(context) if self.owners else None
            generation, registered, expected = self.registry.register(request.worker, request.parallel_info, owner)
        except (InvalidBootstrapRequest, TopologyMismatch, NotPermitted, PendingWorkersFull) as exc:
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


def add_bootstrap_servicer(servicer: BootstrapServicer, server: grpc.aio.Server) -> None:
    """Add ``servicer`` to ``server`` as ``pdgrpc.v1.BootstrapService``."""
    pb_grpc.add_BootstrapServiceServicer_to_server(servicer, server)


@dataclasses.dataclass(frozen=True)
class BootstrapConfig:
    ttl: float = DEFAULT_TTL_S  # seconds a room → rank entry lives after its last registration
    max_rooms: int = DEFAULT_MAX_ROOMS  # hard cap; the oldest unqueried rooms are evicted beyond it
    max_batch: int = DEFAULT_MAX_BATCH  # rooms per RegisterDpRanks / QueryDpRanks call
    max_rooms_per_registrant: int = 0  # unqueried rooms one caller identity holds (0: max_rooms / identities)
    sweep_interval: float = 1.0  # seconds between expiry sweeps
    expire_budget: int = 16384  # records one sweep step may free before yielding the loop


def room_table(config: BootstrapConfig) -> RoomTable:
    """The room table ``config`` bounds. The table's module is imported here, where a
    server is built, and not with this one: its numpy would load in every process that
    only parses a bootstrap's flags (``--help``, a bad value)."""
    from pdgrpc.bootstrap.table import RoomTable

    return RoomTable(ttl=config.ttl, max_rooms=config.max_rooms, max_batch=config.max_batch)


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
    servicer = BootstrapServicer(room_table(config), registry or WorkerRegistry(), clock, metrics,
                                 max_rooms_per_registrant=config.max_rooms_per_registrant)
    rpc = await start_server(
        [(SERVICE_NAME, lambda server: add_bootstrap_servicer(servicer, server))],
        host=host,
        port=port,
        what="pdgrpc bootstrap",
    )
    return BootstrapServer(rpc, servicer, config)
