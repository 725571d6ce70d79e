"""PrefillDirectory against real bootstrap servers on 127.0.0.1: what it caches about a
prefill instance is dropped once the instance restarts at the same address, whichever
way the decode learns of it."""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Callable, Sequence

import grpc
import pytest

from pdgrpc.bootstrap.client import BootstrapClient
from pdgrpc.bootstrap.registry import MAX_WORKERS, WorkerRegistry
from pdgrpc.bootstrap.service import BootstrapServer, start_bootstrap_server
from pdgrpc.decode.handshake import Handshaker
from pdgrpc.decode.job import Job
from pdgrpc.decode.prefills import PrefillDirectory
from pdgrpc.engine.base import SamplingParams
from pdgrpc.errors import RequestFailed
from pdgrpc.rpc.channels import ChannelPool
from pdgrpc.rpc.errors import RpcError
from pdgrpc.rpc.limits import MAX_ADDRESS_CHARS, MAX_NAME_CHARS, MAX_TRANSPORT_ENDPOINT_BYTES
from pdgrpc.v1 import bootstrap_pb2 as bpb
from tests.bootstrap.bootstrap_helpers import free_port, parallel_info, worker


async def start(port: int, dp: int) -> BootstrapServer:
    """A bootstrap on ``port`` with all ``dp`` workers (round robin) registered, over a
    channel of their own (the directory's stays as the restart left it)."""
    srv = await start_bootstrap_server("127.0.0.1", port)
    pool = ChannelPool()
    try:
        client = BootstrapClient(srv.address, pool=pool)
        for r in range(dp):
            await client.register_worker(worker(r, address=f"10.0.{dp}.{r}:7000"), parallel_info(dp=dp))
    finally:
        await pool.close()
    return srv


@pytest.fixture
async def servers() -> AsyncIterator[list[BootstrapServer]]:
    running: list[BootstrapServer] = []
    try:
        yield running
    finally:
        for s in running:
            await s.stop(grace=0.1)


async def restart(servers: list[BootstrapServer], dp: int) -> BootstrapServer:
    """Stop the running instance and start another, with ``dp`` ranks, on its port."""
    old = servers.pop()
    await old.stop(grace=0.1)
    new = await start(old.port, dp)
    servers.append(new)
    assert new.servicer.instance_id != old.servicer.instance_id
    return new


async def test_every_answer_names_the_instance(servers: list[BootstrapServer]) -> None:
    servers.append(await start(0, 2))
    d = PrefillDirectory(timeout=2.0)
    addr, want = servers[0].address, servers[0].servicer.instance_id
    assert (await d.parallel_info(addr, wait_for=2.0)).instance_id == want
    assert (await d.workers(addr, 1))[1] == want
    assert (await d.query_dp_ranks(addr, (5, 6)))[1] == want


async def test_a_query_answered_by_a_new_instance_drops_the_cached_info(servers: list[BootstrapServer]) -> None:
    servers.append(await start(0, 2))
    d = PrefillDirectory(timeout=2.0)
    addr = servers[0].address
    before = await d.parallel_info(addr, wait_for=2.0)
    await d.workers(addr, 1)
    new = await restart(servers, 1)
    answers, instance = await d.query_dp_ranks(addr, (5,))  # reconnects: the channel is READY again
    assert answers == {5: None} and instance == new.servicer.instance_id
    assert before.restarted(instance) and not before.restarted(before.instance_id) and not before.restarted(0)
    after = await d.parallel_info(addr, wait_for=2.0)
    assert (after.dp_size, after.instance_id) == (1, new.servicer.instance_id)
    workers, instance = await d.workers(addr, 0)  # the cached workers went with the info
    assert [w.transfer_address for w in workers] == ["10.0.1.0:7000"] and instance == new.servicer.instance_id


async def test_cached_info_is_fetched_again_after_the_connection_dropped(servers: list[BootstrapServer]) -> None:
    servers.append(await start(0, 2))
    d = PrefillDirectory(timeout=2.0)
    addr = servers[0].address
    assert (await d.parallel_info(addr, wait_for=2.0)).dp_size == 2
    assert await d.parallel_info(addr, wait_for=2.0) is await d.parallel_info(addr, wait_for=2.0)  # cached while connected
    new = await restart(servers, 1)
    after = await d.parallel_info(addr, wait_for=2.0)
    assert (after.dp_size, after.instance_id) == (1, new.servicer.instance_id)


