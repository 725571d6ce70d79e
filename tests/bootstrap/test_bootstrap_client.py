"""BootstrapClient: one pooled channel per address, deadlines, retry with backoff."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import grpc
import pytest

from pdgrpc.bootstrap.client import BootstrapClient
from pdgrpc.bootstrap.registry import WorkerRegistry
from pdgrpc.bootstrap.service import SERVICE_NAME, BootstrapConfig, BootstrapServicer, add_bootstrap_servicer, start_bootstrap_server
from pdgrpc.bootstrap.table import RoomTable
from pdgrpc.errors import ConfigError, PdgrpcError
from pdgrpc.rpc.channels import ChannelPool, shared_pool
from pdgrpc.rpc.errors import RpcError, Unavailable
from pdgrpc.rpc.retry import Backoff
from pdgrpc.rpc.server import start_server
from pdgrpc.v1 import bootstrap_pb2 as pb

from bootstrap_helpers import free_port, parallel_info, worker


class PeerRecordingServicer(BootstrapServicer):
    """Remembers the peer (client ip:port) of every call: one peer = one connection."""

    def __init__(self) -> None:
        super().__init__(RoomTable(max_rooms=1000, max_batch=100), WorkerRegistry())
        self.peers: set[str] = set()

    async def RegisterDpRanks(self, request: pb.RegisterDpRanksRequest, context: Any) -> pb.RegisterDpRanksResponse:
        self.peers.add(context.peer())
        return await super().RegisterDpRanks(request, context)

    async def QueryDpRanks(self, request: pb.QueryDpRanksRequest, context: Any) -> pb.QueryDpRanksResponse:
        self.peers.add(context.peer())
        return await super().QueryDpRanks(request, context)


async def test_one_channel_per_address_never_one_per_call() -> None:
    servicer = PeerRecordingServicer()
    server = await start_server([(SERVICE_NAME, lambda s: add_bootstrap_servicer(servicer, s))])
    pool = ChannelPool()
    try:
        clients = [BootstrapClient(server.address, pool=pool) for _ in range(8)]
        for i in range(200):
            c = clients[i % 8]
            await c.register_dp_ranks({i + 1: 0})
            await c.query_dp_ranks([i + 1])
        await asyncio.gather(*(c.query_dp_ranks(list(range(1, 101))) for c in clients for _ in range(10)))
        assert pool.created == 1 and len(pool) == 1
        assert len(servicer.peers) == 1, servicer.peers  # every call on one TCP connection
    finally:
        await pool.close()
        await server.stop(0)


async def test_clients_without_a_pool_share_the_loops_pool() -> None:
    a, b = BootstrapClient("127.0.0.1:1"), BootstrapClient("127.0.0.1:1")
    assert a.channel is b.channel and shared_pool().get("127.0.0.1:1") is a.channel
    await shared_pool().close()


class RecordTimeouts(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self) -> None:
        self.calls: list[tuple[str, float | None]] = []

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        name = details.method.decode() if isinstance(details.method, bytes) else details.method
        self.calls.append((name, details.timeout))
        return await continuation(details, request)


async def test_every_call_carries_a_deadline() -> None:
    server = await start_bootstrap_server("127.0.0.1", 0)
    recorder = RecordTimeouts()
    pool = ChannelPool(interceptors=[recorder])
    try:
        c = BootstrapClient(server.address, pool=pool, timeout=3.0)
        await c.register_worker(worker(0), parallel_info(dp=1))
        await c.get_parallel_info()
        await c.wait_parallel_info()
        await c.get_workers_response(0)
        await c.register_dp_ranks({5: 0})
        await c.register_dp_ranks({r: 0 for r in range(10, 200)})
        await c.query_dp_ranks([5])
        await c.query_dp_ranks(list(range(10, 200)))
        await c.health()
        await c.query_dp_ranks([5], timeout=0.5)
        methods = {m.rsplit("/", 1)[1] for m, _ in recorder.calls}
        assert methods == {"RegisterWorker", "GetParallelInfo", "GetWorkers", "RegisterDpRanks", "QueryDpRanks", "Check"}
        assert all(t is not None and 0 < t <= 3.0 for _, t in recorder.calls), recorder.calls
        assert recorder.calls[-1][1] <= 0.5
    finally:
        await pool.close()
        await server.stop(0)


async def test_a_stuck_server_raises_deadline_exceeded() -> None:
    release = asyncio.Event()

    async def stuck(request: bytes, context: Any) -> bytes:
        await release.wait()
        return b""

    handler = grpc.method_handlers_generic_handler(SERVICE_NAME, {"QueryDpRanks": grpc.unary_unary_rpc_method_handler(stuck)})
    server = await start_server([(SERVICE_NAME, lambda s: s.add_generic_rpc_handlers((handler,)))])
    pool = ChannelPool()
    try:
        c = BootstrapClient(server.address, pool=pool, timeout=0.2)
        t0 = time.monotonic()
        with pytest.raises(RpcError, match="DEADLINE_EXCEEDED") as e:
            await c.query_dp_ranks([1])
        assert time.monotonic() - t0 < 2.0
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and isinstance(e.value, PdgrpcError)
    finally:
        release.set()
        await pool.close()
        await server.stop(0)


async def test_registration_retries_until_the_server_starts() -> None:
    port = free_port()
    pool = ChannelPool()
    c = BootstrapClient(f"127.0.0.1:{port}", pool=pool, timeout=1.0, retry_for=20.0, backoff=Backoff(0.05, 0.2))
    task = asyncio.ensure_future(c.register_dp_ranks({42: 1}))
    await asyncio.sleep(0.6)
    assert not task.done() and c.retries >= 2  # failing fast, backing off, trying again
    server = await start_bootstrap_server("127.0.0.1", port)
    try:
        reply = await asyncio.wait_for(task, 15)
        assert reply.added == 1
        assert (await c.query_dp_ranks([42])).ranks == {42: 1}
        # One live channel for the address: each that failed was replaced, not kept.
        assert len(pool) == 1 and pool.created <= c.retries + 1
    finally:
        await pool.close()
        await server.stop(0)


async def test_registration_gives_up_after_retry_for() -> None:
    pool = ChannelPool()
    c = BootstrapClient(f"127.0.0.1:{free_port()}", pool=pool, timeout=0.5, retry_for=0.6, backoff=Backoff(0.05, 0.1))
    t0 = time.monotonic()
    with pytest.raises(Unavailable, match="gave up after"):
        await c.register_worker(worker(0), parallel_info())
    assert time.monotonic() - t0 < 3.0 and c.retries >= 2
    retries = c.retries
    with pytest.raises(Unavailable) as q:  # queries are not retried
        await c.query_dp_ranks([1])
    assert "gave up after" not in str(q.value) and c.retries == retries
    await pool.close()


async def test_bad_arguments_fail_before_any_call() -> None:
    pool = ChannelPool()
    c = BootstrapClient("127.0.0.1:1", pool=pool)
    with pytest.raises(ConfigError):
        await c.register_dp_ranks({1: -1})
    with pytest.raises(ConfigError):
        await c.register_dp_ranks({r: 2**32 for r in range(1, 100)})
    with pytest.raises(ConfigError):
        await c.query_dp_ranks([2**64])
    with pytest.raises(ConfigError, match="dp ranks must be uint32"):
        await c.register_dp_ranks({1: 2**32})
    with pytest.raises(ConfigError, match="bootstrap rooms must be uint64"):
        await c.register_dp_ranks({2**64: 0})
    with pytest.raises(ConfigError):
        await c.query_dp_ranks([-1] * 100)
    assert pool.created == 0


def test_backoff_is_capped_exponential_with_full_jitter() -> None:
    b = Backoff(initial=0.1, maximum=1.0, multiplier=2.0)
    assert [b.cap(k) for k in range(1, 7)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    rng = random.Random(0)
    delays = [b.delay(4, rng) for _ in range(2000)]
    assert 0 <= min(delays) < 0.05 and 0.75 < max(delays) <= 0.8  # spread over [0, cap]
    with pytest.raises(ValueError):
        Backoff(initial=2.0, maximum=1.0)


@pytest.mark.parametrize("config", [BootstrapConfig(ttl=5.0, max_rooms=100, max_batch=100)])
async def test_server_stats_after_client_traffic(server: Any, client: BootstrapClient) -> None:
    await client.register_dp_ranks({r: 0 for r in range(1, 51)})
    await client.register_dp_ranks({r: 0 for r in range(1, 51)})
    s = server.table.stats
    assert (s.size, s.registered, s.max_rooms) == (50, 100, 100)


async def test_query_results_keep_request_order_and_duplicates(client: BootstrapClient) -> None:
    await client.register_dp_ranks({r: r % 5 for r in range(1, 61)})
    for asked in ([7, 7, 99, 3, 99, 7], [*range(60, 0, -1), 1000, 1001, 5, 1000]):  # small, and numpy-sized
        res = await client.query_dp_ranks(asked)
        assert res.rooms == [r for r in asked if r <= 60] and res.dp_ranks == [r % 5 for r in res.rooms]
        assert res.missing == [r for r in asked if r > 60]


async def test_a_client_whose_channel_the_pool_evicted_takes_a_new_one(server: Any) -> None:
    """The pool closes its least recently used channel past max_channels; a client that
    kept that channel would fail every later call with 'Channel is closed'."""
    pool = ChannelPool(max_channels=1)
    try:
        c = BootstrapClient(server.address, pool=pool, timeout=3.0)
        await c.register_dp_ranks({5: 1})
        await c.register_dp_ranks({r: 0 for r in range(10, 200)})
        first = c.channel
        pool.get("127.0.0.1:1")  # evicts it
        for _ in range(500):
            if first.get_state() == grpc.ChannelConnectivity.SHUTDOWN:
                break
            await asyncio.sleep(0.01)
        assert first.get_state() == grpc.ChannelConnectivity.SHUTDOWN
        assert (await c.query_dp_ranks([5])).ranks == {5: 1}
        assert (await c.register_dp_ranks({6: 0})).added == 1
        assert await c.health() == "SERVING"
        assert c.channel is not first and c.channel is pool.get(server.address)
    finally:
        await pool.close()
