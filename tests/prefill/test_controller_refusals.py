"""A room whose prefill fails reaches its decode's held watch on the prefill's bootstrap
at once (pdgrpc.prefill.notices), whether the controller refused it or a worker failed it.

A real prefill process (dp 2, follow_bootstrap_room, tcp) and a fake decode. A routed
dp rank other than ``room % dp_size`` is refused by the controller (FAILED_PRECONDITION);
a prompt with a token id outside the vocabulary is refused by the worker. The record is
found only under the room's secret.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import AsyncIterator, Iterator

import grpc
import pytest

from pdgrpc.decode.prefills import PrefillDirectory
from pdgrpc.prefill.errors import RequestFailed
from pdgrpc.serving.room_proof import draw_secret
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


async def _held_watch(prefill: PrefillProc, room: int) -> "asyncio.Future[dict[int, tuple[RequestFailed, bool]] | None]":
    """The decode's held QueryRoomFailures for ``room``, started now."""
    directory = PrefillDirectory()
    watch = asyncio.ensure_future(directory.room_failures(prefill.bootstrap, {room: room_secret(room)}, wait_s=10.0))
    await asyncio.sleep(0.2)
    assert not watch.done(), "the watch must be held while the room has no record"
    return watch


async def test_a_refused_room_answers_its_decodes_held_watch_at_once(prefill: PrefillProc, decode: FakeDecode) -> None:
    room = new_room()
    other = (room % 2) ^ 1  # not room % dp_size: the controller refuses the route
    ids = prompt(9, 3)
    early = decode.allocate(room, len(ids))
    await decode.handshake(prefill.worker_addresses[other], early)  # the decode was quicker than the prefill leg
    watch = await _held_watch(prefill, room)
    ch, prefills = await prefill_stub(prefill)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await prefills.Prefill(request(room, ids, routed=other), timeout=30)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.value.details()
    finally:
        await ch.close()
    # The held watch answers now, with the controller's status.
    found = await asyncio.wait_for(watch, 5)
    assert found is not None
    failure, never_forwarded = found[room]
    assert never_forwarded and failure.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "follow_bootstrap_room" in failure.message
    # Found only under the room's secret.
    assert await PrefillDirectory().room_failures(prefill.bootstrap, {room: draw_secret()}) == {}
    decode.free(early)
    await assert_settles_to_zero(prefill)


async def test_a_room_that_fails_on_a_worker_answers_its_decodes_held_watch(prefill: PrefillProc, decode: FakeDecode) -> None:
    """The controller records a worker's failure too: the decode learns of every failure
    from the bootstrap, and the record says a worker got the request."""
    room = new_room()
    ids = prompt(9, 3)
    early = decode.allocate(room, len(ids))
    await decode.handshake(prefill.worker_addresses[room % 2], early)
    watch = await _held_watch(prefill, room)
    bad = request(room, ids)
    bad.input_ids.append(10**6)  # not a token id: the worker refuses it
    ch, prefills = await prefill_stub(prefill)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await prefills.Prefill(bad, timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    finally:
        await ch.close()
    found = await asyncio.wait_for(watch, 5)
    assert found is not None
    failure, never_forwarded = found[room]
    assert not never_forwarded and failure.code == grpc.StatusCode.INVALID_ARGUMENT
    decode.free(early)
    await assert_settles_to_zero(prefill)