async def test_cached_info_is_fetched_again_when_the_channel_reconnected_to_a_new_instance(
    servers: list[BootstrapServer],
) -> None:
    """The channel the info came over is READY again, now to another instance at the same
    address (it reconnected on its own, or another call reconnected it): the cache holds
    the old instance's info, and a request admitted under it would end as if its prefill
    had restarted after admission."""
    servers.append(await start(0, 2))
    d = PrefillDirectory(timeout=2.0)
    addr = servers[0].address
    assert (await d.parallel_info(addr, wait_for=2.0)).dp_size == 2
    new = await restart(servers, 1)
    channel = d.client(addr).channel
    deadline = time.monotonic() + 10.0
    while channel.get_state(try_to_connect=True) is not grpc.ChannelConnectivity.READY:
        assert time.monotonic() < deadline, "the channel never reconnected"
        await asyncio.sleep(0.05)
    after = await d.parallel_info(addr, wait_for=2.0)
    assert (after.dp_size, after.instance_id) == (1, new.servicer.instance_id)


async def test_a_handshake_for_a_room_of_the_previous_instance_is_not_sent(servers: list[BootstrapServer]) -> None:
    """A room admitted (dp rank known, pages allocated) before its prefill restarted: the
    workers the new instance lists never get its handshake; it ends UNAVAILABLE."""
    servers.append(await start(0, 1))
    d = PrefillDirectory(timeout=2.0)
    addr = servers[0].address
    before = await d.parallel_info(addr, wait_for=2.0)
    new = await restart(servers, 1)
    job = Job(7, "r7", (256, 65), SamplingParams(), 4, before, 1, asyncio.Queue(), 0.0, dp_rank=0)
    job.slot = 0
    handshaker = Handshaker(d, "fake", rpc_timeout_s=2.0)
    got = await handshaker.handshake(job, (0,), time.monotonic() + 5.0)
    assert isinstance(got, RequestFailed) and got.code == grpc.StatusCode.UNAVAILABLE, got
    assert f"room 7: the prefill at {addr} restarted after this request was admitted" in got.message
    assert job.contacted == []
    assert (await d.parallel_info(addr, wait_for=2.0)).instance_id == new.servicer.instance_id


async def test_the_directory_holds_at_most_max_prefills_addresses() -> None:
    """Every Decode call names its prefill's address; the directory kept a client (and its
    answers) for each distinct one for good. It forgets the least recently used."""
    pool = ChannelPool()
    try:
        d = PrefillDirectory(timeout=0.2, max_prefills=3, pool=pool)
        for _ in range(8):
            with pytest.raises(RpcError):
                await d.parallel_info(f"127.0.0.1:{free_port()}", wait_for=0.05)  # nobody listens there
        assert len(d) == 3
    finally:
        await pool.close()


class _LongAddresses(WorkerRegistry):
    """The registry of a bootstrap the decode does not control (another build, or a
    caller's own, named by its Decode request): it lists workers at over-long addresses."""

    def workers(self, dp_rank: int, tp_ranks: Sequence[int] = ()) -> list[bpb.WorkerInfo]:
        listed = super().workers(dp_rank, tp_ranks)
        for w in listed:
            w.transfer_address = "a" * 9000 + ":7000"
        return listed


