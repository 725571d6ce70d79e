"""``python -m pdgrpc.prefill`` as real processes on 127.0.0.1 (controller + 2 worker
processes each), driven by a fake decode with a real tcp receiver and real gRPC calls.

Two instances per module: ``rr`` (round_robin, embedded bootstrap: the register/query
path) and ``follow`` (strict follow_bootstrap_room, external bootstrap process: the fast
path). Every test ends by reading the instance's own GetStats until nothing is held.
``rr`` serves metrics (controller and each worker); its tests check over HTTP how their
requests were counted: finished, refused, or aborted under which reason.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import AsyncIterator, Iterator

import grpc
import pytest
import torch

from pdgrpc.engine.base import SamplingParams
from pdgrpc.cluster.launcher import free_port_block
from pdgrpc.engine.reference import ReferenceEngine
from tests.scrape import scrape
from pdgrpc.serving.metadata import compat_hash_bytes, metadata_layout
from pdgrpc.transport.base import RoomGrant
from pdgrpc.v1 import bootstrap_pb2 as bpb
from pdgrpc.v1 import prefill_pb2
from tests.eventually import eventually_async
from tests.fuzz_messages import fuzz
from tests.prefill.fake_decode import FakeDecode, KVPoll, Room, abort_request, reference_prefill
from tests.prefill.harness import CONFIG, SETTLE_S, active_requests, assert_landed_bit_exact, assert_settles_to_zero, new_room, prefill_stub, prompt, request, run_one
from tests.prefill.procs import ENGINE_FLAGS, BootstrapProc, PrefillProc, pid_alive

CHUNK = 6  # not a multiple of the 4-token page: chunks end mid-page
HANDSHAKE_TIMEOUT = 4.0
FLAGS = [*ENGINE_FLAGS, "--transport", "tcp", "--dp-size", "2", "--chunk-size", str(CHUNK),
         "--handshake-timeout", str(HANDSHAKE_TIMEOUT), "--transfer-timeout", "20", "--log-level", "info"]

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("prefill")


@pytest.fixture(scope="module")
def rr(logs: Path) -> Iterator[PrefillProc]:
    base = free_port_block(3)  # the controller's metrics port, then dp0's and dp1's
    p = PrefillProc([*FLAGS, "--load-balance-method", "round_robin", "--metrics-port", str(base)], logs, "rr")
    p.metrics = [f"127.0.0.1:{base + i}" for i in range(3)]  # type: ignore[attr-defined]
    try:
        yield p
    finally:
        code = p.stop()
        assert code == 0, p.log()[-3000:]
        assert not any(pid_alive(pid) for pid in p.worker_pids), "SIGTERM left a worker running"


@pytest.fixture(scope="module")
def follow(logs: Path) -> Iterator[PrefillProc]:
    b = BootstrapProc(logs)
    try:
        p = PrefillProc(
            [*FLAGS, "--load-balance-method", "follow_bootstrap_room", "--bootstrap", b.address, "--no-prefix-cache"], logs, "follow"
        )
        try:
            yield p
        finally:
            assert p.stop() == 0, p.log()[-3000:]
    finally:
        b.stop()


class Outcomes:
    """How an instance counted the requests of one test: the change of
    pdgrpc_requests_total (by state) and pdgrpc_aborts_total (``aborted:<reason>``)
    summed over the controller and its workers (each request is counted by exactly one
    of them), and of the registrations the controller sent (``registered``: rooms)."""

    def __init__(self, endpoints: list[str]) -> None:
        self.endpoints = endpoints
        self.before = self._read()

    def _read(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for address in self.endpoints:
            s = scrape(address)
            for x in s.families["pdgrpc_requests"].samples + s.families["pdgrpc_aborts"].samples:
                if x.name.endswith("_total") and x.labels["role"] == "prefill":
                    key = x.labels["state"] if "state" in x.labels else f"aborted:{x.labels['reason']}"
                    out[key] = out.get(key, 0) + x.value
            out["registered"] = out.get("registered", 0) + s.value("pdgrpc_dp_rank_registration_batch_size_sum", role="prefill")
        return out

    async def changed(self) -> dict[str, float]:
        now = await asyncio.to_thread(self._read)
        return {k: v - self.before.get(k, 0) for k, v in now.items() if v != self.before.get(k, 0)}


@pytest.fixture
def rr_outcomes(rr: PrefillProc) -> Outcomes:
    return Outcomes(rr.metrics)  # type: ignore[attr-defined]


@pytest.fixture
async def decode() -> AsyncIterator[FakeDecode]:
    async with FakeDecode(CONFIG) as d:
        yield d


# ---------------------------------------------------------------------------------------


async def test_workers_register_with_bootstrap(rr: PrefillProc, decode: FakeDecode) -> None:
    stub = decode.bootstrap_stub(rr.bootstrap)
    info = (await stub.GetParallelInfo(bpb.GetParallelInfoRequest(), timeout=5)).parallel_info
    assert (info.dp_size, info.tp_size, info.page_size, info.kv_dtype) == (2, 1, 4, "float32")
    # Decode reads these to know it must query room -> rank (round_robin registers every room).
    assert (info.load_balance_method, info.force_dp_rank_query) == (bpb.LOAD_BALANCE_METHOD_ROUND_ROBIN, False)
    assert info.compatibility_hash == compat_hash_bytes(ReferenceEngine(CONFIG))
    seen = []
    for rank in (0, 1):
        (w,) = await decode.workers(rr.bootstrap, rank)
        assert (w.dp_rank, w.transport, w.generation) == (rank, "tcp", 1)
        assert w.transport_endpoint.startswith(b"PDGT")  # a transport descriptor
        seen.append(w.transfer_address)
    assert sorted(seen) == sorted(rr.worker_addresses) and len(set(seen)) == 2


@pytest.mark.parametrize("n", [3, 8, 23], ids=["below-page", "page-multiple", "multi-chunk"])
async def test_kv_and_metadata_arrive_bit_exact(rr: PrefillProc, decode: FakeDecode, n: int) -> None:
    ids = prompt(n, seed=n)
    sampling = SamplingParams(temperature=0.8, seed=1234 + n, top_logprobs=5)
    resp, r = await run_one(rr, decode, ids, sampling, query=True)
    assert_landed_bit_exact(decode, r, ids, sampling)
    ref_engine = ReferenceEngine(CONFIG)
    layout = ref_engine.kv_layout
    pages = ref_engine.pages_needed(n)
    assert resp.prompt_tokens == n
    assert resp.bytes_transferred == pages * layout.page_bytes * 2 * layout.num_layers + metadata_layout().row_bytes
    assert resp.compute_seconds > 0 and resp.transfer_seconds > 0
    # The logs tell the request's story, each line keyed by its room.
    log = rr.log()
    for event in ("dispatched dp_rank=", "admitted", "handshake pages=", "done bytes="):
        assert f"room={r.room} {event}" in log, event
    decode.free(r)
    await assert_settles_to_zero(rr)


SENTINEL = 7.0  # what the decode's cached pages hold: a write into one would change it


def _delta_room(decode: FakeDecode, n: int, cached: int) -> Room:
    """Pages and a slot for a prompt of ``n`` tokens whose first ``cached`` pages the
    decode holds already: the grant holds only the rest, as the decode's prefix cache
    grants them."""
    r = decode.allocate(new_room(), n)
    decode.transport.release(r.room)  # granted again, without the cached pages
    decode.transport.advertise(RoomGrant.of(r.room, r.pages[cached:], r.slot))
    for pool in (*decode.engine.kv_buffers().k, *decode.engine.kv_buffers().v):
        pool[r.pages[:cached]] = SENTINEL
    return r


def _cached_pages_untouched(decode: FakeDecode, r: Room, cached: int) -> bool:
    return all(bool((pool[r.pages[:cached]] == SENTINEL).all()) for pool in (*decode.engine.kv_buffers().k, *decode.engine.kv_buffers().v))


@pytest.mark.parametrize("cached", [0, 3, 6], ids=["older-decode-no-field", "partial", "full-hit-row-alone"])
async def test_a_delta_transfer_sends_only_the_pages_the_decode_lacks(rr: PrefillProc, decode: FakeDecode, cached: int) -> None:
    """The handshake's cached_pages = k: the prefill writes pages k.. then the row, and
    reports (n - k) pages' bytes; k = 0 is what a decode without the field sends."""
    ids = prompt(24, seed=5)  # 6 full pages of 4 tokens, computed in chunks of 6
    sampling = SamplingParams(temperature=0.7, seed=99, top_logprobs=3)
    r = _delta_room(decode, len(ids), cached)
    ch, stub = await prefill_stub(rr)
    try:
        call = asyncio.ensure_future(stub.Prefill(request(r.room, ids, sampling, routed=0), timeout=60))
        (w,) = await decode.workers(rr.bootstrap, 0)
        await decode.handshake(w.transfer_address, r, **({"cached_pages": cached} if cached else {}))
        resp = await call
    finally:
        await ch.close()
    assert (await decode.wait(r)).state is KVPoll.SUCCESS
    layout = ReferenceEngine(CONFIG).kv_layout
    page_bytes = layout.page_bytes * 2 * layout.num_layers
    assert resp.bytes_transferred == (6 - cached) * page_bytes + metadata_layout().row_bytes
    assert _cached_pages_untouched(decode, r, cached)
    # The pages written hold exactly a local prefill's KV; the row its first token.
    ref_engine, ref_pages, tok = reference_prefill(CONFIG, ids, sampling)
    got = decode.kv_of(r.pages[cached:], len(ids) - cached * 4)
    want = decode.kv_of(ref_pages[cached:], len(ids) - cached * 4, ref_engine)
    assert all(torch.equal(g, x) for g, x in zip(got, want))
    assert decode.row(r).output_id == tok.token_id and decode.rows.room(r.slot) == r.room
    decode.free(r)
    await assert_settles_to_zero(rr)


