"""The two wire forms of RegisterDpRanks and QueryDpRanks, over a real server and the
generated stub: a DpRankEntry per room (what any language's generated code writes) and
parallel repeated fields (pdgrpc's own client). Both are answered, and either reads
what the other registered."""

from __future__ import annotations

import random
import time
from typing import AsyncIterator

import grpc
import pytest

from pdgrpc.bootstrap.client import BootstrapClient
from pdgrpc.bootstrap.registry import WorkerRegistry
from pdgrpc.bootstrap.service import SERVICE_NAME, BootstrapServer, BootstrapServicer, add_bootstrap_servicer
from pdgrpc.bootstrap.table import RoomTable
from pdgrpc.errors import BootstrapError
from pdgrpc.rpc.channels import ChannelPool
from pdgrpc.rpc.server import RpcServer, start_server
from pdgrpc.v1 import bootstrap_pb2 as pb
from pdgrpc.v1 import bootstrap_pb2_grpc as pb_grpc


def rooms(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(63) | 1 for _ in range(n)]


def entries(want: dict[int, int]) -> list[pb.DpRankEntry]:
    return [pb.DpRankEntry(bootstrap_room=r, dp_rank=k) for r, k in want.items()]


@pytest.mark.parametrize("n", [1, 3, 300])  # the table's one-room, per-room and numpy paths
async def test_per_entry_messages_are_answered_in_kind(client: BootstrapClient, n: int) -> None:
    stub = pb_grpc.BootstrapServiceStub(client.channel)
    want = {r: r % 3 for r in rooms(n, seed=n)}
    reply = await stub.RegisterDpRanks(pb.RegisterDpRanksRequest(entries=entries(want)), timeout=5)
    assert (reply.added, reply.unchanged) == (n, 0)
    unknown = rooms(2, seed=99)
    answer = await stub.QueryDpRanks(pb.QueryDpRanksRequest(bootstrap_rooms=[unknown[0], *want, unknown[1]]), timeout=5)
    assert [(e.bootstrap_room, e.dp_rank) for e in answer.entries] == list(want.items())
    assert list(answer.missing_rooms) == unknown and not answer.found_dp_ranks and answer.instance_id
    # Registered one message per room, read by pdgrpc's client in its own form.
    result = await client.query_dp_ranks([*unknown, *want])
    assert result.ranks == want and result.missing == unknown and result.instance_id == answer.instance_id


@pytest.mark.parametrize("n", [1, 3, 300])
async def test_parallel_arrays_are_answered_in_kind(client: BootstrapClient, n: int) -> None:
    stub = pb_grpc.BootstrapServiceStub(client.channel)
    want = {r: r % 3 for r in rooms(n, seed=n)}
    reply = await stub.RegisterDpRanks(pb.RegisterDpRanksRequest(bootstrap_rooms=list(want), dp_ranks=list(want.values())), timeout=5)
    assert (reply.added, reply.unchanged) == (n, 0)
    unknown = rooms(2, seed=99)
    answer = await stub.QueryDpRanks(pb.QueryDpRanksRequest(bootstrap_rooms=[unknown[0], *want, unknown[1]], found_ranks_only=True), timeout=5)
    assert list(answer.found_dp_ranks) == list(want.values()) and list(answer.missing_rooms) == unknown and not answer.entries
    # Registered by pdgrpc's client, read one message per room.
    more = {r: 1 for r in rooms(n, seed=1000 + n)}
    await client.register_dp_ranks(more)
    answer = await stub.QueryDpRanks(pb.QueryDpRanksRequest(bootstrap_rooms=list(more)), timeout=5)
    assert {e.bootstrap_room: e.dp_rank for e in answer.entries} == more


async def test_the_deprecated_bytes_fields_are_read_by_no_server(client: BootstrapClient, server: BootstrapServer) -> None:
    """A client of the proto that had them sends them first and, answered as by a
    server that predates them, sends entries: so they register and find nothing."""
    stub = pb_grpc.BootstrapServiceStub(client.channel)
    room = (12345).to_bytes(8, "little")
    reply = await stub.RegisterDpRanks(pb.RegisterDpRanksRequest(packed_rooms=room, packed_dp_ranks=bytes(4)), timeout=5)
    assert (reply.added, reply.unchanged, reply.packed_rooms_read) == (0, 0, 0) and len(server.table) == 0
    answer = await stub.QueryDpRanks(pb.QueryDpRanksRequest(packed_rooms=room, packed_reply=True), timeout=5)
    assert not answer.packed_dp_ranks and not answer.entries and not answer.missing_rooms


@pytest.mark.parametrize(
    ("request_", "names"),
    [
        (pb.RegisterDpRanksRequest(entries=[pb.DpRankEntry(bootstrap_room=9, dp_rank=1)], bootstrap_rooms=[5], dp_ranks=[1]), "set entries or bootstrap_rooms"),
        (pb.RegisterDpRanksRequest(bootstrap_rooms=[5, 7], dp_ranks=[1]), "2 bootstrap_rooms but 1 dp_ranks"),
        (pb.RegisterDpRanksRequest(bootstrap_rooms=[5, 0], dp_ranks=[1, 1]), "0 means not written"),
        (pb.RegisterDpRanksRequest(entries=[pb.DpRankEntry(bootstrap_room=0, dp_rank=1)]), "0 means not written"),
        (pb.QueryDpRanksRequest(bootstrap_rooms=[5, 0], found_ranks_only=True), "0 means not written"),
    ],
)
async def test_bad_requests_are_invalid_argument_and_change_nothing(
    client: BootstrapClient, server: BootstrapServer, request_: pb.RegisterDpRanksRequest | pb.QueryDpRanksRequest, names: str
) -> None:
    stub = pb_grpc.BootstrapServiceStub(client.channel)
    call = stub.RegisterDpRanks if isinstance(request_, pb.RegisterDpRanksRequest) else stub.QueryDpRanks
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call(request_, timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and names in (e.value.details() or "")
    assert len(server.table) == 0


class ServicerBeforeArrays(BootstrapServicer):
    """Answers as a server built before RegisterDpRanksRequest.bootstrap_rooms: a
    protobuf parser keeps unknown fields aside, so it sees an empty batch."""

    async def RegisterDpRanks(self, request: pb.RegisterDpRanksRequest, context: grpc.aio.ServicerContext) -> pb.RegisterDpRanksResponse:
        request.ClearField("bootstrap_rooms")
        request.ClearField("dp_ranks")
        return await super().RegisterDpRanks(request, context)


@pytest.fixture
async def older_server() -> AsyncIterator[RpcServer]:
    servicer = ServicerBeforeArrays(RoomTable(ttl=30.0, max_rooms=10_000, max_batch=2048), WorkerRegistry(), time.monotonic)
    rpc = await start_server([(SERVICE_NAME, lambda s: add_bootstrap_servicer(servicer, s))], host="127.0.0.1", port=0)
    try:
        yield rpc
    finally:
        await rpc.stop(0.5)


async def test_a_server_that_registers_nothing_is_an_error_not_a_silent_loss(older_server: RpcServer, pool: ChannelPool) -> None:
    client = BootstrapClient(older_server.address, pool=pool, timeout=5.0)
    with pytest.raises(BootstrapError, match="0 of 2 rooms registered"):
        await client.register_dp_ranks({5: 0, 7: 1})