async def test_a_listed_worker_address_over_the_limit_is_never_dialled(servers: list[BootstrapServer]) -> None:
    """The decode checks the prefill_bootstrap_address it is sent against
    MAX_ADDRESS_CHARS, but dialled, logged and kept a channel for any worker address that
    bootstrap listed. It ends the request naming the field and the limit instead."""
    servers.append(srv := await start_bootstrap_server("127.0.0.1", 0, registry=_LongAddresses()))
    pool = ChannelPool()
    try:
        await BootstrapClient(srv.address, pool=pool).register_worker(worker(0), parallel_info(dp=1))
    finally:
        await pool.close()
    d = PrefillDirectory(timeout=2.0)
    job = Job(7, "r7", (256, 65), SamplingParams(), 4, await d.parallel_info(srv.address, wait_for=2.0), 1, asyncio.Queue(), 0.0, dp_rank=0)
    job.slot = 0
    got = await Handshaker(d, "fake", rpc_timeout_s=2.0).handshake(job, (0,), time.monotonic() + 3.0)
    assert isinstance(got, RequestFailed) and got.code == grpc.StatusCode.INTERNAL, got
    assert (
        f"bootstrap {srv.address} lists worker dp_rank=0 tp_rank=0 at transfer_address: 9005 characters, "
        f"over the limit of {MAX_ADDRESS_CHARS}"
    ) in got.message
    assert job.contacted == []


class _Listing(WorkerRegistry):
    """The registry of a hostile bootstrap: it lists ``listed`` workers for any dp rank,
    each as ``shape`` makes it, and counts the GetWorkers it answers."""

    def __init__(self, listed: int = 1, shape: Callable[[bpb.WorkerInfo], None] = lambda w: None) -> None:
        super().__init__()
        self.listed, self.shape, self.asked = listed, shape, 0

    def workers(self, dp_rank: int, tp_ranks: Sequence[int] = ()) -> list[bpb.WorkerInfo]:
        self.asked += 1
        out = []
        for tp in range(self.listed):
            w = bpb.WorkerInfo(dp_rank=dp_rank, tp_rank=tp, transfer_address=f"127.0.0.1:{1000 + tp}", transport="fake", generation=1)
            self.shape(w)
            out.append(w)
        return out


async def hostile(servers: list[BootstrapServer], registry: WorkerRegistry) -> str:
    servers.append(srv := await start_bootstrap_server("127.0.0.1", 0, registry=registry))
    pool = ChannelPool()
    try:
        await BootstrapClient(srv.address, pool=pool).register_worker(worker(0), parallel_info(dp=1))
    finally:
        await pool.close()
    return srv.address


def _set(field: str, value: object) -> Callable[[bpb.WorkerInfo], None]:
    return lambda w: setattr(w, field, value)


@pytest.mark.parametrize(
    "listed, shape, shown",
    [
        (1, _set("transport", "t" * 9000), f"lists worker dp_rank=0 tp_rank=0 at transport: 9000 characters, over the limit of {MAX_NAME_CHARS}"),
        (1, _set("transport_endpoint", b"e" * (MAX_TRANSPORT_ENDPOINT_BYTES + 1)),
         f"lists worker dp_rank=0 tp_rank=0 at transport_endpoint: {MAX_TRANSPORT_ENDPOINT_BYTES + 1} bytes, "
         f"over the limit of {MAX_TRANSPORT_ENDPOINT_BYTES}"),
        (MAX_WORKERS + 1, lambda w: None, f"lists {MAX_WORKERS + 1} workers for dp_rank=0, over the limit of {MAX_WORKERS}"),
    ],
)
async def test_a_listed_worker_over_a_field_limit_is_refused_and_not_kept(
    servers: list[BootstrapServer], listed: int, shape: Callable[[bpb.WorkerInfo], None], shown: str
) -> None:
    """A bootstrap the decode does not control answered GetWorkers with anything that fit
    in a message: the decode kept each answer for good, repeated a 9000-character
    transport in its refusal, and sent a handshake to every one of 4097 workers listed.
    The request ends INTERNAL naming the field and the limit, nothing is kept or dialled,
    and another prefill's workers are still found."""
    registry = _Listing(listed, shape)
    address = await hostile(servers, registry)
    d = PrefillDirectory(timeout=2.0)
    job = Job(7, "r7", (256, 65), SamplingParams(), 4, await d.parallel_info(address, wait_for=2.0), 1, asyncio.Queue(), 0.0, dp_rank=0)
    job.slot = 0
    got = await Handshaker(d, "fake", rpc_timeout_s=2.0).handshake(job, (0,), time.monotonic() + 3.0)
    assert isinstance(got, RequestFailed) and got.code == grpc.StatusCode.INTERNAL, got
    assert f"room 7: bootstrap {address} {shown}" == got.message
    assert job.contacted == [] and d.cached_workers() == (0, 0)
    servers.append(await start(0, 2))
    workers, _ = await d.workers(servers[-1].address, 1)
    assert [w.transfer_address for w in workers] == ["10.0.2.1:7000"] and d.cached_workers()[0] == 1


