"""``BootstrapClient``: the Python client of ``BootstrapService``.

* **One pooled channel per address**: every client for the same address (in one event
  loop) shares one ``grpc.aio`` channel, hence one HTTP/2 connection
  (:mod:`pdgrpc.rpc.channels`); nothing opens a connection per call.
* **A deadline on every call** (``timeout``, seconds; per call overridable).
* **Registration is retried on UNAVAILABLE** (server not up yet, restarting, workers
  not all registered) with capped exponential backoff and full jitter, until
  ``retry_for`` seconds have passed; then :class:`BootstrapUnavailable` is raised.
  Registrations are idempotent (same room, same rank; a worker re-registering its slot),
  so a retry is safe. Queries are not retried: callers poll them anyway.
* Errors are :mod:`pdgrpc.rpc.errors` classes (all ``PdgrpcError``), by status code.

::

    client = BootstrapClient("10.0.0.5:8998")
    await client.register_dp_ranks({room: 1, other_room: 0})
    ranks, missing = await client.query_dp_ranks([room, other_room, unknown])
"""

from __future__ import annotations

import asyncio
import random
import struct
import time
from typing import Awaitable, Callable, Iterable, Mapping, TypeVar

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdgrpc.bootstrap import wire
from pdgrpc.bootstrap.table import MISSING_RANK
from pdgrpc.errors import BootstrapError, ConfigError
from pdgrpc.rpc.channels import ChannelPool, shared_pool
from pdgrpc.rpc.errors import RpcError, Unavailable, map_rpc_error
from pdgrpc.rpc.retry import Backoff
from pdgrpc.v1 import bootstrap_pb2 as pb
from pdgrpc.v1 import bootstrap_pb2_grpc as pb_grpc

T = TypeVar("T")
R = TypeVar("R")

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_RETRY_FOR_S = 30.0


_SERVICE = pb.DESCRIPTOR.services_by_name["BootstrapService"].full_name
# Below this size the generated classes are faster than the numpy codec's fixed cost.
_NUMPY_ENCODE_FROM = 32
# Up to this many rooms, packed fields are written and read with struct and lists, no
# numpy call: numpy's code is cold between two calls, and its fixed cost is then most of
# what a call of a few dozen rooms costs the client.
_STRUCT_ROOMS = 64


def _pack(values: list[int], code: str, what: str) -> bytes:
    """``values`` as a packed little-endian field (``code``: ``Q`` uint64, ``I``
    uint32); ConfigError naming ``what`` for a value out of range."""
    n = len(values)
    try:
        if n <= _STRUCT_ROOMS:
            return struct.pack(f"<{n}{code}", *values)
        if code == "Q":
            return np.array(values, "<u8").tobytes()
        wide = np.array(values, np.int64)
        if wide.min() < 0 or wide.max() > 0xFFFFFFFF:
            raise ValueError("a value outside [0, 2**32)")
        return wide.astype("<u4").tobytes()
    except (TypeError, ValueError, OverflowError, struct.error) as exc:
        raise ConfigError(f"{what} must be {'uint64' if code == 'Q' else 'uint32'}: {exc}") from exc


def _unpack_ranks(requested: list[int], data: bytes) -> QueryResult:
    """The answer of a packed query: one uint32 per requested room, ``MISSING_RANK``
    where not known."""
    n = len(requested)
    if n > _STRUCT_ROOMS:
        return QueryResult.packed(requested, np.frombuffer(data, "<u4"))
    ranks = list(struct.unpack(f"<{n}I", data))
    if MISSING_RANK not in ranks:
        return QueryResult(requested, ranks, [], requested=requested)
    found = [(r, k) for r, k in zip(requested, ranks) if k != MISSING_RANK]
    missing = [r for r, k in zip(requested, ranks) if k == MISSING_RANK]
    return QueryResult([r for r, _ in found], [k for _, k in found], missing, requested=requested)


def _packed_register_request(rooms: list[int], ranks: list[int]) -> bytes:
    """The packed ``RegisterDpRanksRequest`` of ``rooms[i] → ranks[i]``; ConfigError for
    a value out of range. One room: written by one ``struct`` call (:mod:`.wire`)."""
    if len(rooms) == 1:
        try:
            return wire.encode_one_room(rooms[0], ranks[0])
        except struct.error:
            pass  # _pack names the value that is out of range
    packed_rooms = _pack(rooms, "Q", "bootstrap rooms")
    return pb.RegisterDpRanksRequest(packed_rooms=packed_rooms, packed_dp_ranks=_pack(ranks, "I", "dp ranks")).SerializeToString()


