"""One room driven in-process: a PrefillWorker and a fake decode with real tcp transports
in the test's loop, no processes. The worker carries out what the room's sender decides
and enforces the sender's deadlines."""

from __future__ import annotations

import time
from typing import AsyncIterator

import grpc
import pytest

from pdgrpc.engine.base import PrefillRequest, SampledToken, SamplingParams
from pdgrpc.engine.reference import ReferenceEngine
from pdgrpc.prefill.compute_thread import ThreadCompute
from pdgrpc.prefill.errors import RequestFailed
from pdgrpc.prefill.worker import PrefillWorker, WorkerConfig
from pdgrpc.state.outcomes import AbortReason
from pdgrpc.transport import registry
from tests.prefill.fake_decode import FakeDecode, KVPoll
from tests.prefill.harness import CONFIG, assert_landed_bit_exact, new_room, prompt, request

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def decode() -> AsyncIterator[FakeDecode]:
    d = FakeDecode(CONFIG, "tcp")
    await d.start()
    try:
        yield d
    finally:
        await d.close()


async def _worker(**config: object) -> PrefillWorker:
    w = PrefillWorker(ReferenceEngine(CONFIG), registry.create("tcp"), WorkerConfig(**config))  # type: ignore[arg-type]
    await w.start()
    return w


def _held(w: PrefillWorker) -> tuple[int, int, int]:
    s = w.stats()
    return s.active_requests, s.pages_in_use, s.transport_rooms


@pytest.mark.parametrize("min_write_bytes", [0, 1 << 30], ids=["write-each-chunk", "one-final-write"])
async def test_the_prompt_lands_bit_exact_whatever_the_write_batching(decode: FakeDecode, min_write_bytes: int) -> None:
    w = await _worker(chunk_size=6, min_write_bytes=min_write_bytes)
    try:
        ids, room = prompt(30, 5), new_room()
        r = decode.allocate(room, len(ids))
        w.handshake(decode.handshake_request(r))
        resp = await w.prefill(request(room, ids))
        assert (await decode.wait(r)).state is KVPoll.SUCCESS
        assert_landed_bit_exact(decode, r, ids, SamplingParams())
        assert resp.prompt_tokens == 30 and resp.bytes_transferred > 0
        assert _held(w) == (0, 0, 0)
    finally:
        await w.close()


async def test_a_compute_slower_than_its_deadline_fails_the_room_and_frees_it(decode: FakeDecode) -> None:
    w = await _worker(chunk_size=6, compute_timeout_s=0.5)
    compute = w.compute
    assert isinstance(compute, ThreadCompute)
    real = compute.compute_chunk

    def slow(room: int, req: PrefillRequest, start: int, end: int) -> tuple[SampledToken | None, float]:
        time.sleep(1.0)  # on the compute thread: the loop stays free to see the deadline pass
        return real(room, req, start, end)

    compute.compute_chunk = slow  # type: ignore[method-assign]
    try:
        ids, room = prompt(30, 6), new_room()
        r = decode.allocate(room, len(ids))
        w.handshake(decode.handshake_request(r))
        t = time.monotonic()
        with pytest.raises(RequestFailed) as ei:
            await w.prefill(request(room, ids))
        assert ei.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
        assert "no prefill chunk computed within 0.5 s" in ei.value.message
        assert ei.value.reason is AbortReason.WAITING_FOR_INPUT_TIMEOUT
        # failed at the deadline, then waited only for the chunk in flight (not the prompt)
        assert time.monotonic() - t < 2.5
        assert _held(w) == (0, 0, 0)
    finally:
        await w.close()


async def test_no_handshake_fails_at_the_senders_deadline(decode: FakeDecode) -> None:
    w = await _worker(handshake_timeout_s=0.3)
    try:
        with pytest.raises(RequestFailed) as ei:
            await w.prefill(request(new_room(), prompt(10, 7)))
        assert ei.value.code is grpc.StatusCode.DEADLINE_EXCEEDED and ei.value.reason is AbortReason.BOOTSTRAP_TIMEOUT
        assert "no decode handshake within 0.3 s" in ei.value.message
        assert _held(w) == (0, 0, 0)
    finally:
        await w.close()