async def test_a_write_below_cached_pages_is_refused_and_lands_nothing(rr: PrefillProc, decode: FakeDecode, rr_outcomes: Outcomes) -> None:
    """The decode granted only pages 3.. (it holds 0..2), but the prefill is told to send
    every page (cached_pages 0): the receiver refuses the write, the cached pages keep
    their KV, no row lands, and the prefill counts a rejected write."""
    ids = prompt(24, seed=6)
    r = _delta_room(decode, len(ids), 3)
    ch, stub = await prefill_stub(rr)
    try:
        call = asyncio.ensure_future(stub.Prefill(request(r.room, ids, routed=0), timeout=60))
        (w,) = await decode.workers(rr.bootstrap, 0)
        await decode.handshake(w.transfer_address, r)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await call
        assert ei.value.code() is grpc.StatusCode.ABORTED and "transfer failed" in ei.value.details()
    finally:
        await ch.close()
    assert _cached_pages_untouched(decode, r, 3)
    assert decode.rows.room(r.slot) == 0
    decode.free(r)
    await assert_settles_to_zero(rr)
    assert await rr_outcomes.changed() == {"aborted": 1, "aborted:rejected_write": 1, "registered": 1}


async def test_round_robin_alternates_and_registers_each_room(rr: PrefillProc, decode: FakeDecode) -> None:
    ranks = []
    for i in range(4):
        resp, r = await run_one(rr, decode, prompt(5, seed=i), SamplingParams(), query=True)
        ranks.append(resp.dp_rank)
        decode.free(r)
    assert ranks[0] != ranks[1] and ranks[0::2] == [ranks[0]] * 2 and ranks[1::2] == [ranks[1]] * 2
    await assert_settles_to_zero(rr)


