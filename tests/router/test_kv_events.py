"""The router's KV event follower and ``--policy cache_aware`` against scripted prefills
that stream KV events over real gRPC (``pdgrpc.v1.PrefillService/SubscribeKvEvents``)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdgrpc.metrics import RouterMetrics
from pdgrpc.router.kv_events import KvEventFollower
from pdgrpc.router.service import GenerateServicer, PrefillBackend, RouterConfig, service_names
from pdgrpc.rpc.channels import ChannelPool
from pdgrpc.rpc.server import start_server
from pdgrpc.serving.kv_events import CAPABILITIES_KEY, LOCAL_PREFILL
from pdgrpc.state.prefix_index import PrefixIndex
from pdgrpc.v1 import generate_pb2, generate_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.eventually import eventually_async
from tests.router.test_router import ScriptedDecode, ScriptedPrefill, collect, serve_decode

pytestmark = pytest.mark.timeout(60)

PAGE = 4
PREFIX = list(range(100, 116))


def stored_batch(seq: int, tokens: list[int]) -> prefill_pb2.KvEventBatch:
    """``tokens``' full pages as one stored event (hashes made up: the index keys by content)."""
    blocks = []
    for i in range(0, len(tokens) - PAGE + 1, PAGE):
        b = prefill_pb2.KvBlock(block_hash=1000 + i, token_ids=tokens[i : i + PAGE])
        if i:
            b.parent_hash = 1000 + i - PAGE
        blocks.append(b)
    batch = prefill_pb2.KvEventBatch(sequence_number=seq)
    batch.events.add().stored.blocks.extend(blocks)
    return batch


class EventingPrefill(ScriptedPrefill):
    """A scripted prefill whose every subscription gets ``batches``, then stays open."""

    def __init__(self, batches: list[prefill_pb2.KvEventBatch]) -> None:
        super().__init__()
        self.batches = batches
        self.subscriptions = 0

    async def SubscribeKvEvents(self, request, context):
        self.subscriptions += 1
        for b in self.batches:
            yield b
        await asyncio.sleep(3600)


async def serve_prefill(prefill: EventingPrefill):
    return await start_server(
        [("pdgrpc.v1.PrefillService", lambda s: prefill_pb2_grpc.add_PrefillServiceServicer_to_server(prefill, s))]
    )


async def test_the_follower_indexes_batches_and_resubscribes_on_a_gap():
    events = EventingPrefill([stored_batch(7, PREFIX[:8]), stored_batch(9, PREFIX)])
    server = await serve_prefill(events)
    index, metrics, pool = PrefixIndex(), RouterMetrics(), ChannelPool()
    feed = KvEventFollower(index, lambda: [server.address], pool, metrics)
    feed.start()
    try:
        # 7 is applied; 9 skips 8: the prefill is dropped and subscribed to again (and
        # again: the script repeats its gap), never indexed beyond what batch 7 said.
        await eventually_async(lambda: events.subscriptions >= 2, what="a second subscription after the gap")
        assert index.match(PREFIX + [1]).get(server.address, 0) in (0, 8)
        events.batches = [stored_batch(3, PREFIX)]
        await eventually_async(lambda: index.match(PREFIX + [1]) == {server.address: 16}, what="the fresh snapshot")
        count = metrics.registry.get_sample_value(
            "pdgrpc_kv_event_resubscriptions_total", {"role": "router", "reason": "gap"}
        )
        assert count is not None and count >= 1
    finally:
        await feed.close()
        await pool.close()
        await server.stop(0)
    assert index.instances() == []


class BrittleIndex(PrefixIndex):
    """An index whose first ``apply`` fails, as a bug or an instance's odd event would."""

    def __init__(self) -> None:
        super().__init__()
        self.failures = 0

    def apply(self, instance, events):
        if not self.failures:
            self.failures += 1
            raise RuntimeError("an event this index cannot take")
        super().apply(instance, events)


async def test_a_batch_the_index_cannot_take_ends_the_stream_not_the_follower():
    events = EventingPrefill([stored_batch(1, PREFIX)])
    server = await serve_prefill(events)
    index, metrics = BrittleIndex(), RouterMetrics()
    feed = KvEventFollower(index, lambda: [server.address], ChannelPool(), metrics)
    feed.start()
    try:
        # The failed batch drops the instance, and a fresh subscription indexes it again.
        await eventually_async(lambda: index.match(PREFIX + [1]) == {server.address: 16}, what="the instance indexed again")
        assert index.failures == 1 and events.subscriptions == 2
        count = metrics.registry.get_sample_value(
            "pdgrpc_kv_event_resubscriptions_total", {"role": "router", "reason": "failed"}
        )
        assert count == 1
    finally:
        await feed.close()
        await server.stop(0)


