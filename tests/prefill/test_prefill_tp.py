"""Tensor-parallel prefill (``--tp-size``) as real processes: the controller, its TP
workers computing in lock step over real gloo, real gRPC, a real tcp transport, and fake
decodes of TP 1 and TP 2 that check every KV byte against a TP 1 reference engine.

Two instances per module: ``tp2`` (``--tp-size 2``) and ``tp1`` (the TP 1 sender to a
TP 2 decode). Tests reuse them; each ends with GetStats back at zero.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import AsyncIterator, Iterator

import grpc
import pytest
import torch

from pdgrpc.engine.base import SamplingParams
from pdgrpc.serving.tp import heads_of, transfer_room
from pdgrpc.v1 import bootstrap_pb2 as bpb
from pdgrpc.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from tests.eventually import eventually_async
from tests.prefill.fake_decode import FakeDecode, KVPoll, Room, abort_request, reference_prefill
from tests.prefill.harness import CONFIG, SETTLE_S, new_room, prefill_stub, prompt, request
from tests.prefill.procs import ENGINE_FLAGS, PrefillProc, pid_alive

NUM_PAGES = 96  # per prefill worker; a TP worker keeps 16 of them as scratch (64-token prompts)
SCRATCH = 16
FLAGS = [*ENGINE_FLAGS, "--num-pages", str(NUM_PAGES), "--transport", "tcp", "--dp-size", "1", "--chunk-size", "6",
         "--handshake-timeout", "10", "--transfer-timeout", "20", "--log-level", "info"]
DECODE_CONFIG = dataclasses.replace(CONFIG, num_pages=256)
H = CONFIG.model.num_kv_heads

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("prefill_tp")


def _proc(flags: list[str], logs: Path, name: str) -> Iterator[PrefillProc]:
    p = PrefillProc(flags, logs, name)
    try:
        yield p
    finally:
        code = p.stop()
        assert code == 0, p.log()[-3000:]
        assert not any(pid_alive(pid) for pid in p.worker_pids), "SIGTERM left a worker running"


@pytest.fixture(scope="module")
def tp2(logs: Path) -> Iterator[PrefillProc]:
    yield from _proc([*FLAGS, "--tp-size", "2"], logs, "tp2")


@pytest.fixture(scope="module")
def tp1(logs: Path) -> Iterator[PrefillProc]:
    yield from _proc(FLAGS, logs, "tp1")


@pytest.fixture
async def tp1_decode() -> AsyncIterator[FakeDecode]:
    d = FakeDecode(DECODE_CONFIG, sink=True, num_slots=32)
    await d.start()
    try:
        yield d
    finally:
        await d.close()


@pytest.fixture
async def tp2_decode() -> AsyncIterator[list[FakeDecode]]:
    ds = [FakeDecode(DECODE_CONFIG, tp_rank=r, tp_size=2, sink=True, num_slots=32) for r in range(2)]
    for d in ds:
        await d.start()
    try:
        yield ds
    finally:
        for d in ds:
            await d.close()


async def settles_to_zero(p: PrefillProc, workers: int) -> None:
    ch, stub = await prefill_stub(p)
    try:
        last: list[common_pb2.ResourceStats] = []

        async def idle() -> bool:
            last[:] = [(await stub.GetStats(prefill_pb2.GetStatsRequest(), timeout=5)).stats]
            return (last[0].active_requests, last[0].pages_in_use, last[0].transport_rooms) == (0, 0, 0)

        await eventually_async(idle, SETTLE_S, what="prefill released everything", interval=0.05)
        scratch = SCRATCH if workers > 1 else 0
        assert last[0].pages_total == workers * (NUM_PAGES - scratch)
    finally:
        await ch.close()


def reference(ids: list[int], sampling: SamplingParams):  # type: ignore[no-untyped-def]
    eng, pages, tok = reference_prefill(CONFIG, ids, sampling)
    probe = FakeDecode.__new__(FakeDecode)  # only kv_of (no transport)
    return FakeDecode.kv_of(probe, pages, len(ids), eng), tok


def assert_heads(d: FakeDecode, r: Room, ids: list[int], want_kv: list[torch.Tensor], tok) -> None:  # type: ignore[no-untyped-def]
    h0, h1 = heads_of(d.tp_rank, d.tp_size, H)
    got = d.kv_of(r.pages, len(ids))
    for i, (g, w) in enumerate(zip(got, want_kv)):
        assert torch.equal(g, w[h0:h1]), f"decode tp rank {d.tp_rank}: KV tensor {i} differs from TP 1 heads [{h0}, {h1})"
    row = d.row(r)
    assert (row.output_id, row.output_token_logprob_value) == (tok.token_id, tok.logprob)
    assert d.rows.room(r.slot) == r.room


async def tp2_to_tp1(p: PrefillProc, d: FakeDecode, ids: list[int], sampling: SamplingParams) -> tuple[prefill_pb2.PrefillResponse, Room]:
    """Prefill TP 2 -> decode TP 1: one decode rank handshakes with both prefill ranks."""
    room = new_room()
    r = d.allocate(room, len(ids), keys=[transfer_room(room, p_, 0) for p_ in (0, 1)])
    ch, stub = await prefill_stub(p)
    try:
        call = asyncio.ensure_future(stub.Prefill(request(room, ids, sampling), timeout=60))
        workers = await d.workers(p.bootstrap, 0)
        assert [w.tp_rank for w in workers] == [0, 1]
        await asyncio.gather(*(d.handshake(w.transfer_address, r, wants_metadata=w.tp_rank == 0) for w in workers))
        resp = await call
        for key in r.keys:
            st = await d.transport.wait(key, 30)
            assert st.state is KVPoll.SUCCESS, st.reason
        return resp, r
    finally:
        await ch.close()


# ---------------------------------------------------------------------------------------


async def test_tp2_workers_register_as_tp_ranks(tp2: PrefillProc, tp1_decode: FakeDecode) -> None:
    stub = tp1_decode.bootstrap_stub(tp2.bootstrap)
    info = (await stub.GetParallelInfo(bpb.GetParallelInfoRequest(), timeout=5)).parallel_info
    assert (info.dp_size, info.tp_size) == (1, 2)
    assert len(tp2.worker_pids) == 2
    assert [w.tp_rank for w in await tp1_decode.workers(tp2.bootstrap, 0)] == [0, 1]


async def test_tp2_prefill_to_tp1_decode_is_bit_exact(tp2: PrefillProc, tp1_decode: FakeDecode) -> None:
    sampling = SamplingParams(top_logprobs=3)
    ids = prompt(40, 1)
    resp, r = await tp2_to_tp1(tp2, tp1_decode, ids, sampling)
    want, tok = reference(ids, sampling)
    assert_heads(tp1_decode, r, ids, want, tok)
    assert resp.dp_rank == 0 and resp.prompt_tokens == len(ids)
    # rank 1 wrote the same row into the sink (rank 0 into the metadata region)
    assert tp1_decode.sink is not None
    sink = tp1_decode.sink.read_row(r.slot)
    assert (sink.output_id, sink.output_token_logprob_value) == (tok.token_id, tok.logprob)
    assert tp1_decode.sink.room(r.slot) == r.room
    # both ranks' halves of every page, plus two rows
    kv_bytes = 2 * CONFIG.model.num_layers * len(r.pages) * tp1_decode.engine.kv_layout.page_bytes
    assert resp.bytes_transferred == kv_bytes + 2 * tp1_decode.rows.tensor[0].numel() * tp1_decode.rows.tensor.element_size()
    tp1_decode.free(r)
    await settles_to_zero(tp2, 2)


async def test_tp1_prefill_to_tp2_decode_writes_each_rank_its_heads(tp1: PrefillProc, tp2_decode: list[FakeDecode]) -> None:
    sampling = SamplingParams()
    ids = prompt(33, 2)
    room = new_room()
    rooms = [d.allocate(room, len(ids), keys=[transfer_room(room, 0, d.tp_rank)]) for d in tp2_decode]
    ch, stub = await prefill_stub(tp1)
    try:
        call = asyncio.ensure_future(stub.Prefill(request(room, ids, sampling), timeout=60))
        (w,) = await tp2_decode[0].workers(tp1.bootstrap, 0)
        await asyncio.gather(*(d.handshake(w.transfer_address, r) for d, r in zip(tp2_decode, rooms)))
        await call
        for d, r in zip(tp2_decode, rooms):
            st = await d.transport.wait(r.keys[0], 30)
            assert st.state is KVPoll.SUCCESS, st.reason
    finally:
        await ch.close()
    want, tok = reference(ids, sampling)
    for d, r in zip(tp2_decode, rooms):
        assert_heads(d, r, ids, want, tok)
        d.free(r)
    await settles_to_zero(tp1, 1)


async def test_tp2_prefill_to_tp2_decode_one_to_one(tp2: PrefillProc, tp2_decode: list[FakeDecode]) -> None:
    sampling = SamplingParams(top_logprobs=2)
    ids = prompt(50, 3)
    room = new_room()
    rooms = [d.allocate(room, len(ids)) for d in tp2_decode]  # key = room: ranks map one to one
    ch, stub = await prefill_stub(tp2)
    try:
        call = asyncio.ensure_future(stub.Prefill(request(room, ids, sampling), timeout=60))
        workers = await tp2_decode[0].workers(tp2.bootstrap, 0)
        await asyncio.gather(*(d.handshake(w.transfer_address, r) for d, w, r in zip(tp2_decode, workers, rooms)))
        await call
        for d, r in zip(tp2_decode, rooms):
            st = await d.wait(r, 30)
            assert st.state is KVPoll.SUCCESS, st.reason
    finally:
        await ch.close()
    want, tok = reference(ids, sampling)
    for d, r in zip(tp2_decode, rooms):
        assert_heads(d, r, ids, want, tok)
        d.free(r)
    await settles_to_zero(tp2, 2)


async def test_incompatible_tp_sizes_are_refused(tp2: PrefillProc, tp1_decode: FakeDecode) -> None:
    ids = prompt(20, 4)
    room = new_room()
    r = tp1_decode.allocate(room, len(ids))
    ch, stub = await prefill_stub(tp2)
    try:
        call = asyncio.ensure_future(stub.Prefill(request(room, ids), timeout=60))
        workers = await tp1_decode.workers(tp2.bootstrap, 0)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await tp1_decode.handshake(workers[0].transfer_address, r, decode_tp_rank=0, decode_tp_size=3)
        assert ei.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        msg = ei.value.details()
        assert "decode_tp_size=3" in msg and "decode_tp_rank=0" in msg and "tp_rank 0 of tp_size 2" in msg, msg
        with pytest.raises(grpc.aio.AioRpcError) as ei2:
            await call
        assert ei2.value.code() is grpc.StatusCode.FAILED_PRECONDITION, ei2.value.details()
    finally:
        await ch.close()
    tp1_decode.free(r)
    # the group still serves
    sampling = SamplingParams()
    ids = prompt(17, 5)
    _, r = await tp2_to_tp1(tp2, tp1_decode, ids, sampling)
    want, tok = reference(ids, sampling)
    assert_heads(tp1_decode, r, ids, want, tok)
    tp1_decode.free(r)
    await settles_to_zero(tp2, 2)


async def test_many_concurrent_requests_in_lock_step(tp2: PrefillProc, tp1_decode: FakeDecode) -> None:
    sampling = SamplingParams()
    prompts = [prompt(8 + 3 * i, 100 + i) for i in range(10)]
    results = await asyncio.gather(*(tp2_to_tp1(tp2, tp1_decode, ids, sampling) for ids in prompts))
    for ids, (resp, r) in zip(prompts, results):
        want, tok = reference(ids, sampling)
        assert_heads(tp1_decode, r, ids, want, tok)
        tp1_decode.free(r)
    await settles_to_zero(tp2, 2)


async def test_abort_on_one_tp_rank_fails_the_request_and_the_group_keeps_serving(tp2: PrefillProc, tp1_decode: FakeDecode) -> None:
    ids = prompt(30, 6)
    room = new_room()
    r = tp1_decode.allocate(room, len(ids), keys=[transfer_room(room, p_, 0) for p_ in (0, 1)])
    ch, stub = await prefill_stub(tp2)
    try:
        call = asyncio.ensure_future(stub.Prefill(request(room, ids), timeout=60))
        workers = await tp1_decode.workers(tp2.bootstrap, 0)
        await tp1_decode.handshake(workers[0].transfer_address, r)  # rank 0 only
        await asyncio.sleep(0.2)
        await tp1_decode.stub(workers[1].transfer_address).AbortRoom(
            abort_request(room, "decode gave up"), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await call
        assert ei.value.code() is grpc.StatusCode.ABORTED and "decode gave up" in ei.value.details(), ei.value.details()
    finally:
        await ch.close()
    tp1_decode.free(r)
    await settles_to_zero(tp2, 2)
    sampling = SamplingParams()
    ids = prompt(25, 7)
    _, r = await tp2_to_tp1(tp2, tp1_decode, ids, sampling)
    want, tok = reference(ids, sampling)
    assert_heads(tp1_decode, r, ids, want, tok)
    tp1_decode.free(r)
    await settles_to_zero(tp2, 2)


async def test_tp2_ranks_whose_caches_differ_compute_from_the_prefix_both_hold(tp2: PrefillProc, tp1_decode: FakeDecode) -> None:
    """Rank 0 caches a prompt while rank 1 still holds its room (its handshake has not
    come), so a second prompt sharing it matches ten pages on rank 0 and none on rank 1:
    the group computes it from the start, and once both hold the prefix, from its end.
    Every KV byte equals a cold TP 1 prefill's either way."""
    sampling = SamplingParams(top_logprobs=2)
    shared = prompt(40, 9)  # ten full pages
    room = new_room()
    first = tp1_decode.allocate(room, len(shared), keys=[transfer_room(room, p_, 0) for p_ in (0, 1)])
    ch, stub = await prefill_stub(tp2)
    try:
        call = asyncio.ensure_future(stub.Prefill(request(room, shared, sampling), timeout=60))
        workers = await tp1_decode.workers(tp2.bootstrap, 0)
        await tp1_decode.handshake(workers[0].transfer_address, first, wants_metadata=True)  # rank 0 only, for now
        st = await tp1_decode.transport.wait(first.keys[0], 30)
        assert st.state is KVPoll.SUCCESS, st.reason
        rank0 = prefill_pb2_grpc.PrefillServiceStub(tp1_decode.channel(workers[0].transfer_address))

        async def rank0_done() -> bool:  # its room ended: the prompt's pages are cached there
            return (await rank0.GetStats(prefill_pb2.GetStatsRequest(), timeout=5)).stats.active_requests == 0

        await eventually_async(rank0_done, SETTLE_S, what="rank 0 finished the first prompt")

        diverged = shared + prompt(6, 10)[1:]
        resp, r = await tp2_to_tp1(tp2, tp1_decode, diverged, sampling)
        assert resp.cached_tokens == 0  # rank 1 holds none of it yet
        want, tok = reference(diverged, sampling)
        assert_heads(tp1_decode, r, diverged, want, tok)
        tp1_decode.free(r)

        await tp1_decode.handshake(workers[1].transfer_address, first, wants_metadata=False)
        assert (await call).cached_tokens == 0
        want, tok = reference(shared, sampling)
        assert_heads(tp1_decode, first, shared, want, tok)
        tp1_decode.free(first)
    finally:
        await ch.close()
    await settles_to_zero(tp2, 2)  # both ranks' rooms ended: both hold the prefix now

    again = shared + prompt(9, 11)[1:]
    resp, r = await tp2_to_tp1(tp2, tp1_decode, again, sampling)
    assert resp.cached_tokens == len(shared)
    want, tok = reference(again, sampling)
    assert_heads(tp1_decode, r, again, want, tok)
    tp1_decode.free(r)
    await settles_to_zero(tp2, 2)