async def test_routed_rank_with_handshake_before_prefill(rr: PrefillProc, decode: FakeDecode) -> None:
    ids = prompt(11, seed=7)
    resp, r = await run_one(rr, decode, ids, SamplingParams(), query=False, routed=1, handshake_first=True)
    assert resp.dp_rank == 1
    _, _, tok = reference_prefill(CONFIG, ids, SamplingParams())
    assert decode.row(r).output_id == tok.token_id
    decode.free(r)
    await assert_settles_to_zero(rr)


async def test_a_repeated_prefix_is_reused_and_lands_bit_exact(rr: PrefillProc, follow: PrefillProc, decode: FakeDecode) -> None:
    """Pages of 4, chunks of 6: the second run of a 23-token prompt reuses its first 5
    pages (the 6th holds the last token, which is always computed) and computes from
    token 20; a longer prompt with the same start reuses them too. Every run's KV and
    row equal a cold local prefill; with --no-prefix-cache (``follow``) nothing is reused."""
    ids = prompt(23, seed=4242)
    sampling = SamplingParams(temperature=0.8, seed=99, top_logprobs=3)
    for run, expect in ((ids, 0), (ids, 20), (ids + prompt(9, seed=4343), 20)):
        resp, r = await run_one(rr, decode, run, sampling, query=False, routed=0)
        assert resp.cached_tokens == expect
        assert_landed_bit_exact(decode, r, run, sampling)
        decode.free(r)
        await assert_settles_to_zero(rr)  # the room ended: its full pages are cached
    for _ in range(3):  # over 2 dp ranks (room % 2): one rank runs it twice
        resp, r = await run_one(follow, decode, ids, sampling, query=False)
        assert resp.cached_tokens == 0
        assert_landed_bit_exact(decode, r, ids, sampling)
        decode.free(r)
        await assert_settles_to_zero(follow)