@pytest.fixture
async def two_prefills():
    """Two scripted prefills, the second holding PREFIX; a router with --policy cache_aware."""
    prefills = [EventingPrefill([]), EventingPrefill([stored_batch(1, PREFIX)])]
    servers = [await serve_prefill(p) for p in prefills]
    decode = ScriptedDecode()
    d_srv = await serve_decode(decode)
    index, metrics, pool = PrefixIndex(), RouterMetrics(), ChannelPool()
    config = RouterConfig(
        prefills=tuple(PrefillBackend(s.address, s.address) for s in servers), decodes=(d_srv.address,), policy="cache_aware",
        eject_s=0,
    )
    router = GenerateServicer(config, metrics=metrics, index=index)
    feed = KvEventFollower(index, lambda: [s.address for s in servers], pool, metrics)
    feed.start()
    (name,) = service_names()
    r_srv = await start_server([(name, lambda s: generate_pb2_grpc.add_GenerateServiceServicer_to_server(router, s))])
    channel = grpc.aio.insecure_channel(r_srv.address)
    try:
        await eventually_async(lambda: index.match(PREFIX + [1]).get(servers[1].address) == 16, what="the second prefill's blocks")
        yield generate_pb2_grpc.GenerateServiceStub(channel), prefills, servers, index
    finally:
        await channel.close()
        await feed.close()
        await pool.close()
        await router.close()
        for s in (r_srv, d_srv, *servers):
            await s.stop(0)


async def test_cache_aware_sends_a_shared_prefix_to_its_holder_and_drops_a_dead_one(two_prefills):
    stub, prefills, servers, index = two_prefills
    for tail in ([1, 2], [3], [4, 5, 6]):
        await collect(stub.Generate(generate_pb2.GenerateRequest(input_ids=PREFIX + tail)))
    assert [len(p.requests) for p in prefills] == [0, 3]
    # Nobody holds these: the prefill caching least (the first; then, holding the first's
    # 16 pending tokens as the second holds PREFIX's, the first again, in turn).
    await collect(stub.Generate(generate_pb2.GenerateRequest(input_ids=[7] * 20)))
    await collect(stub.Generate(generate_pb2.GenerateRequest(input_ids=[8] * 20)))
    assert [len(p.requests) for p in prefills] == [2, 3]
    # The holder goes away: its stream breaks, it leaves the index, and its prefix goes elsewhere.
    await servers[1].stop(0)
    await eventually_async(lambda: servers[1].address not in index.instances(), what="the dead prefill dropped")
    await collect(stub.Generate(generate_pb2.GenerateRequest(input_ids=PREFIX + [9])))
    assert len(prefills[0].requests) == 3


async def test_a_request_sharing_a_running_prompts_prefix_waits_for_it(two_prefills):
    """Two requests of a new prefix at once: the second goes where the first went and its
    Prefill call is sent only once the first's ended (it then finds the prefix cached)."""
    stub, prefills, servers, index = two_prefills
    for p in prefills:
        p.delay = 1.5
    shared = [5] * 16
    first = asyncio.ensure_future(collect(stub.Generate(generate_pb2.GenerateRequest(input_ids=shared + [1]))))
    await eventually_async(lambda: sum(len(p.requests) for p in prefills) == 1, what="the first Prefill call")
    second = asyncio.ensure_future(collect(stub.Generate(generate_pb2.GenerateRequest(input_ids=shared + [2]))))
    await asyncio.sleep(0.5)
    assert sum(len(p.requests) for p in prefills) == 1  # the first still computes: the second waits
    await asyncio.gather(first, second)
    holder = next(p for p in prefills if p.requests)
    assert [list(r.input_ids) for r in holder.requests] == [shared + [1], shared + [2]]


class EventingDecode(ScriptedDecode):
    """A scripted decode whose every subscription gets ``batches``, then stays open;
    ``capabilities``: what its stream's initial metadata advertises (None: no header, as
    a decode older than local prefill)."""

    def __init__(self, batches: list[prefill_pb2.KvEventBatch], capabilities: str | None = None) -> None:
        super().__init__()
        self.batches = batches
        self.capabilities = capabilities

    async def SubscribeKvEvents(self, request, context):
        if self.capabilities is not None:
            await context.send_initial_metadata(((CAPABILITIES_KEY, self.capabilities),))
        for b in self.batches:
            yield b
        await asyncio.sleep(3600)


