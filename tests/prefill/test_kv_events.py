"""KV events from a prefill: the feed a cache reports to, and ``SubscribeKvEvents`` on a
real prefill (controller + 2 worker processes), over pdgrpc's own protocol and smg's.

The merged stream's content (stores once across dp ranks, removals with the last holder,
a rank's restart) is tested on the pure log in tests/state/test_state_kv_event_log.py.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import threading
import time
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from pdgrpc.cluster.ports import free_port, free_port_block
from pdgrpc.engine.base import SamplingParams
from pdgrpc.state.cache_events import StoredBlock
from pdgrpc.serving.kv_events import MAX_STREAMS_PER_CLIENT, KvEventFeed, batch_from_proto, batch_to_proto
from pdgrpc.state.kv_event_log import Cleared, Removed, Stored
from pdgrpc.v1 import prefill_pb2, prefill_pb2_grpc
from tests.eventually import eventually, eventually_async
from tests.scrape import scrape
from tests.prefill.fake_decode import FakeDecode
from tests.prefill.harness import CONFIG, prompt, run_one
from tests.prefill.procs import ENGINE_FLAGS, PrefillProc

pytestmark = pytest.mark.timeout(120)


def block(h: int, parent: int | None = None) -> StoredBlock:
    return StoredBlock(h, parent, (h, h + 1, h + 2, h + 3))


async def test_a_cache_on_another_thread_reports_in_order() -> None:
    feed = KvEventFeed()
    follow = feed.follow(0)
    assert await follow.__anext__() == []

    def cache() -> None:
        for h in range(1, 51):
            feed.stored([block(h, h - 1 if h > 1 else None)])
        feed.removed([50])

    t = threading.Thread(target=cache)
    t.start()
    got: list = []
    while not got or got[-1].events[-1] != Removed((50,)):
        got += await asyncio.wait_for(follow.__anext__(), 5)
    t.join()
    assert [b.sequence_number for b in got] == list(range(1, len(got) + 1))
    events = [e for b in got for e in b.events]
    assert events == [Stored((block(h, h - 1 if h > 1 else None),)) for h in range(1, 51)] + [Removed((50,))]
    assert len({h for b in feed.log.snapshot() for e in b.events if isinstance(e, Stored) for h in (x.block_hash for x in e.blocks)}) == 49


async def test_what_the_window_holds_is_one_batch_in_order_across_turns_of_the_loop() -> None:
    """A prompt's evictions and its announcement, and the next prompt's, reach a subscriber
    as one message."""
    feed = KvEventFeed(window_s=1.0)
    follow = feed.follow(0)
    assert await follow.__anext__() == []
    feed.removed([7, 8])
    feed.stored([block(1), block(2, 1)])
    await asyncio.sleep(0)
    feed.stored([block(3)])
    await asyncio.sleep(0)
    feed.removed([3])
    (batch,) = await asyncio.wait_for(follow.__anext__(), 5)
    assert batch.sequence_number == 1
    assert batch.events == (Removed((7, 8)), Stored((block(1), block(2, 1))), Stored((block(3),)), Removed((3,)))


async def test_with_no_window_what_one_turn_of_the_loop_reports_is_one_batch_in_order() -> None:
    feed = KvEventFeed(window_s=0)
    follow = feed.follow(0)
    assert await follow.__anext__() == []
    feed.removed([7, 8])
    feed.stored([block(1), block(2, 1)])
    feed.cleared()
    feed.stored([block(3)])
    (batch,) = await asyncio.wait_for(follow.__anext__(), 5)
    assert batch.sequence_number == 1
    assert batch.events == (Removed((7, 8)), Stored((block(1), block(2, 1))), Cleared(), Stored((block(3),)))
    feed.removed([3])
    assert [b.events for b in await asyncio.wait_for(follow.__anext__(), 5)] == [(Removed((3,)),)]


async def test_a_subscriber_that_fell_behind_the_ring_gets_a_snapshot_without_a_gap() -> None:
    feed = KvEventFeed(capacity=4, window_s=0)
    follow = feed.follow(0)
    assert await follow.__anext__() == []
    for h in range(1, 11):  # more batches than the ring holds, before the subscriber reads
        feed.stored([block(h)])
        await asyncio.sleep(0)
    batches = await asyncio.wait_for(follow.__anext__(), 5)
    assert batches[0].snapshot is not None and isinstance(batches[0].events[0], Cleared)
    assert batches[-1].sequence_number == 10
    feed.removed([3])
    assert [b.sequence_number for b in await asyncio.wait_for(follow.__anext__(), 5)] == [11]


async def test_an_idle_subscriber_hears_nothing_and_close_ends_it() -> None:
    feed = KvEventFeed()
    follow = feed.follow(0, idle_s=0.05)
    assert await follow.__anext__() == []
    assert await asyncio.wait_for(follow.__anext__(), 5) == []  # idle
    await feed.close()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(follow.__anext__(), 5)


def test_wire_form_round_trips() -> None:
    log_feed_batches = [
        (1, (Stored((block(1), block(2, 1))),)),
        (2, (Removed((2,)),)),
        (3, (Cleared(),)),
        (4, (Stored(()), Removed(()), Stored((block(3),)))),  # empty events keep their kind
    ]
    from pdgrpc.state.kv_event_log import EventBatch, SnapshotChunk

    for seq, events in log_feed_batches:
        b = EventBatch(seq, events, 12.5, SnapshotChunk(0, 2) if seq == 3 else None)
        assert batch_from_proto(batch_to_proto(b)) == b


# ---- a real prefill ----------------------------------------------------------------

FLAGS = [*ENGINE_FLAGS, "--transport", "tcp", "--dp-size", "2", "--load-balance-method", "cache_aware", "--log-level", "info"]
HAS_ZMQ = all(importlib.util.find_spec(m) for m in ("zmq", "msgpack"))


@pytest.fixture(scope="module")
def prefill(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefillProc]:
    base = free_port_block(3)  # the controller's metrics port, then dp0's and dp1's
    p = PrefillProc([*FLAGS, "--metrics-port", str(base)], tmp_path_factory.mktemp("kv_events"), "kv")
    p.metrics = f"127.0.0.1:{base}"  # type: ignore[attr-defined]
    try:
        yield p
    finally:
        assert p.stop() == 0, p.log()[-3000:]


async def first_batches(address: str, start: int, n: int = 1) -> list[prefill_pb2.KvEventBatch]:
    async with grpc.aio.insecure_channel(address) as ch:
        call = prefill_pb2_grpc.PrefillServiceStub(ch).SubscribeKvEvents(
            prefill_pb2.SubscribeKvEventsRequest(start_sequence_number=start), timeout=10)
        out = []
        async for b in call:
            out.append(b)
            if len(out) == n:
                call.cancel()
                break
        return out


async def test_a_cursor_from_an_earlier_instance_gets_a_cleared_snapshot(prefill: PrefillProc) -> None:
    """A subscriber that remembers sequence 50 of an instance that since restarted is told
    to drop what it holds, on the controller's merged stream and on a worker's."""
    for address in (prefill.address, prefill.worker_addresses[1]):
        [b] = await first_batches(address, 50)
        assert b.snapshot_count == 1 and b.snapshot_index == 0 and b.sequence_number == 0
        assert [e.WhichOneof("event") for e in b.events] == ["cleared"]


async def test_the_streams_gauge_counts_open_subscriptions(prefill: PrefillProc) -> None:
    """``pdgrpc_kv_event_streams`` shows a subscriber once its stream is open (how a test
    or an operator sees that a router follows this prefill), and not once it went away."""
    def streams() -> float:
        return scrape(prefill.metrics).value("pdgrpc_kv_event_streams")  # type: ignore[attr-defined]

    await eventually_async(lambda: streams() == 0, what="no stream open")
    async with grpc.aio.insecure_channel(prefill.address) as ch:
        # A cursor this instance never reached: a snapshot comes at once.
        request = prefill_pb2.SubscribeKvEventsRequest(start_sequence_number=10**9)
        call = prefill_pb2_grpc.PrefillServiceStub(ch).SubscribeKvEvents(request, timeout=60)  # a loaded host
        async for _ in call:  # the snapshot: the stream is open
            break
        assert streams() == 1
        call.cancel()
    await eventually_async(lambda: streams() == 0, timeout=30, what="the stream closed")


async def test_one_client_holds_at_most_its_limit_of_streams_open(prefill: PrefillProc) -> None:
    """Each open stream costs the prefill a snapshot and a stream: one client past
    MAX_STREAMS_PER_CLIENT is refused, naming the limit, and gets its room back as its
    streams close."""
    request = prefill_pb2.SubscribeKvEventsRequest(start_sequence_number=10**9)  # a snapshot at once
    async with grpc.aio.insecure_channel(prefill.address) as ch:
        stub = prefill_pb2_grpc.PrefillServiceStub(ch)

        async def opened() -> grpc.aio.UnaryStreamCall:
            call = stub.SubscribeKvEvents(request, timeout=60)
            await call.read()  # the snapshot: the stream is open
            return call

        calls = [await opened() for _ in range(MAX_STREAMS_PER_CLIENT)]
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await opened()
        assert ei.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, (ei.value.code(), ei.value.details())
        assert f"{MAX_STREAMS_PER_CLIENT} SubscribeKvEvents calls open (limit {MAX_STREAMS_PER_CLIENT} per client" in (ei.value.details() or "")
        calls.pop().cancel()

        async def one_more() -> bool:
            try:
                calls.append(await opened())
            except grpc.aio.AioRpcError:
                return False
            return True

        await eventually_async(one_more, what="a stream once another closed")
        for call in calls:
            call.cancel()


async def test_smg_subscriber_gets_load_records_while_idle(prefill: PrefillProc) -> None:
    pb_grpc = pytest.importorskip("smg_grpc_proto.generated.sglang_scheduler_pb2_grpc", reason="the gateway extra is not installed")
    from smg_grpc_proto.generated import common_pb2 as smg

    async with grpc.aio.insecure_channel(prefill.address) as ch:
        stub = pb_grpc.SglangSchedulerStub(ch)
        call = stub.SubscribeKvEvents(smg.SubscribeKvEventsRequest(load_records_before_first_batch=True), timeout=10)
        got = []
        t0 = time.monotonic()
        async for b in call:
            got.append((time.monotonic() - t0, b))
            if len(got) == 2:
                call.cancel()
                break
    (t1, first), (t2, second) = got
    assert t1 < 1.0  # from the subscription on
    for b in (first, second):
        assert b.load.load_only and b.sequence_number == 0 and not b.events
        assert b.load.max_running_requests == 2 * 64  # --num-pages x --dp-size, as GetLoads says
        assert b.load.running_requests == 0
    assert second.load.sample > first.load.sample
    assert 0.5 < t2 - t1 < 3.0  # a heartbeat while idle

    # without the flag an old subscriber hears nothing before the publisher's first batch
    async with grpc.aio.insecure_channel(prefill.address) as ch:
        call = pb_grpc.SglangSchedulerStub(ch).SubscribeKvEvents(smg.SubscribeKvEventsRequest(), timeout=1.5)
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            async for _ in call:
                pass
        assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


class Subscriber:
    """What a client subscribed to ``address`` from sequence 0 holds, batch by batch."""

    def __init__(self, address: str) -> None:
        self.blocks: dict[int, prefill_pb2.KvBlock] = {}
        self.stored: list[int] = []  # every block hash stored, in order
        self.removed: list[int] = []
        self.sequence = 0
        self._ch = grpc.aio.insecure_channel(address)
        self._task = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        call = prefill_pb2_grpc.PrefillServiceStub(self._ch).SubscribeKvEvents(prefill_pb2.SubscribeKvEventsRequest())
        async for b in call:
            assert b.sequence_number == self.sequence + 1 or b.snapshot_count, (b.sequence_number, self.sequence)
            self.sequence = b.sequence_number
            for e in b.events:
                kind = e.WhichOneof("event")
                if kind == "stored":
                    for x in e.stored.blocks:
                        self.blocks[x.block_hash] = x
                        self.stored.append(x.block_hash)
                elif kind == "removed":
                    for h in e.removed.block_hashes:
                        self.blocks.pop(h)
                        self.removed.append(h)
                else:
                    self.blocks.clear()

    def pages(self) -> set[tuple[int, ...]]:
        return {tuple(x.token_ids) for x in self.blocks.values()}

    async def close(self) -> None:
        self._task.cancel()
        await self._ch.close()


def pages_of(ids: list[int]) -> set[tuple[int, ...]]:
    """The full pages of ``ids``, which a cache keeps once its request is done."""
    n = len(ids) // 4
    return {tuple(ids[i * 4:(i + 1) * 4]) for i in range(n)}


def zmq_state(messages: list[tuple[int, list]]) -> set[tuple[int, ...]]:
    """The pages a vLLM ZMQ consumer holds after ``messages`` (sequence, decoded batch)."""
    pages: dict[int, tuple[int, ...]] = {}
    for _, (ts, events) in messages:
        assert ts > 0
        for e in events:
            if e[0] == "BlockStored":
                _, hashes, parent, tokens, size, lora, medium = e
                assert size == 4 and len(tokens) == size * len(hashes) and medium == "GPU" and lora is None
                assert parent is None or parent in pages
                for i, h in enumerate(hashes):
                    pages[h] = tuple(tokens[i * size:(i + 1) * size])
            elif e[0] == "BlockRemoved":
                for h in e[1]:
                    pages.pop(h)
            else:
                assert e == ["AllBlocksCleared"]
                pages.clear()
    return set(pages.values())


@pytest.mark.skipif(not HAS_ZMQ, reason="--kv-events-zmq needs pdgrpc[zmq] (pyzmq, msgpack), not installed here")
async def test_zmq_publishes_the_merged_stream_in_vllms_format(tmp_path: Path) -> None:
    """A vLLM ZMQ consumer replaying from 0 holds what the native stream holds, and then
    gets each new batch live on the PUB socket, numbered on."""
    import msgpack
    import zmq
    import zmq.asyncio

    ports = {free_port(set())}
    while len(ports) < 2:
        ports.add(free_port(set()))
    pub, replay = (f"tcp://127.0.0.1:{port}" for port in ports)
    flags = [*ENGINE_FLAGS, "--transport", "tcp", "--kv-events-zmq", pub, "--kv-events-zmq-replay", replay]
    prefill = await asyncio.to_thread(PrefillProc, flags, tmp_path, "zmq")
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub)
    req = ctx.socket(zmq.DEALER)
    req.connect(replay)
    d = FakeDecode(CONFIG)
    await d.start()
    native = Subscriber(prefill.address)
    try:
        ids = prompt(26, seed=11)
        await run_one(prefill, d, ids, SamplingParams(), query=False, dp_size=1)
        await eventually_async(lambda: pages_of(ids) <= native.pages(), 10, what="the native stream has the pages")
        await req.send_multipart((b"", (0).to_bytes(8, "big")))
        got: list[tuple[int, list]] = []
        while True:
            _, seq, payload = await asyncio.wait_for(req.recv_multipart(), 10)
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            got.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
        assert [s for s, _ in got] == list(range(len(got)))
        assert zmq_state(got) == native.pages()

        more = prompt(18, seed=12)
        await run_one(prefill, d, more, SamplingParams(), query=False, dp_size=1)
        live: list[tuple[int, list]] = []
        while not pages_of(more) <= zmq_state(got + live):
            topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 10)
            live.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
        assert topic == b"" and live[-1][0] >= len(got)
    finally:
        await native.close()
        await d.close()
        sub.close(linger=0)
        req.close(linger=0)
        ctx.term()
        assert await asyncio.to_thread(prefill.stop) == 0, prefill.log()[-3000:]


async def test_the_merged_stream_stores_shared_pages_once_and_drops_a_dead_ranks_at_once(prefill: PrefillProc) -> None:
    """Two dp ranks cache prompts sharing 5 pages: the controller's stream stores each page
    once, with its exact tokens and its parent, and when rank 0's worker is killed it removes
    rank 0's own pages at once while the shared ones stay (rank 1 holds them)."""
    sub = Subscriber(prefill.address)
    d = FakeDecode(CONFIG)
    await d.start()
    try:
        shared = prompt(21, seed=5)[:21]
        a = shared[:20] + prompt(11, seed=6)[1:]  # 30 tokens: pages 0-4 shared, 5-6 its own
        b = shared[:20] + prompt(11, seed=7)[1:]
        greedy = SamplingParams()
        await run_one(prefill, d, a, greedy, query=True, routed=0)
        await run_one(prefill, d, b, greedy, query=True, routed=1)
        await eventually_async(lambda: sub.pages() == pages_of(a) | pages_of(b), 10, what="both ranks' pages streamed")
        assert len(sub.stored) == len(set(sub.stored)) == 9  # 5 shared + 2 + 2: each once
        for x in sub.blocks.values():  # a chain: each page's parent is the page before it
            i = next(i for i in range(7) if tuple(a[i * 4:(i + 1) * 4]) == tuple(x.token_ids) or tuple(b[i * 4:(i + 1) * 4]) == tuple(x.token_ids))
            assert x.HasField("parent_hash") == (i > 0)
            if i:
                assert tuple(sub.blocks[x.parent_hash].token_ids) in {tuple(a[(i - 1) * 4:i * 4]), tuple(b[(i - 1) * 4:i * 4])}

        # cache_aware dispatch reads the ranks' streams: a prompt continuing b goes to rank 1,
        # one continuing a to rank 0
        c = b[:24] + prompt(9, seed=8)[1:]
        assert (await run_one(prefill, d, c, greedy, query=True))[0].dp_rank == 1
        e = a[:28] + prompt(5, seed=9)[1:]
        assert (await run_one(prefill, d, e, greedy, query=True))[0].dp_rank == 0
        want = pages_of(a) | pages_of(b) | pages_of(c) | pages_of(e)
        await eventually_async(lambda: sub.pages() == want, 10,
                               what=lambda: f"the new pages streamed: extra {sub.pages() - want}, missing {want - sub.pages()}")
        os.kill(prefill.worker_pids[0], signal.SIGKILL)
        await eventually_async(lambda: sub.pages() == pages_of(b) | pages_of(c), 5, what="rank 0's own pages removed")
        assert len(sub.removed) == 3  # a's 2 own pages and e's last

        # a late subscriber gets the same state by replay
        late = Subscriber(prefill.address)
        try:
            await eventually_async(lambda: late.pages() == pages_of(b) | pages_of(c), 5, what="a late subscriber caught up")
        finally:
            await late.close()

        # the controller starts rank 0 again, and follows the new worker's cache from its first batch
        await eventually_async(lambda: prefill.log().count("prefill worker dp0 serves again") == 1 or None, 60,
                               what="rank 0's worker started again", interval=0.1)
        f = prompt(17, seed=10)
        await run_one(prefill, d, f, greedy, query=True, routed=0)
        await eventually_async(lambda: sub.pages() == pages_of(b) | pages_of(c) | pages_of(f), 10,
                               what="the new worker's pages streamed")
    finally:
        await sub.close()
        await d.close()