async def test_concurrent_requests_all_succeed(rr: PrefillProc, decode: FakeDecode, rr_outcomes: Outcomes) -> None:
    lens = [1, 4, 9, 16, 21, 2, 13, 7]
    results = await asyncio.gather(*(run_one(rr, decode, prompt(n, seed=100 + n), SamplingParams(), query=True) for n in lens))
    for n, (resp, r) in zip(lens, results):
        _, _, tok = reference_prefill(CONFIG, prompt(n, seed=100 + n), SamplingParams())
        assert resp.prompt_tokens == n and decode.row(r).output_id == tok.token_id
        decode.free(r)
    await assert_settles_to_zero(rr)
    # round_robin: every room was registered with the embedded bootstrap before it ran.
    assert await rr_outcomes.changed() == {"finished": len(lens), "registered": len(lens)}
    for worker in rr.metrics[1:]:  # type: ignore[attr-defined]
        s = scrape(worker)
        assert s.value("pdgrpc_kv_pages_in_use", role="prefill") == 0
        assert s.value("pdgrpc_active_requests", role="prefill") == 0


async def test_prompt_too_long_is_invalid_argument(rr: PrefillProc, rr_outcomes: Outcomes) -> None:
    ch, stub = await prefill_stub(rr)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.Prefill(request(new_room(), prompt(CONFIG.max_prompt_tokens + 1, 1)), timeout=30)
        assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "max_prompt_tokens=64" in ei.value.details() and "65 tokens" in ei.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.Prefill(request(new_room(), [256, 999]), timeout=30)
        assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "input_ids[1] = 999" in ei.value.details()
    finally:
        await ch.close()
    await assert_settles_to_zero(rr)
    assert await rr_outcomes.changed() == {"refused": 2, "registered": 2}


async def test_no_handshake_is_deadline_exceeded_and_frees_pages(rr: PrefillProc, rr_outcomes: Outcomes) -> None:
    ch, stub = await prefill_stub(rr)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.Prefill(request(new_room(), prompt(30, 3)), timeout=60)
        assert ei.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert f"no decode handshake within {HANDSHAKE_TIMEOUT} s" in ei.value.details()
    finally:
        await ch.close()
    await assert_settles_to_zero(rr)
    assert await rr_outcomes.changed() == {"aborted": 1, "aborted:bootstrap_timeout": 1, "registered": 1}


async def test_abort_room_stops_the_request(rr: PrefillProc, decode: FakeDecode, rr_outcomes: Outcomes) -> None:
    room = new_room()
    ch, stub = await prefill_stub(rr)
    try:
        call = asyncio.ensure_future(stub.Prefill(request(room, prompt(20, 4), routed=0), timeout=60))
        (w,) = await decode.workers(rr.bootstrap, 0)
        hs = decode.stub(w.transfer_address)
        # Wait until the worker holds the request (its pages show up in the stats).
        await eventually_async(lambda: active_requests(stub), SETTLE_S, what="the worker holds the request")
        ans = await hs.AbortRoom(abort_request(room, "client cancelled"), timeout=30)
        assert ans.was_active
        # AbortRoom returned: the request is over, nothing of it is held any more.
        s = (await stub.GetStats(prefill_pb2.GetStatsRequest())).stats
        assert (s.active_requests, s.pages_in_use) == (0, 0)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await call
        assert ei.value.code() is grpc.StatusCode.ABORTED and "client cancelled" in ei.value.details()
        # Decode gives up before the Prefill RPC arrives: the late Prefill fails at once.
        late = new_room()
        unknown = await hs.AbortRoom(abort_request(late, "decode timed out"), timeout=30)
        assert not unknown.was_active
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.Prefill(request(late, prompt(5, 4), routed=0), timeout=HANDSHAKE_TIMEOUT / 2)
        assert ei.value.code() is grpc.StatusCode.ABORTED and "decode timed out" in ei.value.details()
    finally:
        await ch.close()
    await assert_settles_to_zero(rr)
    # Both ended because the decode said so (AbortRoom during the run, and before it).
    assert await rr_outcomes.changed() == {"aborted": 2, "aborted:decode_error": 2, "registered": 2}


