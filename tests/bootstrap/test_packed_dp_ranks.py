"""The packed forms of RegisterDpRanks and QueryDpRanks (little-endian arrays in bytes
fields), beside the per-entry messages that older clients send, over a real server."""

from __future__ import annotations

import random
import time
from typing import AsyncIterator

import grpc
import numpy as np
import pytest

from pdgrpc.bootstrap.client import MISSING_RANK, BootstrapClient
from pdgrpc.bootstrap.registry import WorkerRegistry
from pdgrpc.bootstrap.service import SERVICE_NAME, BootstrapServer, BootstrapServicer, add_bootstrap_servicer
from pdgrpc.bootstrap.table import RoomTable
from pdgrpc.rpc.channels import ChannelPool
from pdgrpc.rpc.server import RpcServer, start_server
from pdgrpc.v1 import bootstrap_pb2 as pb
from pdgrpc.v1 import bootstrap_pb2_grpc as pb_grpc


def rooms(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(63) | 1 for _ in range(n)]


def le(values: list[int], dtype: str) -> bytes:
    return np.array(values, dtype).tobytes()


# 1 room: its own 16-byte layout (pdgrpc.bootstrap.wire); 3 and 62 rooms (64 asked, with
# the unknown ones): struct and lists on both sides; 300: numpy.
@pytest.mark.parametrize("n", [1, 3, 62, 300])
async def test_packed_register_and_query_over_the_generated_stub(client: BootstrapClient, n: int) -> None:
    stub = pb_grpc.BootstrapServiceStub(client.channel)
    want = {r: r % 4 for r in rooms(n)}
    reply = await stub.RegisterDpRanks(
        pb.RegisterDpRanksRequest(packed_rooms=le(list(want), "<u8"), packed_dp_ranks=le(list(want.values()), "<u4")), timeout=5
    )
    assert (reply.added, reply.unchanged, reply.packed_rooms_read) == (n, 0, n)
    unknown = rooms(2, seed=1)
    asked = [unknown[0], *want, unknown[1]]
    answer = await stub.QueryDpRanks(pb.QueryDpRanksRequest(packed_rooms=le(asked, "<u8"), packed_reply=True), timeout=5)
    assert not answer.entries and not answer.missing_rooms and not answer.found_dp_ranks
    assert np.frombuffer(answer.packed_dp_ranks, "<u4").tolist() == [MISSING_RANK, *want.values(), MISSING_RANK]
    # Packed rooms in, the older answers out.
    older = await stub.QueryDpRanks(pb.QueryDpRanksRequest(packed_rooms=le(asked, "<u8"), found_ranks_only=True), timeout=5)
    assert list(older.found_dp_ranks) == list(want.values()) and list(older.missing_rooms) == unknown
    entries = await stub.QueryDpRanks(pb.QueryDpRanksRequest(packed_rooms=le(asked, "<u8")), timeout=5)
    assert {e.bootstrap_room: e.dp_rank for e in entries.entries} == want and list(entries.missing_rooms) == unknown


@pytest.mark.parametrize("n", [3, 300])
async def test_per_entry_messages_of_older_clients_are_still_answered(client: BootstrapClient, n: int) -> None:
    stub = pb_grpc.BootstrapServiceStub(client.channel)
    want = {r: r % 3 for r in rooms(n, seed=2)}
    reply = await stub.RegisterDpRanks(pb.RegisterDpRanksRequest(entries=[pb.DpRankEntry(bootstrap_room=r, dp_rank=k) for r, k in want.items()]), timeout=5)
    assert (reply.added, reply.packed_rooms_read) == (n, 0)
    extra = rooms(1, seed=3)
    found_only = await stub.QueryDpRanks(pb.QueryDpRanksRequest(bootstrap_rooms=[*want, *extra], found_ranks_only=True), timeout=5)
    assert list(found_only.found_dp_ranks) == list(want.values()) and list(found_only.missing_rooms) == extra
    assert not found_only.packed_dp_ranks
    # Registered the old way, read the new way (and the client's QueryResult agrees).
    result = await client.query_dp_ranks([*extra, *want])
    assert result.ranks == want and result.missing == extra
    assert result.rank_array.tolist() == [MISSING_RANK, *want.values()]  # request order


