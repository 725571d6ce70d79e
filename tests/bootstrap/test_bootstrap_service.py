"""BootstrapService over a real channel to a real server on 127.0.0.1 (port 0)."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdgrpc.bootstrap.client import BootstrapClient
from pdgrpc.bootstrap.service import SERVICE_NAME, BootstrapConfig, BootstrapServer
from pdgrpc.errors import PdgrpcError
from pdgrpc.rpc.channels import ChannelPool
from pdgrpc.rpc.errors import RpcError, Unavailable
from pdgrpc.v1 import bootstrap_pb2 as pb
from pdgrpc.v1 import bootstrap_pb2_grpc as pb_grpc

from bootstrap_helpers import FakeClock, parallel_info, worker

SIZES = [3, 300]  # the room table takes small batches room by room, large ones with numpy


def rooms(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) | 1 for _ in range(n)]


@pytest.mark.parametrize("n", SIZES)
async def test_batched_register_and_query(client: BootstrapClient, n: int) -> None:
    want = {r: r % 4 for r in rooms(n)}
    reply = await client.register_dp_ranks(want)
    assert (reply.added, reply.unchanged) == (n, 0)
    unknown = rooms(5, seed=1)
    result = await client.query_dp_ranks([*want, *unknown])
    assert result.ranks == want
    assert result.rooms == list(want) and result.missing == unknown  # request order


@pytest.mark.parametrize("config", [BootstrapConfig(max_rooms=1000, max_batch=64)])
async def test_batch_over_max_batch_is_invalid_argument(client: BootstrapClient, server: BootstrapServer) -> None:
    with pytest.raises(RpcError, match="INVALID_ARGUMENT: .*over the limit of 64"):
        await client.register_dp_ranks({r: 0 for r in rooms(65)})
    with pytest.raises(RpcError, match="INVALID_ARGUMENT: .*over the limit of 64"):
        await client.query_dp_ranks(rooms(65))
    assert len(server.table) == 0
    assert len((await client.query_dp_ranks(rooms(64))).missing) == 64


@pytest.mark.parametrize("n", SIZES)
async def test_room_zero_is_invalid_argument(client: BootstrapClient, server: BootstrapServer, n: int) -> None:
    with pytest.raises(RpcError, match="INVALID_ARGUMENT: .*0 means not written"):
        await client.register_dp_ranks([(r, 1) for r in rooms(n - 1)] + [(0, 1)])
    with pytest.raises(RpcError, match="INVALID_ARGUMENT: .*0 means not written"):
        await client.query_dp_ranks([0, *rooms(n - 1)])
    assert len(server.table) == 0


@pytest.mark.parametrize("n", SIZES)
async def test_dp_rank_range_is_checked_once_topology_is_known(client: BootstrapClient, n: int) -> None:
    early = rooms(n, seed=2)
    await client.register_dp_ranks({r: 7 for r in early})  # no worker yet: any rank is accepted
    await client.register_worker(worker(0), parallel_info(dp=2))
    await client.register_worker(worker(1), parallel_info(dp=2))  # complete: the topology is fixed
    late = rooms(n, seed=3)
    with pytest.raises(RpcError, match=r"INVALID_ARGUMENT: .*dp_rank 2 is outside \[0, dp_size=2\)"):
        await client.register_dp_ranks({**{r: 1 for r in late[:-1]}, late[-1]: 2})
    assert (await client.query_dp_ranks(late)).ranks == {}
    await client.register_dp_ranks({r: 1 for r in late})
    assert (await client.query_dp_ranks(early[:1] + late[:1])).ranks == {early[0]: 7, late[0]: 1}


@pytest.mark.parametrize("n", SIZES)
async def test_same_rank_idempotent_other_rank_already_exists_all_or_none(client: BootstrapClient, n: int) -> None:
    taken = rooms(1, seed=4)[0]
    await client.register_dp_ranks({taken: 1})
    again = await client.register_dp_ranks({taken: 1})
    assert (again.added, again.unchanged) == (0, 1)
    batch = {**{r: 0 for r in rooms(n, seed=5)}, taken: 3}
    with pytest.raises(RpcError, match="ALREADY_EXISTS") as e:
        await client.register_dp_ranks(batch)
    assert f"bootstrap_room {taken}" in e.value.details and "dp_rank 1" in e.value.details
    result = await client.query_dp_ranks(list(batch))
    assert result.ranks == {taken: 1}  # not one room of the failed batch was registered


@pytest.mark.parametrize("config", [BootstrapConfig(ttl=10.0, max_rooms=10_000, max_batch=2048, sweep_interval=0.01)])
async def test_rooms_expire_after_ttl_and_are_swept(client: BootstrapClient, server: BootstrapServer, clock: FakeClock) -> None:
    old, young = rooms(1000, seed=6), rooms(1000, seed=7)
    await client.register_dp_ranks({r: 0 for r in old})
    clock.advance(5)
    await client.register_dp_ranks({r: 1 for r in young})
    clock.advance(4.99)
    assert len((await client.query_dp_ranks(old)).rooms) == 1000
    clock.advance(0.01)
    assert (await client.query_dp_ranks(old)).missing == old  # at once, before any sweep
    assert len((await client.query_dp_ranks(young)).rooms) == 1000
    for _ in range(200):
        if len(server.table) == 1000:
            break
        await asyncio.sleep(0.01)
    assert len(server.table) == 1000 and server.table.stats.expired == 1000
    await client.register_dp_ranks({old[0]: 3})  # an expired room is free to take again
    assert (await client.query_dp_ranks(old[:1])).ranks == {old[0]: 3}


@pytest.mark.parametrize("config", [BootstrapConfig(ttl=100.0, max_rooms=1000, max_batch=500)])
async def test_at_the_cap_queried_rooms_stay_and_only_then_new_ones_are_refused(
    client: BootstrapClient, server: BootstrapServer, clock: FakeClock
) -> None:
    batches = [rooms(500, seed=10 + i) for i in range(5)]
    for b in batches[:2]:
        clock.advance(1)
        await client.register_dp_ranks({r: 0 for r in b})
    assert len((await client.query_dp_ranks(batches[0])).rooms) == 500  # a decode found them
    await client.register_dp_ranks({r: 0 for r in batches[2]})  # evicts batch 1, never queried
    assert len((await client.query_dp_ranks(batches[2])).rooms) == 500
    for b in batches[3:]:  # every live room is queried now: nothing may go
        with pytest.raises(RpcError, match="RESOURCE_EXHAUSTED: .*1000 live rooms of max_rooms=1000; refusing 500 new room"):
            await client.register_dp_ranks({r: 0 for r in b})
    assert len(server.table) == 1000 and server.table.stats.evicted == server.table.stats.evicted_full == 500
    assert not (await client.query_dp_ranks(batches[1])).rooms
    for b in (batches[0], batches[2]):
        assert len((await client.query_dp_ranks(b)).rooms) == 500
    clock.advance(100)  # the live rooms expire: registrations succeed again
    await client.register_dp_ranks({r: 0 for r in batches[3]})


async def test_workers_topology_and_generations(client: BootstrapClient) -> None:
    with pytest.raises(Unavailable, match=r"0 of \? workers registered"):
        await client.get_parallel_info()
    r = await client.register_worker(worker(0), parallel_info(dp=2))
    assert (r.generation, r.registered_workers, r.expected_workers) == (1, 1, 2)
    with pytest.raises(Unavailable, match="1 of 2 workers registered"):
        await client.get_parallel_info()
    with pytest.raises(Unavailable, match="1 of 2 workers registered"):
        await client.get_workers_response(0)
    # Before a topology is complete, another one is pending, not refused: the first
    # complete registration fixes it (a bogus first registrant cannot lock workers out).
    odd = await client.register_worker(worker(1), parallel_info(dp=2, page_size=32))
    assert (odd.registered_workers, odd.expected_workers) == (1, 2)
    await client.register_worker(worker(1), parallel_info(dp=2))
    info = await client.get_parallel_info()
    assert info.parallel_info == parallel_info(dp=2) and info.registered_workers == info.expected_workers == 2
    with pytest.raises(RpcError, match="FAILED_PRECONDITION") as e:
        await client.register_worker(worker(1), parallel_info(dp=2, page_size=32))
    assert "parallel_info.page_size" in e.value.details and "16" in e.value.details and "32" in e.value.details
    restarted = await client.register_worker(worker(1, address="10.9.9.9:7000"), parallel_info(dp=2))
    assert restarted.generation == 3  # slot 1's third registration (the odd one counts)
    (w,) = (await client.get_workers_response(1)).workers
    assert (w.transfer_address, w.generation) == ("10.9.9.9:7000", 3)
    with pytest.raises(RpcError, match="INVALID_ARGUMENT: .*dp_rank 5"):
        await client.get_workers_response(5)


async def test_wait_parallel_info_waits_for_the_last_worker(client: BootstrapClient) -> None:
    await client.register_worker(worker(0), parallel_info(dp=2))
    waiter = asyncio.ensure_future(client.wait_parallel_info(wait_for=5.0))
    await asyncio.sleep(0.2)
    assert not waiter.done()
    await client.register_worker(worker(1), parallel_info(dp=2))
    assert (await asyncio.wait_for(waiter, 5)).expected_workers == 2


@pytest.mark.parametrize("config", [BootstrapConfig(max_rooms=20_000, max_batch=1000)])
async def test_64_concurrent_clients(server: BootstrapServer) -> None:
    pools = [ChannelPool() for _ in range(64)]  # 64 separate connections
    try:
        clients = [BootstrapClient(server.address, pool=p, timeout=10.0) for p in pools]
        mine = [rooms(200, seed=100 + i) for i in range(64)]

        async def work(i: int) -> None:
            c = clients[i]
            for k in range(0, 200, 50):
                await c.register_dp_ranks({r: i % 4 for r in mine[i][k : k + 50]})
                got = await c.query_dp_ranks(mine[i][: k + 50] + mine[(i + 1) % 64][:10])
                assert all(got.ranks[r] == i % 4 for r in mine[i][: k + 50])

        await asyncio.gather(*(work(i) for i in range(64)))
        # Everyone races for the same room with its own rank: exactly one rank wins.
        contested = rooms(1, seed=999)[0]
        outcomes = await asyncio.gather(*(c.register_dp_ranks({contested: i}) for i, c in enumerate(clients)), return_exceptions=True)
        won = [i for i, o in enumerate(outcomes) if not isinstance(o, BaseException)]
        assert len(won) == 1 and all(isinstance(o, RpcError) and o.code == grpc.StatusCode.ALREADY_EXISTS for i, o in enumerate(outcomes) if i != won[0])
        assert (await clients[5].query_dp_ranks([contested])).ranks == {contested: won[0]}
        assert len(server.table) == 64 * 200 + 1
    finally:
        for p in pools:
            await p.close()


async def test_health_is_serving_and_reflection_lists_the_service(client: BootstrapClient) -> None:
    assert await client.health() == "SERVING"
    assert await client.health(SERVICE_NAME) == "SERVING"
    stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)

    async def requests():  # type: ignore[no-untyped-def]
        yield reflection_pb2.ServerReflectionRequest(list_services="")

    names = set()
    async for reply in stub.ServerReflectionInfo(requests(), timeout=5):
        names |= {s.name for s in reply.list_services_response.service}
    assert {"pdgrpc.v1.BootstrapService", "grpc.health.v1.Health"} <= names


async def test_generated_stub_interoperates_with_the_numpy_codec(client: BootstrapClient) -> None:
    """A client that encodes canonically (zero ranks omitted, as every protobuf library
    does) and parses with the generated classes gets the same answers."""
    stub = pb_grpc.BootstrapServiceStub(client.channel)
    want = {r: r % 3 for r in rooms(300, seed=8)}  # a third of the ranks are 0
    req = pb.RegisterDpRanksRequest(entries=[pb.DpRankEntry(bootstrap_room=r, dp_rank=k) for r, k in want.items()])
    assert (await stub.RegisterDpRanks(req, timeout=5)).added == 300
    extra = rooms(3, seed=9)
    reply = await stub.QueryDpRanks(pb.QueryDpRanksRequest(bootstrap_rooms=[*want, *extra]), timeout=5)
    assert {e.bootstrap_room: e.dp_rank for e in reply.entries} == want and list(reply.missing_rooms) == extra
    assert (await client.query_dp_ranks(list(want))).ranks == want


async def test_errors_are_pdgrpc_errors(client: BootstrapClient) -> None:
    with pytest.raises(PdgrpcError) as e:
        await client.register_dp_ranks({0: 1})
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.method == "RegisterDpRanks"
    assert e.value.target == client.address