@pytest.mark.parametrize(
    "override, needle",
    [
        ({"compatibility_hash": b"\x01" * 32}, "compatibility_hash mismatch: decode has 0x0101"),
        ({"transport": "fake"}, "transport mismatch: decode uses 'fake', this prefill worker uses 'tcp'"),
    ],
    ids=["compat-hash", "transport"],
)
async def test_incompatible_handshake_fails_both_rpcs(
    rr: PrefillProc, decode: FakeDecode, override: dict, needle: str, rr_outcomes: Outcomes
) -> None:
    room = new_room()
    ids = prompt(9, 5)
    r = decode.allocate(room, len(ids))
    ch, stub = await prefill_stub(rr)
    try:
        call = asyncio.ensure_future(stub.Prefill(request(room, ids, routed=1), timeout=60))
        (w,) = await decode.workers(rr.bootstrap, 1)
        # A refused handshake is not stored: it fails a Prefill RPC that already holds the room.
        await eventually_async(lambda: active_requests(stub), 15, what="the request reached worker dp1")
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await decode.handshake(w.transfer_address, r, **override)
        assert ei.value.code() is grpc.StatusCode.FAILED_PRECONDITION and needle in ei.value.details()
        if "compat" in needle:  # both values are named, and the model this prefill serves
            assert compat_hash_bytes(decode.engine).hex() in ei.value.details()
            assert f"serving {decode.engine.model_id}" in ei.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as ei2:
            await call
        assert ei2.value.code() is grpc.StatusCode.FAILED_PRECONDITION and needle in ei2.value.details()
    finally:
        await ch.close()
    assert decode.transport.poll(room) is KVPoll.WAITING_FOR_INPUT  # nothing was written
    decode.free(r)
    await assert_settles_to_zero(rr)
    assert await rr_outcomes.changed() == {"aborted": 1, "aborted:decode_error": 1, "registered": 1}


async def test_follow_bootstrap_room_needs_no_registration(follow: PrefillProc, decode: FakeDecode) -> None:
    info = (await decode.bootstrap_stub(follow.bootstrap).GetParallelInfo(bpb.GetParallelInfoRequest(), timeout=5)).parallel_info
    assert info.load_balance_method == bpb.LOAD_BALANCE_METHOD_FOLLOW_BOOTSTRAP_ROOM and info.dp_size == 2
    for seed in range(3):
        resp, r = await run_one(follow, decode, prompt(6, seed), SamplingParams(), query=False)
        assert resp.dp_rank == r.room % 2
        assert not await decode.registered(follow.bootstrap, r.room)  # fast path: nothing registered
        decode.free(r)
    await assert_settles_to_zero(follow)


async def test_follow_bootstrap_room_conflict_is_failed_precondition(follow: PrefillProc, decode: FakeDecode) -> None:
    room = new_room()
    ch, stub = await prefill_stub(follow)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.Prefill(request(room, prompt(5, 1), routed=(room + 1) % 2), timeout=30)
        assert ei.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "follow_bootstrap_room" in ei.value.details() and f"rank {room % 2}" in ei.value.details()
    finally:
        await ch.close()
    # A routed rank that agrees with room % dp_size is fine.
    resp, r = await run_one(follow, decode, prompt(5, 1), SamplingParams(), query=False, routed=None)
    decode.free(r)
    await assert_settles_to_zero(follow)


async def test_transfer_refused_by_the_decode_is_aborted_and_frees_everything(
    rr: PrefillProc, decode: FakeDecode, rr_outcomes: Outcomes
) -> None:
    """The decode never granted the room (no advertise): its receiver rejects the first
    write, and the prefill reports the transfer failure instead of hanging."""
    room = new_room()
    ids = prompt(19, 9)
    pages = decode.engine.alloc_pages(decode.engine.pages_needed(len(ids)))
    assert pages is not None
    r = Room(room, pages, slot=0)  # not advertised
    ch, stub = await prefill_stub(rr)
    try:
        call = asyncio.ensure_future(stub.Prefill(request(room, ids, routed=0), timeout=60))
        (w,) = await decode.workers(rr.bootstrap, 0)
        await decode.handshake(w.transfer_address, r)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await call
        assert ei.value.code() is grpc.StatusCode.ABORTED and "transfer failed" in ei.value.details()
    finally:
        await ch.close()
    assert decode.rows.room(0) == 0  # no metadata row landed
    decode.engine.free_pages(pages)
    await assert_settles_to_zero(rr)
    # The decode's receiver rejected the write (outside any grant): counted as such.
    assert await rr_outcomes.changed() == {"aborted": 1, "aborted:rejected_write": 1, "registered": 1}