async def test_cached_worker_lists_are_bounded_in_count_and_bytes(servers: list[BootstrapServer]) -> None:
    """The decode cached a GetWorkers answer per prefill address and dp rank for good,
    each up to the message limit, and a request names any dp rank its prefill's
    bootstrap claims: one hostile bootstrap answering for dp rank after dp rank grew the
    decode without bound. The least recently used answers are forgotten (fetched again
    when used) past MAX_WORKER_LISTS answers or MAX_WORKER_LIST_BYTES bytes."""
    registry = _Listing(4, _set("transport_endpoint", b"e" * MAX_TRANSPORT_ENDPOINT_BYTES))
    address = await hostile(servers, registry)
    d = PrefillDirectory(timeout=2.0, max_worker_lists=8, max_worker_list_bytes=3 * 4 * MAX_TRANSPORT_ENDPOINT_BYTES + 4096)
    for rank in range(3):
        await d.workers(address, rank)
    assert d.cached_workers()[0] == 3
    await d.workers(address, 0)  # the most recently used now
    await d.workers(address, 3)  # over the bytes: rank 1 goes
    count, size = d.cached_workers()
    assert count == 3 and size <= 3 * 4 * MAX_TRANSPORT_ENDPOINT_BYTES + 4096
    asked = registry.asked
    await d.workers(address, 0)
    assert registry.asked == asked  # kept
    await d.workers(address, 1)
    assert registry.asked == asked + 1  # forgotten, so asked again
    registry.shape = lambda w: None  # small answers: the count bounds them
    for rank in range(100, 120):
        await d.workers(address, rank)
    assert d.cached_workers()[0] == 8


class _PaddedInfo(WorkerRegistry):
    """The registry of a hostile bootstrap: its parallel info as ``shape`` makes it, and
    how many times it answered."""

    def __init__(self, shape: Callable[[bpb.ParallelInfo], None]) -> None:
        super().__init__()
        self.shape, self.asked = shape, 0

    def parallel_info(self) -> bpb.ParallelInfo:
        self.asked += 1
        info = bpb.ParallelInfo()
        info.CopyFrom(super().parallel_info())
        self.shape(info)
        return info


@pytest.mark.parametrize(
    "shape, shown",
    [
        (lambda i: setattr(i, "kv_layout", "l" * 9000), f"answers parallel_info.kv_layout: 9000 characters, over the limit of {MAX_NAME_CHARS}"),
        (lambda i: setattr(i, "compatibility_hash", b"h" * 4096), "answers parallel_info.compatibility_hash: 4096 bytes, over the limit of 64"),
        (lambda i: setattr(i, "dp_size", 5000), "answers parallel info no prefill registers: RegisterWorkerRequest.parallel_info: dp_size 5000"),
    ],
)
async def test_parallel_info_no_prefill_could_register_is_refused_and_not_kept(
    servers: list[BootstrapServer], shape: Callable[[bpb.ParallelInfo], None], shown: str
) -> None:
    """The decode kept a bootstrap's parallel info per address for as long as it kept the
    address (up to MAX_PREFILLS of them), each up to the message limit: one hostile
    bootstrap per address could pad each to 8 MiB. Info that no prefill could have
    registered ends the call INTERNAL naming the field, and is not kept."""
    registry = _PaddedInfo(shape)
    address = await hostile(servers, registry)
    d = PrefillDirectory(timeout=2.0)
    for asked in (1, 2):  # not kept: asked again
        with pytest.raises(RequestFailed) as err:
            await d.parallel_info(address, wait_for=2.0)
        assert err.value.code == grpc.StatusCode.INTERNAL and f"bootstrap {address} {shown}" in err.value.message
        assert registry.asked == asked