async def test_rank_1_takes_pages_only_for_rooms_rank_0_started(tp2: PrefillProc, tp1_decode: FakeDecode) -> None:
    """Five rooms hold 66 of rank 0's 80 pages (their decode has handshaken rank 1 only), so
    five 16-page prompts wait for pages on rank 0 while rank 1 has room for all of them.
    A 2-page prompt that rank 0 admits then runs at once: rank 1 does not fill its pool
    with rooms the group has not started. Then every room runs, each KV byte exact."""
    d, sampling = tp1_decode, SamplingParams()
    workers = await d.workers(tp2.bootstrap, 0)
    ranks = [prefill_pb2_grpc.PrefillServiceStub(d.channel(w.transfer_address)) for w in workers]
    ch, stub = await prefill_stub(tp2)
    calls: list[asyncio.Future[prefill_pb2.PrefillResponse]] = []

    def start(ids: list[int]) -> Room:
        room = new_room()
        r = d.allocate(room, len(ids), keys=[transfer_room(room, p_, 0) for p_ in (0, 1)])
        calls.append(asyncio.ensure_future(stub.Prefill(request(room, ids, sampling), timeout=60)))
        return r

    async def active(rank: int, n: int) -> bool:
        return (await ranks[rank].GetStats(prefill_pb2.GetStatsRequest(), timeout=5)).stats.active_requests == n

    async def landed(call: "asyncio.Future[prefill_pb2.PrefillResponse]", ids: list[int], r: Room) -> None:
        await call
        for key in r.keys:
            st = await d.transport.wait(key, 30)
            assert st.state is KVPoll.SUCCESS, st.reason
        want, tok = reference(ids, sampling)
        assert_heads(d, r, ids, want, tok)
        d.free(r)

    try:
        held = [prompt(64, 20 + i) for i in range(4)] + [prompt(8, 24)]
        held_rooms = [start(ids) for ids in held]
        for r in held_rooms:
            await d.handshake(workers[1].transfer_address, r, wants_metadata=False)
        for r in held_rooms:
            st = await d.transport.wait(r.keys[1], 30)
            assert st.state is KVPoll.SUCCESS, st.reason
        await eventually_async(lambda: active(1, 0), SETTLE_S, what="rank 1 finished the held rooms", interval=0.05)

        large = [prompt(64, 30 + i) for i in range(5)]
        large_rooms = [start(ids) for ids in large]
        for r in large_rooms:  # early handshakes: kept until each room's Prefill RPC takes them
            for w in workers:
                await d.handshake(w.transfer_address, r, wants_metadata=w.tp_rank == 0)
        await eventually_async(lambda: active(1, 5), SETTLE_S, what="rank 1 has the large prompts' RPCs", interval=0.05)
        assert await active(0, 10)

        small = prompt(8, 40)
        r = start(small)
        for w in workers:
            await d.handshake(w.transfer_address, r, wants_metadata=w.tp_rank == 0)
        await landed(calls[-1], small, r)  # before: ABORTED, rank 1's pool full of unstarted rooms

        for r in held_rooms:
            await d.handshake(workers[0].transfer_address, r, wants_metadata=True)
        for call, ids, r in zip(calls, held + large, held_rooms + large_rooms):
            await landed(call, ids, r)
    finally:
        for call in calls:
            call.cancel()
        await ch.close()
    await settles_to_zero(tp2, 2)