async def test_a_burst_larger_than_the_pool_waits_for_pages_instead_of_failing(rr: PrefillProc) -> None:
    """Twelve 64-token prompts pinned to one worker need 192 pages; it has 64. The later
    ones wait until earlier ones free theirs, and every one lands bit-exact. (Twelve, not
    eight: with eight, a fast worker could finish the first four before the last four
    arrived, and then nothing waited.)"""
    import dataclasses

    big = FakeDecode(dataclasses.replace(CONFIG, num_pages=256))
    await big.start()
    try:
        sampling = SamplingParams()
        ids = [prompt(CONFIG.max_prompt_tokens, 200 + i) for i in range(12)]
        results = await asyncio.gather(*(run_one(rr, big, x, sampling, query=False, routed=0) for x in ids))
        for x, (resp, r) in zip(ids, results):
            assert resp.dp_rank == 0
            assert_landed_bit_exact(big, r, x, sampling)
            big.free(r)
        rooms = {r.room for _, r in results}
        waited = set(int(m) for m in re.findall(r"room=(\d+) waiting for pages need=16", rr.log()))
        assert waited & rooms, "no request had to wait: the burst did not exceed the pool"
    finally:
        await big.close()
    await assert_settles_to_zero(rr)


@pytest.mark.parametrize(
    "override, needle",
    [
        # Audit: 20 M-page handshakes grew a worker by 535 MiB and blocked its loop.
        ({"dst_pages": [0] * 2_000_000}, "dst_pages: 2000000 pages, over the limit of 16 per handshake"),
        ({"dst_pages": [3, 5, 3]}, "dst_pages: page 3 appears more than once"),
        ({"transport_credential": b"short"}, "transport_credential: 5 bytes (want 32 or none)"),
        ({"cached_pages": 4}, "cached_pages: 4, more than the 3 pages of dst_pages"),
    ],
    ids=["too-many-pages", "duplicate-page", "bad-credential", "cached-past-the-pages"],
)
async def test_refused_handshake_is_not_stored_and_names_the_limit(
    rr: PrefillProc, decode: FakeDecode, override: dict, needle: str
) -> None:
    """A refused early handshake is not kept: the real decode's handshake for the same room
    is still accepted afterwards (audit: refused handshakes were stored, and their junk
    filled the mailbox and took the room's one handshake)."""
    ids = prompt(9, 7)
    room = new_room()
    r = decode.allocate(room, len(ids))
    (w,) = await decode.workers(rr.bootstrap, 1)
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await decode.handshake(w.transfer_address, r, **override)
    assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT and needle in ei.value.details(), ei.value.details()
    await decode.handshake(w.transfer_address, r)  # the real one: accepted
    ch, stub = await prefill_stub(rr)
    try:
        resp = await stub.Prefill(request(room, ids, routed=1), timeout=60)
    finally:
        await ch.close()
    assert resp.dp_rank == 1 and (await decode.wait(r)).state is KVPoll.SUCCESS
    decode.free(r)
    await assert_settles_to_zero(rr)


def test_fuzzed_requests_never_crash_the_prefill(rr: PrefillProc) -> None:
    """Fuzzing (issue 16): PrefillService and BootstrapService requests to the controller,
    HandshakeService and PrefillService requests to a worker, valid and mutated: no
    UNKNOWN or INTERNAL, still SERVING, and nothing held afterwards."""
    with grpc.insecure_channel(rr.address) as ch:
        fuzz(ch, ["pdgrpc.v1.PrefillService", "pdgrpc.v1.BootstrapService"], max_examples=30)
    with grpc.insecure_channel(rr.worker_addresses[0]) as ch:
        fuzz(ch, ["pdgrpc.v1.HandshakeService", "pdgrpc.v1.PrefillService"], max_examples=30)
    asyncio.run(assert_settles_to_zero(rr))