async def test_a_chunk_is_sent_only_once_the_device_finished_writing_it(decode: FakeDecode) -> None:
    """The engine's chunk-ready signal (a CUDA event on a GPU) gates every write: while it
    is unresolved nothing is sent, yet the event loop stays free; once it resolves the
    prompt lands whole."""
    import asyncio
    import threading

    from pdgrpc.device import ChunkReady, poll_until

    device_done = threading.Event()

    class Pending(ChunkReady):
        def done(self) -> bool:
            return device_done.is_set()

        async def wait(self) -> None:
            await poll_until(self.done)

    class GpuLike(ReferenceEngine):
        def chunk_ready(self) -> ChunkReady:
            return Pending()

    w = PrefillWorker(GpuLike(CONFIG), registry.create("tcp"), WorkerConfig(chunk_size=6, min_write_bytes=0))
    await w.start()
    writes = 0
    real_write = w.transport.write

    async def counting_write(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal writes
        writes += 1
        return await real_write(*args, **kwargs)

    w.transport.write = counting_write  # type: ignore[method-assign]
    try:
        ids, room = prompt(30, 8), new_room()
        r = decode.allocate(room, len(ids))
        w.handshake(decode.handshake_request(r))
        task = asyncio.create_task(w.prefill(request(room, ids)))
        await asyncio.sleep(0.5)  # every chunk computed by now; the loop kept running meanwhile
        assert writes == 0 and not task.done()
        device_done.set()
        resp = await asyncio.wait_for(task, 30)
        assert writes >= 1 and resp.prompt_tokens == 30
        assert (await decode.wait(r)).state is KVPoll.SUCCESS
        assert_landed_bit_exact(decode, r, ids, SamplingParams())
    finally:
        await w.close()


async def test_forged_early_handshakes_for_one_room_count_against_their_peers_quota(decode: FakeDecode) -> None:
    """Audit: the early-handshake caps counted rooms, so one peer could keep any number of
    handshakes (and AbortRoom tombstones) for one room, each with another made-up
    ``room_proof``, until the room's Prefill came or its TTL passed. Each one now counts
    against its sender's quota: past it, RESOURCE_EXHAUSTED naming the limit; the real
    decode's handshake still gets in, and the room lands exact."""
    import secrets

    w = await _worker(early_handshakes_per_peer=4, early_handshakes=16)
    try:
        ids, room = prompt(20, 9), new_room()
        r = decode.allocate(room, len(ids))
        for _ in range(4):
            w.handshake(decode.handshake_request(r, room_proof=secrets.token_bytes(32)), "mallory")
        for _ in range(8):  # tombstones are held the same way: refused silently past the quota
            await w.abort_room(room, "forged", secrets.token_bytes(32), "mallory")
        with pytest.raises(RequestFailed) as ei:
            w.handshake(decode.handshake_request(r, room_proof=secrets.token_bytes(32)), "mallory")
        assert ei.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limit 4 per peer" in ei.value.message
        w.handshake(decode.handshake_request(r), "decode")  # the real one: another peer's quota
        await w.prefill(request(room, ids))
        assert (await decode.wait(r)).state is KVPoll.SUCCESS
        assert_landed_bit_exact(decode, r, ids, SamplingParams())
        assert _held(w) == (0, 0, 0)
    finally:
        await w.close()


async def test_early_handshakes_are_bounded_in_bytes_per_peer_and_abort_reasons_in_length(decode: FakeDecode) -> None:
    """Audit: an early handshake keeps its transport_descriptor (a valid one may carry any
    padding, up to the 8 MiB message limit) twice, and an early AbortRoom its reason, so
    one decode credential's 1024 early handshakes held about 20 GB of a worker's memory.
    A peer's early handshakes are capped in bytes too (RESOURCE_EXHAUSTED naming the
    limit), and an AbortRoom reason over 1024 characters is refused naming the field;
    the real decode's handshake still gets in, and the room lands exact."""
    import json
    import secrets

    w = await _worker(early_handshake_bytes_per_peer=1 << 20)
    try:
        doc = json.loads(decode.descriptor[4:])
        doc["padding"] = "x" * (150 << 10)  # each handshake holds it twice: three fit in 1 MiB
        padded = b"PDGT" + json.dumps(doc).encode()
        for _ in range(3):
            r = decode.allocate(new_room(), 4)
            w.handshake(decode.handshake_request(r, transport_descriptor=padded), "mallory")
        with pytest.raises(RequestFailed) as ei:
            w.handshake(decode.handshake_request(decode.allocate(new_room(), 4), transport_descriptor=padded), "mallory")
        assert ei.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limit 1048576 bytes per peer" in ei.value.message
        ids, room = prompt(20, 10), new_room()
        with pytest.raises(RequestFailed) as ei:
            await w.abort_room(room, "x" * 1025, secrets.token_bytes(32), "mallory")
        assert ei.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert "reason: 1025 characters, over the limit of 1024" in ei.value.message
        r = decode.allocate(room, len(ids))
        w.handshake(decode.handshake_request(r), "decode")
        await w.prefill(request(room, ids))
        assert (await decode.wait(r)).state is KVPoll.SUCCESS
        assert_landed_bit_exact(decode, r, ids, SamplingParams())
    finally:
        await w.close()