async def test_cache_aware_sends_a_prefix_to_the_decode_holding_it_until_it_dies():
    """The decode is picked by its own KV events (DecodeService/SubscribeKvEvents), within
    the load margin; a decode whose stream breaks leaves the index at once."""
    prefill = EventingPrefill([])
    p_srv = await serve_prefill(prefill)
    decodes = [EventingDecode([]), EventingDecode([stored_batch(1, PREFIX)])]
    d_srvs = [await serve_decode(d) for d in decodes]
    index, metrics, pool = PrefixIndex(), RouterMetrics(), ChannelPool()
    config = RouterConfig(
        prefills=(PrefillBackend(p_srv.address, p_srv.address),), decodes=tuple(s.address for s in d_srvs),
        policy="cache_aware", eject_s=0, cache_aware_margin=1,
    )
    router = GenerateServicer(config, metrics=metrics, index=index)
    feed = KvEventFollower(index, lambda: [s.address for s in d_srvs], pool, metrics, "decode")
    feed.start()
    (name,) = service_names()
    r_srv = await start_server([(name, lambda s: generate_pb2_grpc.add_GenerateServiceServicer_to_server(router, s))])
    channel = grpc.aio.insecure_channel(r_srv.address)
    stub = generate_pb2_grpc.GenerateServiceStub(channel)
    try:
        await eventually_async(lambda: index.match(PREFIX + [1]).get(d_srvs[1].address) == 16, what="the second decode's blocks")
        for tail in ([1, 2], [3], [4, 5, 6]):
            await collect(stub.Generate(generate_pb2.GenerateRequest(input_ids=PREFIX + tail)))
        assert [len(d.requests) for d in decodes] == [0, 3]
        # Two streams held open on the holder: past the margin of 1, the other decode gets it.
        decodes[1].wait_forever = True
        held = [asyncio.ensure_future(collect(stub.Generate(generate_pb2.GenerateRequest(input_ids=PREFIX + [i])))) for i in (7, 8)]
        await eventually_async(lambda: len(decodes[1].requests) == 5, what="two streams open on the holder")
        await collect(stub.Generate(generate_pb2.GenerateRequest(input_ids=PREFIX + [9])))
        assert [len(d.requests) for d in decodes] == [1, 5]
        for h in held:
            h.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        decodes[1].wait_forever = False
        await d_srvs[1].stop(0)
        await eventually_async(lambda: d_srvs[1].address not in index.instances(), what="the dead decode dropped")
    finally:
        await channel.close()
        await feed.close()
        await pool.close()
        await router.close()
        for s in (r_srv, p_srv, *d_srvs):
            await s.stop(0)


@pytest.mark.parametrize("advertised, local", [(None, False), ("", False), (LOCAL_PREFILL, True), (f"other,{LOCAL_PREFILL}", True)])
async def test_local_prefill_only_on_a_decode_that_advertises_it(advertised: str | None, local: bool):
    """A decode holding all but 2 tokens of a prompt gets it to compute itself only when its
    KV event stream advertises local prefill; an older decode (no header) would refuse a
    request without a prefill, so it gets the prefill's KV as before."""
    prefill = EventingPrefill([])
    p_srv = await serve_prefill(prefill)
    decode = EventingDecode([stored_batch(1, PREFIX)], advertised)
    d_srv = await serve_decode(decode)
    index, metrics, pool = PrefixIndex(), RouterMetrics(), ChannelPool()
    config = RouterConfig(
        prefills=(PrefillBackend(p_srv.address, p_srv.address),), decodes=(d_srv.address,), policy="cache_aware", eject_s=0,
    )
    feed = KvEventFollower(index, lambda: [d_srv.address], pool, metrics, "decode")
    router = GenerateServicer(config, metrics=metrics, index=index, decode_capabilities=feed.capabilities)
    feed.start()
    (name,) = service_names()
    r_srv = await start_server([(name, lambda s: generate_pb2_grpc.add_GenerateServiceServicer_to_server(router, s))])
    channel = grpc.aio.insecure_channel(r_srv.address)
    try:
        await eventually_async(lambda: index.match(PREFIX + [1]).get(d_srv.address) == 16, what="the decode's blocks")
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        await collect(stub.Generate(generate_pb2.GenerateRequest(input_ids=PREFIX + [1, 2])))
        (req,) = decode.requests
        assert req.local_prefill is local
        assert len(prefill.requests) == (0 if local else 1)
        # A request pinned to a prefill dp rank goes to that prefill.
        await collect(stub.Generate(generate_pb2.GenerateRequest(input_ids=PREFIX + [1, 2], routed_dp_rank=0)))
        assert not decode.requests[1].local_prefill and prefill.requests[-1].routed_dp_rank == 0
    finally:
        await channel.close()
        await feed.close()
        await pool.close()
        await router.close()
        for s in (r_srv, p_srv, d_srv):
            await s.stop(0)
