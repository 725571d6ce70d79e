"""Issue 17: a room the prefill *controller* refuses, before any worker sees it, still
reaches its decode at once (pdgrpc.prefill.notices).

A real prefill process (dp 2, follow_bootstrap_room, tcp) and a fake decode. A routed
dp rank other than ``room % dp_size`` is refused by the controller (FAILED_PRECONDITION);
the decode, which handshakes with the routed rank, is told by that rank's worker
(Handshake ABORTED, WatchRoom FAILED) and by the bootstrap's failure record, each only
under the room's secret.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import AsyncIterator, Iterator

import grpc
import pytest

from pdgrpc.decode.prefills import PrefillDirectory
from pdgrpc.serving.room_proof import draw_secret, watch_proof
from pdgrpc.v1 import handshake_pb2 as hpb
from pdgrpc.v1 import handshake_pb2_grpc as hpb_grpc
from tests.prefill.fake_decode import FakeDecode, room_secret
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


async def test_a_refusal_of_another_requests_room_leaves_the_real_one_alone(prefill: PrefillProc, decode: FakeDecode) -> None:
    """A caller that refuses itself a room it does not own (its own secret) neither drops
    the real decode's early handshake nor fails the real room."""
    room = new_room()
    ids = prompt(9, 4)
    rank = room % 2
    worker = prefill.worker_addresses[rank]
    real = decode.allocate(room, len(ids))
    await decode.handshake(worker, real)
    ch, prefills = await prefill_stub(prefill)
    try:
        forged = request(room, ids, routed=rank ^ 1)
        forged.room_secret = draw_secret()
        with pytest.raises(grpc.aio.AioRpcError):
            await prefills.Prefill(forged, timeout=30)
        # The real request (its route agrees) still finds its handshake and lands.
        reply = await prefills.Prefill(request(room, ids), timeout=60)
        assert reply.dp_rank == rank
    finally:
        await ch.close()
    assert (await decode.wait(real, 30)).state.name == "SUCCESS"
    decode.free(real)
    await assert_settles_to_zero(prefill)