def test_a_zmq_replay_endpoint_alone_is_refused_naming_the_flag() -> None:
    from pdgrpc.errors import ConfigError
    from pdgrpc.serving.kv_zmq import check_zmq_args

    with pytest.raises(ConfigError, match="--kv-events-zmq-replay needs --kv-events-zmq"):
        check_zmq_args("", "tcp://127.0.0.1:5558")
    check_zmq_args("", "")  # off: nothing to check


async def test_no_smg_kv_events_answers_smg_unimplemented() -> None:
    """``--no-smg-kv-events``: smg hears UNIMPLEMENTED and routes by its own tree."""
    pytest.importorskip("smg_grpc_proto", reason="the gateway extra is not installed")
    from smg_grpc_proto.generated import common_pb2 as smg

    from pdgrpc.gateway.servicer import PrefillLeg
    from pdgrpc.prefill.cli import build_parser

    assert build_parser().parse_args(["--no-smg-kv-events"]).no_smg_kv_events

    class Aborted(Exception):
        pass

    class Context:
        code: grpc.StatusCode | None = None

        async def abort(self, code: grpc.StatusCode, details: str) -> None:
            self.code = code
            raise Aborted(details)

    leg = PrefillLeg(None, lambda: None, active=lambda: 0, healthy=lambda: True, kv_events=None)  # type: ignore[arg-type,return-value]
    ctx = Context()
    with pytest.raises(Aborted, match="--no-smg-kv-events"):
        [b async for b in leg.SubscribeKvEvents(smg.SubscribeKvEventsRequest(), ctx)]
    assert ctx.code == grpc.StatusCode.UNIMPLEMENTED


