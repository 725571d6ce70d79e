"""Issue 17: a room the prefill *controller* refuses, before any worker sees it, still
reaches its decode at once (pdgrpc.prefill.notices).

A real prefill process (dp 2, follow_bootstrap_room, tcp) and a fake decode. A routed
dp rank other than ``room % dp_size`` is refused by the controller (FAILED_PRECONDITION);
the decode, which handshakes with the routed rank, is told by that rank's worker
(Handshake ABORTED, WatchRoom FAILED) and by the bootstrap's failure record, each only
under the room's secret. And in-process: a notice under another secret leaves the real
decode's early handshake alone.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import AsyncIterator, Iterator

import grpc
import pytest

from pdgrpc.decode.prefills import PrefillDirectory
from pdgrpc.engine.reference import ReferenceEngine
from pdgrpc.prefill.errors import RequestFailed
from pdgrpc.prefill.worker import PrefillWorker, WorkerConfig
from pdgrpc.transport import registry
from pdgrpc.serving.room_proof import draw_secret, watch_proof
from pdgrpc.v1 import handshake_pb2 as hpb
from pdgrpc.v1 import handshake_pb2_grpc as hpb_grpc
from tests.prefill.fake_decode import FakeDecode, KVPoll, room_secret
from tests.prefill.harness import CONFIG, assert_settles_to_zero, new_room, prefill_stub, prompt, request
from tests.prefill.procs import ENGINE_FLAGS, PrefillProc

pytestmark = pytest.mark.timeout(120)

FLAGS = [*ENGINE_FLAGS, "--transport", "tcp", "--dp-size", "2", "--load-balance-method", "follow_bootstrap_room"]


@pytest.fixture(scope="module")
def prefill(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefillProc]:
    p = PrefillProc(FLAGS, Path(tmp_path_factory.mktemp("refusals")), "refusals")
    try:
        yield p
    finally:
        assert p.stop() == 0, p.log()[-3000:]


@pytest.fixture
async def decode() -> AsyncIterator[FakeDecode]:
    d = FakeDecode(CONFIG, "tcp")
    await d.start()
    try:
        yield d
    finally:
        await d.close()


async def test_a_refused_room_fails_its_decodes_handshake_and_watch_at_once(prefill: PrefillProc, decode: FakeDecode) -> None:
    room = new_room()
    other = (room % 2) ^ 1  # not room % dp_size: the controller refuses the route
    ids = prompt(9, 3)
    worker = prefill.worker_addresses[other]
    early = decode.allocate(room, len(ids))
    await decode.handshake(worker, early)  # the decode was quicker than the prefill leg
    wch = grpc.aio.insecure_channel(worker)
    stub = hpb_grpc.HandshakeServiceStub(wch)
    watch = asyncio.ensure_future(
        stub.WatchRoom(hpb.WatchRoomRequest(bootstrap_room=room, max_wait_ms=10_000, room_proof=watch_proof(room_secret(room), room)), timeout=20)
    )
    ch, prefills = await prefill_stub(prefill)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await prefills.Prefill(request(room, ids, routed=other), timeout=30)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.value.details()
    finally:
        await ch.close()
    # The held watch answers now, with the controller's status.
    answer = await asyncio.wait_for(watch, 5)
    assert answer.outcome == hpb.ROOM_OUTCOME_FAILED and answer.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert "follow_bootstrap_room" in answer.reason
    # A handshake for the room (a retry, another decode tp rank) is refused with ABORTED.
    with pytest.raises(grpc.aio.AioRpcError) as aborted:
        await decode.handshake(worker, early)
    assert aborted.value.code() == grpc.StatusCode.ABORTED and "follow_bootstrap_room" in aborted.value.details()
    # Without the room's secret, the worker tells nothing.
    with pytest.raises(grpc.aio.AioRpcError) as denied:
        await stub.WatchRoom(hpb.WatchRoomRequest(bootstrap_room=room, room_proof=watch_proof(draw_secret(), room)), timeout=5)
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    await wch.close()
    # The bootstrap holds the record too, found only under the room's secret.
    directory = PrefillDirectory()
    (failure, never_forwarded) = (await directory.room_failures(prefill.bootstrap, {room: room_secret(room)}))[room]
    assert never_forwarded and failure.code == grpc.StatusCode.FAILED_PRECONDITION
    assert await directory.room_failures(prefill.bootstrap, {room: draw_secret()}) == {}
    decode.free(early)
    await assert_settles_to_zero(prefill)


async def test_a_notice_under_another_secret_leaves_the_real_decodes_handshake(decode: FakeDecode) -> None:
    """A worker told that the controller refused a room under *another* secret (a caller
    that sent a Prefill for a room it does not own) keeps the real decode's early
    handshake, and the real Prefill lands; a notice under the room's own secret drops it
    and refuses the handshake from then on."""
    w = PrefillWorker(ReferenceEngine(CONFIG), registry.create("tcp"), WorkerConfig(handshake_timeout_s=3.0))
    await w.start()
    try:
        ids, room = prompt(9, 4), new_room()
        real = decode.allocate(room, len(ids))
        w.handshake(decode.handshake_request(real))  # before its Prefill, signed under the room's secret
        w.refused_by_controller(room, grpc.StatusCode.FAILED_PRECONDITION, "someone else's refusal", draw_secret())
        await w.prefill(request(room, ids))
        assert (await decode.wait(real, 30)).state is KVPoll.SUCCESS
        decode.free(real)

        other = new_room()
        told = decode.allocate(other, len(ids))
        w.handshake(decode.handshake_request(told))
        w.refused_by_controller(other, grpc.StatusCode.UNAVAILABLE, "no live prefill worker", room_secret(other))
        with pytest.raises(RequestFailed) as refused:
            w.handshake(decode.handshake_request(told))
        assert refused.value.code == grpc.StatusCode.ABORTED and "no live prefill worker" in refused.value.message
        decode.free(told)
        assert w.stats().active_requests == 0 and w.stats().pages_in_use == 0
    finally:
        await w.close()
