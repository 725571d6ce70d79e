"""``BootstrapClient``: the Python client of ``BootstrapService``.

* **One pooled channel per address**: every client for the same address (in one event
  loop) shares one ``grpc.aio`` channel, hence one HTTP/2 connection
  (:mod:`pdgrpc.rpc.channels`); nothing opens a connection per call.
* **A deadline on every call** (``timeout``, seconds; per call overridable).
* **Registration is retried on UNAVAILABLE** (server not up yet, restarting, workers
  not all registered) with capped exponential backoff and full jitter, until
  ``retry_for`` seconds have passed; then the last ``Unavailable`` is raised, saying so.
  Registrations are idempotent (same room, same rank; a worker re-registering its slot),
  so a retry is safe. Queries are not retried: callers poll them anyway.
* Errors are :class:`~pdgrpc.rpc.errors.RpcError` (a ``PdgrpcError``) with the status code.

::

    client = BootstrapClient("10.0.0.5:8998")
    await client.register_dp_ranks({room: 1, other_room: 0})
    result = await client.query_dp_ranks([room, other_room, unknown])  # .ranks, .missing
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from typing import Awaitable, Callable, Iterable, Mapping, TypeVar

import grpc
from google.protobuf.internal.containers import RepeatedScalarFieldContainer
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdgrpc.errors import BootstrapError, ConfigError
from pdgrpc.rpc.channels import ChannelPool, shared_pool
from pdgrpc.rpc.errors import RpcError, Unavailable, map_rpc_error
from pdgrpc.rpc.retry import Backoff
from pdgrpc.v1 import bootstrap_pb2 as pb
from pdgrpc.v1 import bootstrap_pb2_grpc as pb_grpc

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_RETRY_FOR_S = 30.0


def _extend(field: RepeatedScalarFieldContainer[int], values: list[int], what: str, kind: str) -> None:
    """``field.extend(values)``; ConfigError naming ``what`` for a value that is not a ``kind``."""
    try:
        field.extend(values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{what} must be {kind}: {exc}") from exc


@dataclasses.dataclass(frozen=True)
class QueryResult:
    """What :meth:`BootstrapClient.query_dp_ranks` learned: ``rooms[i]`` is served by
    prefill dp rank ``dp_ranks[i]``; ``missing`` rooms are not known (yet): ask again
    later. Both in request order. ``instance_id`` is the answering bootstrap's (0 from
    a server that predates it): another value than before from the same address means
    it restarted."""

    rooms: list[int]
    dp_ranks: list[int]
    missing: list[int]
    instance_id: int = 0

    @property
    def ranks(self) -> dict[int, int]:
        """room → prefill dp rank, for the rooms the service knows."""
        return dict(zip(self.rooms, self.dp_ranks))


class BootstrapClient:
    """Client of one bootstrap service address; cheap to create (the channel is pooled)."""

    def __init__(
        self,
        address: str,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        retry_for: float = DEFAULT_RETRY_FOR_S,
        backoff: Backoff = Backoff(),
        pool: ChannelPool | None = None,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self.retry_for = retry_for
        self.backoff = backoff
        self._pool = pool
        self._rng = random.Random()
        self._stub: pb_grpc.BootstrapServiceStub | None = None
        self._channel: grpc.aio.Channel | None = None
        self.retries = 0  # registration attempts that failed with UNAVAILABLE and were retried

    @property
    def channel(self) -> grpc.aio.Channel:
        """The pooled channel, asked of the pool (in the running loop) at every call: the
        pool may have closed the one this client used before (it evicts the least
        recently used), and then hands out a new one."""
        pool = self._pool if self._pool is not None else shared_pool()
        channel = pool.get(self.address)
        if channel is not self._channel:
            self._channel, self._stub = channel, None
        return channel

    @property
    def stub(self) -> pb_grpc.BootstrapServiceStub:
        """The generated stub on the pooled channel."""
        channel = self.channel
        if self._stub is None:
            self._stub = pb_grpc.BootstrapServiceStub(channel)
        return self._stub

    # --------------------------------------------------------------- room → dp rank
    # Both calls send parallel repeated fields (bootstrap_rooms, dp_ranks,
    # found_dp_ranks), not a DpRankEntry per room: protobuf builds and reads a repeated
    # scalar as one array, a message per room as one Python object each.

    async def register_dp_ranks(
        self, entries: Mapping[int, int] | Iterable[tuple[int, int]], *, timeout: float | None = None
    ) -> pb.RegisterDpRanksResponse:
        """Register room → dp rank for a batch, all or none (retried on UNAVAILABLE).
        Raises RpcError ``INVALID_ARGUMENT`` (room 0, rank out of range, batch too large)
        or ``ALREADY_EXISTS`` (a room is registered with another rank)."""
        if isinstance(entries, Mapping):
            rooms, ranks = list(entries.keys()), list(entries.values())
        else:
            pairs = list(entries)
            rooms, ranks = [r for r, _ in pairs], [k for _, k in pairs]
        request = pb.RegisterDpRanksRequest()
        _extend(request.bootstrap_rooms, rooms, "bootstrap rooms", "uint64")
        _extend(request.dp_ranks, ranks, "dp ranks", "uint32")
        reply = await self._retrying("RegisterDpRanks", lambda t: self.stub.RegisterDpRanks(request, timeout=t), timeout)
        if reply.added + reply.unchanged != len(rooms):  # a server that ignores bootstrap_rooms
            raise BootstrapError(f"RegisterDpRanks on {self.address}: {reply.added + reply.unchanged} of {len(rooms)} rooms registered")
        return reply

    async def query_dp_ranks(self, rooms: Iterable[int], *, timeout: float | None = None) -> QueryResult:
        """Look up the dp rank of a batch of rooms; unknown rooms come back in ``missing``."""
        asked = list(rooms)
        request = pb.QueryDpRanksRequest(found_ranks_only=True)
        _extend(request.bootstrap_rooms, asked, "bootstrap rooms", "uint64")
        reply = await self._call("QueryDpRanks", self.stub.QueryDpRanks(request, timeout=self._t(timeout)))
        missing = list(reply.missing_rooms)
        found = asked
        if missing:
            gone = set(missing)
            found = [r for r in asked if r not in gone]
        ranks = list(reply.found_dp_ranks)
        if len(ranks) != len(found):
            raise BootstrapError(f"QueryDpRanks on {self.address}: {len(ranks)} ranks for {len(found)} found rooms")
        return QueryResult(found, ranks, missing, reply.instance_id)

    # --------------------------------------------------------------- workers

    async def register_worker(
        self, worker: pb.WorkerInfo, parallel_info: pb.ParallelInfo, *, timeout: float | None = None
    ) -> pb.RegisterWorkerResponse:
        """Register one prefill worker (retried on UNAVAILABLE). Raises
        RpcError ``FAILED_PRECONDITION`` when its parallel info disagrees with the instance's."""
        request = pb.RegisterWorkerRequest(worker=worker, parallel_info=parallel_info)
        return await self._retrying("RegisterWorker", lambda t: self.stub.RegisterWorker(request, timeout=t), timeout)

    async def get_parallel_info(self, *, timeout: float | None = None) -> pb.GetParallelInfoResponse:
        """The instance's parallel info; ``Unavailable`` until every worker registered."""
        return await self._call("GetParallelInfo", self.stub.GetParallelInfo(pb.GetParallelInfoRequest(), timeout=self._t(timeout)))

    async def wait_parallel_info(self, *, wait_for: float = DEFAULT_RETRY_FOR_S) -> pb.GetParallelInfoResponse:
        """:meth:`get_parallel_info`, retried with backoff while workers are missing."""
        return await self._retrying("GetParallelInfo", lambda t: self.stub.GetParallelInfo(pb.GetParallelInfoRequest(), timeout=t), None, wait_for)

    async def get_workers_response(self, dp_rank: int, *, timeout: float | None = None) -> pb.GetWorkersResponse:
        """The workers of prefill ``dp_rank`` (every tp rank), with the bootstrap's
        ``instance_id``."""
        request = pb.GetWorkersRequest(dp_rank=dp_rank)
        return await self._call("GetWorkers", self.stub.GetWorkers(request, timeout=self._t(timeout)))

    # --------------------------------------------------------------- room failures

    async def record_room_failures(self, failures: Iterable[pb.RoomFailure], *, timeout: float | None = None) -> int:
        """Record rooms whose prefill failed (:mod:`pdgrpc.bootstrap.failures`)."""
        request = pb.RecordRoomFailuresRequest(failures=list(failures))
        response = await self._call("RecordRoomFailures", self.stub.RecordRoomFailures(request, timeout=self._t(timeout)))
        return int(response.recorded)

    async def query_room_failures(
        self, keys: Iterable[pb.RoomFailureKey], *, max_wait_s: float = 0.0, timeout: float | None = None
    ) -> list[pb.RoomFailure]:
        """The failure records of ``keys`` (room and tag), the call held up to
        ``max_wait_s`` while none has one; an older server raises UNIMPLEMENTED."""
        request = pb.QueryRoomFailuresRequest(keys=list(keys), max_wait_ms=int(max_wait_s * 1000))
        response = await self._call("QueryRoomFailures", self.stub.QueryRoomFailures(request, timeout=self._t(timeout)))
        return list(response.failures)

    # --------------------------------------------------------------- health

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The server's ``grpc.health.v1`` status name (``"SERVING"``, ...)."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        response = await self._call("Check", stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self._t(timeout)))
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))

    # --------------------------------------------------------------- plumbing

    def _t(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout

    async def _call(self, method: str, call: Awaitable[T]) -> T:
        try:
            return await call
        except grpc.RpcError as exc:
            raise map_rpc_error(exc, method=method, target=self.address) from exc

    async def _retrying(
        self, method: str, start: Callable[[float], Awaitable[T]], timeout: float | None, retry_for: float | None = None
    ) -> T:
        deadline = time.monotonic() + (self.retry_for if retry_for is None else retry_for)
        attempt = 0
        while True:
            attempt += 1
            try:
                return await self._call(method, start(self._t(timeout)))
            except Unavailable as exc:
                delay = self.backoff.delay(attempt, self._rng)
                if time.monotonic() + delay >= deadline:
                    raise Unavailable(exc.code, f"{exc.details} (gave up after {attempt} attempts)", method=method, target=self.address) from exc
                self.retries += 1
                await asyncio.sleep(delay)

    async def close(self) -> None:
        """Forget the channel. The pooled channel stays open for other clients; close
        the pool (``await pool.close()``) to close connections."""
        self._channel = None
        self._stub = None


__all__ = ["BootstrapClient", "QueryResult", "RpcError"]