def test_stopping_the_prefill_ends_its_subscriptions_at_once(prefill: PrefillProc) -> None:
    """A subscription ends cleanly as soon as the prefill stops, rather than holding the
    server for its grace period and ending in an error. Last in this module: it stops the
    module's prefill."""
    ended: list[float] = []
    errors: list[grpc.RpcError] = []
    ch = grpc.insecure_channel(prefill.address)
    stream = prefill_pb2_grpc.PrefillServiceStub(ch).SubscribeKvEvents(prefill_pb2.SubscribeKvEventsRequest(), timeout=60)

    def read() -> None:
        try:
            for _ in stream:
                pass
        except grpc.RpcError as exc:
            errors.append(exc)
        ended.append(time.monotonic())

    reader = threading.Thread(target=read)
    reader.start()
    try:
        eventually(lambda: scrape(prefill.metrics).value("pdgrpc_kv_event_streams") == 1,  # type: ignore[attr-defined]
                   30, 0.05, "the subscription is open")
        t0 = time.monotonic()
        assert prefill.stop() == 0, prefill.log()[-3000:]
        reader.join(10)
    finally:
        ch.close()
    assert not errors, errors
    assert ended and ended[0] - t0 < 2.0, f"the subscription ended {ended[0] - t0:.1f} s after the stop began"