def _entries_request(rooms: bytes, ranks: bytes) -> bytes:
    """The per-entry ``RegisterDpRanksRequest`` (for a server that predates the packed
    fields) of packed rooms and ranks: the numpy codec for large batches."""
    n = len(rooms) // 8
    if n < _NUMPY_ENCODE_FROM:
        entries = [pb.DpRankEntry(bootstrap_room=r, dp_rank=k) for r, k in zip(struct.unpack(f"<{n}Q", rooms), struct.unpack(f"<{n}I", ranks))]
        return pb.RegisterDpRanksRequest(entries=entries).SerializeToString()
    return wire.encode_entries(np.frombuffer(rooms, "<u8"), np.frombuffer(ranks, "<u4"))


class BootstrapUnavailable(BootstrapError, Unavailable):
    """The bootstrap service stayed UNAVAILABLE through every retry of a registration."""


class QueryResult:
    """What :meth:`BootstrapClient.query_dp_ranks` learned.

    ``rooms[i]`` is served by prefill dp rank ``dp_ranks[i]``; ``missing`` rooms are not
    known (yet): ask again later. ``ranks`` is the same as a dict. From a packed answer
    the lists are built on first use; ``rank_array`` is the answer as it came: the dp
    rank of every requested room, in request order, ``MISSING_RANK`` where not known.
    ``instance_id`` is the answering bootstrap's instance id (0 from a server that
    predates it): another value than before from the same address means it restarted.
    """

    __slots__ = ("_requested", "_rank_array", "_rooms", "_dp_ranks", "_missing", "_ranks", "instance_id")

    def __init__(self, rooms: list[int] | None, dp_ranks: list[int] | None, missing: list[int] | None, *,
                 requested: list[int] | None = None, rank_array: np.ndarray | None = None) -> None:
        self._rooms = rooms
        self._dp_ranks = dp_ranks
        self._missing = missing
        self._requested = requested
        self._rank_array = rank_array
        self._ranks: dict[int, int] | None = None
        self.instance_id = 0

    @classmethod
    def packed(cls, requested: list[int], rank_array: np.ndarray) -> "QueryResult":
        return cls(None, None, None, requested=requested, rank_array=rank_array)

    def _unpack(self) -> None:
        assert self._requested is not None and self._rank_array is not None
        known = self._rank_array != MISSING_RANK
        if known.all():  # the usual case
            self._rooms, self._dp_ranks, self._missing = self._requested, self._rank_array.tolist(), []
        else:
            rooms = np.array(self._requested, np.uint64)
            self._rooms, self._dp_ranks = rooms[known].tolist(), self._rank_array[known].tolist()
            self._missing = rooms[~known].tolist()

    @property
    def rooms(self) -> list[int]:
        """Rooms found, in request order."""
        if self._rooms is None:
            self._unpack()
        assert self._rooms is not None
        return self._rooms

    @property
    def dp_ranks(self) -> list[int]:
        """The dp rank of each room of ``rooms``."""
        if self._dp_ranks is None:
            self._unpack()
        assert self._dp_ranks is not None
        return self._dp_ranks

    @property
    def missing(self) -> list[int]:
        """Rooms not (yet) known, in request order."""
        if self._missing is None:
            self._unpack()
        assert self._missing is not None
        return self._missing

    @property
    def rank_array(self) -> np.ndarray:
        """The dp rank of every requested room, in request order (uint32),
        ``MISSING_RANK`` for rooms not known."""
        if self._rank_array is None:
            found = dict(zip(self.rooms, self.dp_ranks))
            order = list(found) + self.missing if self._requested is None else self._requested
            self._rank_array = np.array([found.get(r, MISSING_RANK) for r in order], np.uint32)
        return self._rank_array

    @property
    def ranks(self) -> dict[int, int]:
        """room → prefill dp rank, for the rooms the service knows."""
        if self._ranks is None:
            self._ranks = dict(zip(self.rooms, self.dp_ranks))
        return self._ranks

    def __repr__(self) -> str:
        return f"QueryResult(ranks={self.ranks!r}, missing={self.missing!r})"


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
        rng: random.Random | None = None,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self.retry_for = retry_for
        self.backoff = backoff
        self._pool = pool
        self._rng = rng or random.Random()
        self._stub: pb_grpc.BootstrapServiceStub | None = None
        self._register_bytes: grpc.aio.UnaryUnaryMultiCallable | None = None
        self._channel: grpc.aio.Channel | None = None
        self.retries = 0  # registration attempts that failed with UNAVAILABLE and were retried
        # Whether the server reads the packed fields: assumed until an answer shows
        # otherwise (a server that predates them ignores them), then entries are sent.
        self.packed = True

    @property
    def channel(self) -> grpc.aio.Channel:
        """The pooled channel, asked of the pool (in the running loop) at every call: the
        pool may have closed the one this client used before (it evicts the least
        recently used), and then hands out a new one."""
        pool = self._pool if self._pool is not None else shared_pool()
        channel = pool.get(self.address)
        if channel is not self._channel:
            self._channel, self._stub, self._register_bytes = channel, None, None
        return channel

    @property
    def stub(self) -> pb_grpc.BootstrapServiceStub:
        """The generated stub on the pooled channel."""
        channel = self.channel
        if self._stub is None:
            self._stub = pb_grpc.BootstrapServiceStub(channel)
        return self._stub

    def _register_raw(self) -> grpc.aio.UnaryUnaryMultiCallable:
        """RegisterDpRanks taking the request as bytes, so that large batches can be
        encoded by the numpy codec (:mod:`.wire`)."""
        channel = self.channel
        if self._register_bytes is None:
            self._register_bytes = channel.unary_unary(
                f"/{_SERVICE}/RegisterDpRanks", request_serializer=None, response_deserializer=pb.RegisterDpRanksResponse.FromString, _registered_method=True
            )
        return self._register_bytes

    # --------------------------------------------------------------- room → dp rank

    async def register_dp_ranks(
        self, entries: Mapping[int, int] | Iterable[tuple[int, int]], *, timeout: float | None = None
    ) -> pb.RegisterDpRanksResponse:
        """Register room → dp rank for a batch, all or none (retried on UNAVAILABLE).
        Raises ``InvalidArgument`` (room 0, rank out of range, batch too large) or
        ``AlreadyExists`` (a room is registered with another rank)."""
        if isinstance(entries, Mapping):
            rooms, ranks = list(entries.keys()), list(entries.values())
        else:
            pairs = list(entries)
            rooms, ranks = [r for r, _ in pairs], [k for _, k in pairs]
        request = _packed_register_request(rooms, ranks)
        register = self._register_raw()

        def send(data: bytes) -> Awaitable[pb.RegisterDpRanksResponse]:
            return self._retrying("RegisterDpRanks", lambda t: register(data, timeout=t), timeout)

        return await self._packed_or_entries(
            len(rooms),
            lambda: send(request),
            lambda reply: reply if reply.packed_rooms_read == len(rooms) else None,
            lambda: send(_entries_request(_pack(rooms, "Q", "bootstrap rooms"), _pack(ranks, "I", "dp ranks"))),
        )

    async def query_dp_ranks(self, rooms: Iterable[int], *, timeout: float | None = None) -> QueryResult:
        """Look up the dp rank of a batch of rooms; unknown rooms come back in ``missing``."""
        rooms = rooms.tolist() if isinstance(rooms, np.ndarray) else list(rooms)
        n = len(rooms)

        def read(reply: pb.QueryDpRanksResponse) -> QueryResult | None:
            if len(reply.packed_dp_ranks) != 4 * n:
                return None
            result = _unpack_ranks(rooms, reply.packed_dp_ranks)
            result.instance_id = reply.instance_id
            return result

        def packed() -> Awaitable[pb.QueryDpRanksResponse]:
            request = pb.QueryDpRanksRequest(packed_rooms=_pack(rooms, "Q", "bootstrap rooms"), packed_reply=True)
            return self._call("QueryDpRanks", self.stub.QueryDpRanks(request, timeout=self._t(timeout)))

        return await self._packed_or_entries(n, packed, read, lambda: self._query_entries(rooms, timeout))

    async def _packed_or_entries(
        self, n: int, packed: Callable[[], Awaitable[R]], read: Callable[[R], T | None], entries: Callable[[], Awaitable[T]]
    ) -> T:
        """A batched call of ``n`` rooms: in the packed form while the server reads it,
        else (and for good, once an answer shows the server ignored the packed fields,
        as one that predates them does) in the per-entry form. Empty batches take the
        per-entry form: their answer cannot tell the two servers apart."""
        if self.packed and n:
            got = read(await packed())
            if got is not None:
                return got
            self.packed = False  # a server that predates the packed form saw no rooms
        return await entries()

    async def _query_entries(self, rooms: list[int], timeout: float | None) -> QueryResult:
        """QueryDpRanks in the per-entry form (``bootstrap_rooms``, ``found_ranks_only``)."""
        try:
            request = pb.QueryDpRanksRequest(bootstrap_rooms=rooms, found_ranks_only=True)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"bootstrap rooms must be uint64: {exc}") from exc
        reply = await self._call("QueryDpRanks", self.stub.QueryDpRanks(request, timeout=self._t(timeout)))
        missing = list(reply.missing_rooms)
        if reply.entries:  # a server that does not know found_ranks_only
            result = QueryResult([e.bootstrap_room for e in reply.entries], [e.dp_rank for e in reply.entries], missing)
        else:
            if missing:
                gone = set(missing)
                rooms = [r for r in rooms if r not in gone]
            ranks = list(reply.found_dp_ranks)
            if len(ranks) != len(rooms):
                raise BootstrapError(f"QueryDpRanks on {self.address}: {len(ranks)} ranks for {len(rooms)} found rooms")
            result = QueryResult(rooms, ranks, missing)
        result.instance_id = reply.instance_id
        return result

    # --------------------------------------------------------------- workers

    async def register_worker(
        self, worker: pb.WorkerInfo, parallel_info: pb.ParallelInfo, *, timeout: float | None = None
    ) -> pb.RegisterWorkerResponse:
        """Register one prefill worker (retried on UNAVAILABLE). Raises
        ``FailedPrecondition`` when its parallel info disagrees with the instance's."""
        request = pb.RegisterWorkerRequest(worker=worker, parallel_info=parallel_info)
        return await self._retrying("RegisterWorker", lambda t: self.stub.RegisterWorker(request, timeout=t), timeout)

    async def get_parallel_info(self, *, timeout: float | None = None) -> pb.GetParallelInfoResponse:
        """The instance's parallel info; ``Unavailable`` until every worker registered."""
        return await self._call("GetParallelInfo", self.stub.GetParallelInfo(pb.GetParallelInfoRequest(), timeout=self._t(timeout)))

    async def wait_parallel_info(self, *, wait_for: float = DEFAULT_RETRY_FOR_S) -> pb.GetParallelInfoResponse:
        """:meth:`get_parallel_info`, retried with backoff while workers are missing."""
        return await self._retrying("GetParallelInfo", lambda t: self.stub.GetParallelInfo(pb.GetParallelInfoRequest(), timeout=t), None, wait_for)

    async def get_workers(self, dp_rank: int, tp_ranks: Iterable[int] = (), *, timeout: float | None = None) -> list[pb.WorkerInfo]:
        """The workers of prefill ``dp_rank`` (all tp ranks, or ``tp_ranks``)."""
        return list((await self.get_workers_response(dp_rank, tp_ranks, timeout=timeout)).workers)

    async def get_workers_response(
        self, dp_rank: int, tp_ranks: Iterable[int] = (), *, timeout: float | None = None
    ) -> pb.GetWorkersResponse:
        """:meth:`get_workers`'s whole answer, with the bootstrap's ``instance_id``."""
        request = pb.GetWorkersRequest(dp_rank=dp_rank, tp_ranks=list(tp_ranks))
        return await self._call("GetWorkers", self.stub.GetWorkers(request, timeout=self._t(timeout)))

    # --------------------------------------------------------------- room failures

    async def record_room_failures(self, failures: Iterable[pb.RoomFailure], *, timeout: float | None = None) -> int:
        """Record rooms whose prefill failed in the controller (:mod:`pdgrpc.bootstrap.failures`)."""
        request = pb.RecordRoomFailuresRequest(failures=list(failures))
        response = await self._call("RecordRoomFailures", self.stub.RecordRoomFailures(request, timeout=self._t(timeout)))
        return int(response.recorded)

    async def query_room_failures(self, keys: Iterable[pb.RoomFailureKey], *, timeout: float | None = None) -> list[pb.RoomFailure]:
        """The failure records of ``keys`` (room and tag); an older server raises UNIMPLEMENTED."""
        request = pb.QueryRoomFailuresRequest(keys=list(keys))
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
                    raise BootstrapUnavailable(exc.code, f"{exc.details} (gave up after {attempt} attempts)", method=method, target=self.address) from exc
                self.retries += 1
                await asyncio.sleep(delay)

    async def close(self) -> None:
        """Forget the channel. The pooled channel stays open for other clients; close
        the pool (``await pool.close()``) to close connections."""
        self._channel = None
        self._stub = None
        self._register_bytes = None


__all__ = ["MISSING_RANK", "BootstrapClient", "BootstrapUnavailable", "QueryResult", "RpcError"]