@pytest.mark.parametrize(
    ("request_", "names"),
    [
        (pb.QueryDpRanksRequest(packed_rooms=b"\x01" * 12, packed_reply=True), "QueryDpRanksRequest.packed_rooms: 12 bytes is not a multiple of 8"),
        (pb.QueryDpRanksRequest(bootstrap_rooms=[5], packed_rooms=le([7], "<u8")), "set bootstrap_rooms or packed_rooms, not both"),
        (pb.RegisterDpRanksRequest(packed_rooms=le([5, 7], "<u8"), packed_dp_ranks=le([1], "<u4")), "packed_rooms holds 2 rooms but packed_dp_ranks 1 ranks"),
        (pb.RegisterDpRanksRequest(packed_rooms=le([5], "<u8"), packed_dp_ranks=b"\x01\x00"), "RegisterDpRanksRequest.packed_dp_ranks: 2 bytes is not a multiple of 4"),
        (pb.RegisterDpRanksRequest(entries=[pb.DpRankEntry(bootstrap_room=9, dp_rank=1)], packed_rooms=le([5], "<u8"), packed_dp_ranks=le([1], "<u4")), "set entries or packed_rooms"),
        (pb.RegisterDpRanksRequest(packed_rooms=le([5], "<u8"), packed_dp_ranks=le([MISSING_RANK], "<u4")), f"dp_rank {MISSING_RANK} is invalid"),
        (pb.QueryDpRanksRequest(packed_rooms=le([5, 0], "<u8"), packed_reply=True), "0 means not written"),
        (pb.RegisterDpRanksRequest(packed_rooms=le([5, 0], "<u8"), packed_dp_ranks=le([1, 1], "<u4")), "0 means not written"),
        (pb.RegisterDpRanksRequest(packed_rooms=le([0], "<u8"), packed_dp_ranks=le([1], "<u4")), "0 means not written"),
    ],
)
async def test_bad_packed_fields_are_invalid_argument_and_change_nothing(
    client: BootstrapClient, server: BootstrapServer, request_: pb.RegisterDpRanksRequest | pb.QueryDpRanksRequest, names: str
) -> None:
    stub = pb_grpc.BootstrapServiceStub(client.channel)
    call = stub.RegisterDpRanks if isinstance(request_, pb.RegisterDpRanksRequest) else stub.QueryDpRanks
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call(request_, timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and names in (e.value.details() or "")
    assert len(server.table) == 0


class ServicerBeforePackedFields(BootstrapServicer):
    """Answers as a server built before the packed fields did: it never sees them (a
    protobuf parser keeps unknown fields aside) and never sets them."""

    async def RegisterDpRanks(self, data: bytes, context: grpc.aio.ServicerContext) -> pb.RegisterDpRanksResponse:
        request = pb.RegisterDpRanksRequest.FromString(data)
        request.ClearField("packed_rooms")
        request.ClearField("packed_dp_ranks")
        reply = await super().RegisterDpRanks(request.SerializeToString(), context)
        reply.ClearField("packed_rooms_read")
        return reply

    async def QueryDpRanks(self, request: pb.QueryDpRanksRequest, context: grpc.aio.ServicerContext) -> bytes:
        request.ClearField("packed_rooms")
        request.ClearField("packed_reply")
        return await super().QueryDpRanks(request, context)


@pytest.fixture
async def older_server() -> AsyncIterator[RpcServer]:
    servicer = ServicerBeforePackedFields(RoomTable(ttl=30.0, max_rooms=10_000, max_batch=2048), WorkerRegistry(), time.monotonic)
    rpc = await start_server([(SERVICE_NAME, lambda s: add_bootstrap_servicer(servicer, s))], host="127.0.0.1", port=0)
    try:
        yield rpc
    finally:
        await rpc.stop(0.5)


@pytest.mark.parametrize("n", [1, 3, 62, 300])
async def test_the_client_falls_back_to_entries_with_a_server_that_predates_packed_fields(older_server: RpcServer, pool: ChannelPool, n: int) -> None:
    client = BootstrapClient(older_server.address, pool=pool, timeout=5.0)
    want = {r: r % 4 for r in rooms(n, seed=4)}
    reply = await client.register_dp_ranks(want)
    assert reply.added == n and client.packed is False
    unknown = rooms(2, seed=5)
    result = await client.query_dp_ranks([*want, *unknown])
    assert result.ranks == want and result.missing == unknown
    fresh = BootstrapClient(older_server.address, pool=pool, timeout=5.0)  # a query first, this time
    result = await fresh.query_dp_ranks([*unknown, *want])
    assert result.ranks == want and result.missing == unknown and fresh.packed is False


@pytest.mark.parametrize("n", [4, 300])  # the per-room path and the numpy one
def test_lookup_answers_in_request_order_with_missing_for_unknown_and_expired(n: int) -> None:
    from pdgrpc.bootstrap.table import MISSING_RANK as MISSING

    table = RoomTable(ttl=10.0, max_rooms=4096, max_batch=1024, seed=1)
    early, late, unknown = rooms(n, seed=10), rooms(n, seed=11), rooms(n, seed=12)
    table.register(early, [r % 5 for r in early], now=0.0)
    table.register(late, [r % 7 for r in late], now=5.0)
    asked = [x for triple in zip(late, early, unknown) for x in triple]  # interleaved
    got = table.lookup(np.array(asked, np.uint64), now=12.0).tolist()  # early ones expired at 10
    assert got == [x for r in late for x in (r % 7, MISSING, MISSING)]
