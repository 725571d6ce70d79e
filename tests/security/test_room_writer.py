"""A room belongs to the writer its handshake went to.

A real ``python -m pdgrpc.decode`` process on 127.0.0.1 (tcp data plane) serves a
victim's request whose prefill is a fake one (real bootstrap, handshake service and tcp
transport, KV from a local reference engine). An attacker that may call ``Decode``
names its own fake prefill and so obtains a genuine data-plane credential for its own
worker. With the victim's room and slot (which the decode logs), it then writes a
metadata row into the victim's room. The decode refuses that row with no effect on the
victim, counts it, and answers it exactly as it answers a room that does not exist.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator

import grpc
import pytest

from pdgrpc.engine.base import PrefillRequest, SamplingParams
from pdgrpc.engine.colocated import generate
from pdgrpc.engine.reference import ReferenceEngine
from pdgrpc.errors import Refusal, UnauthorizedWrite
from pdgrpc.kvpoll import KVPoll
from pdgrpc.serving.metadata import metadata_layout, row_from_token
from pdgrpc.state.metadata import MetadataBuffers
from pdgrpc.transport.pages import METADATA_REGION_ID, metadata_op
from pdgrpc.transport.receiver import Receiver, RoomGrant
from pdgrpc.transport.regions import RegionInfo, RegionKind
from pdgrpc.transport.rooms import RoomStates
from pdgrpc.v1 import decode_pb2_grpc
from tests.decode.fake_prefill import FakePrefill, FakeWorker
from tests.decode.test_decode_server import (  # noqa: F401  (module-scoped fixtures for this module's decode)
    assert_nothing_held, collect, engine, make_request, metrics_address, stub,
)
from tests.scrape import scrape


@pytest.fixture
async def victim(engine: ReferenceEngine) -> AsyncIterator[FakePrefill]:
    p = await FakePrefill(engine).start()
    try:
        yield p
    finally:
        await p.stop()


@pytest.fixture
async def attacker(engine: ReferenceEngine) -> AsyncIterator[FakePrefill]:
    p = await FakePrefill(engine).start()
    p.mode = "hold"  # accepts its own handshake (and so holds a credential), writes nothing itself
    try:
        yield p
    finally:
        await p.stop()


async def _forge_row(worker: FakeWorker, descriptor: bytes, room: int, slot: int, token_id: int) -> tuple[KVPoll, Refusal | None, str]:
    """Write, from ``worker``'s proven connection, a metadata row naming ``room`` into
    ``slot`` with first token ``token_id``; the sender's final view of that room."""
    engine = worker.owner.engine
    peer = await worker.transport.connect(descriptor)
    first = engine.prefill_chunk(PrefillRequest((1, 2, 3), tuple(engine.alloc_pages(1) or ()), SamplingParams()), 0, 3)
    assert first is not None
    row = dataclasses.replace(row_from_token(first), output_id=token_id, output_token_logprob_index=token_id)
    send = MetadataBuffers(1, metadata_layout())
    send.write_row(0, row, room)
    src = worker.regions[-1]  # the worker's own send rows; a holding worker uses none of them
    src.tensor[-1].copy_(send.tensor[0])
    meta = metadata_op(src, src.tensor.shape[0] - 1, peer.descriptor.region(METADATA_REGION_ID), slot)
    try:
        await worker.transport.write(peer, room, [], metadata=meta)
        st = await worker.transport.wait(room, 10.0)
    finally:
        worker.transport.release(room)
    return st.state, st.refusal, st.reason or ""


def _foreign_writes(address: str) -> float:
    return scrape(address).value("pdgrpc_transport_foreign_writes_total", role="decode")


async def test_a_proven_writer_cannot_write_into_another_writers_room(
    stub: decode_pb2_grpc.DecodeServiceStub, victim: FakePrefill, attacker: FakePrefill, metrics_address: str,
) -> None:
    # The attacker's own request: its worker gets a genuine credential for this decode.
    mine = make_request(attacker, "my own request", 4)
    my_call = stub.Decode(mine, timeout=60)
    aw = attacker.workers[0]
    await asyncio.wait_for(aw.got_handshake.wait(), 10)
    descriptor = aw.handshakes[0].transport_descriptor
    assert aw.handshakes[0].transport_credential

    # The victim's request; its prefill writes 2 s after the handshake.
    victim.send_delay_s = 2.0
    req = make_request(victim, "The victim's prompt, with its own answer", 6)
    want = generate(victim.engine, [tuple(req.input_ids)], 6, SamplingParams())[0]
    forged = (want.token_ids[0] + 1) % victim.engine.tokenizer.vocab_size
    call = asyncio.ensure_future(collect(stub, req))
    await asyncio.wait_for(victim.workers[0].got_handshake.wait(), 10)
    slot = victim.workers[0].handshakes[0].dst_slot
    before = await asyncio.to_thread(_foreign_writes, metrics_address)

    state, refusal, reason = await _forge_row(aw, descriptor, req.bootstrap_room, slot, forged)
    # The same answer as for a room nobody advertised: nothing to learn by probing.
    nobody = req.bootstrap_room + 2**40
    n_state, n_refusal, n_reason = await _forge_row(aw, descriptor, nobody, slot, forged)
    assert (state, refusal) == (n_state, n_refusal) == (KVPoll.FAILED, Refusal.UNKNOWN_ROOM)
    assert reason.replace(str(req.bootstrap_room), "R") == n_reason.replace(str(nobody), "R")

    msgs = await asyncio.wait_for(call, 60)
    assert [t for m in msgs for t in m.token_ids] == list(want.token_ids)  # the victim's own tokens, not the forgery
    assert await asyncio.to_thread(_foreign_writes, metrics_address) == before + 1

    my_call.cancel()
    await assert_nothing_held(stub)



# -- the receiver core (every byte-moving backend drives it) --------------------------------
PAGE = 64


def _receiver() -> Receiver:
    r = Receiver(RoomStates())
    r.add_region(RegionInfo(0, "k0", RegionKind.KV, 4 * PAGE, PAGE))
    r.add_region(RegionInfo(METADATA_REGION_ID, "meta", RegionKind.METADATA, 4 * 32, 32))
    return r


def _refusal(r: Receiver, room: int, writer: str) -> tuple[Refusal, str]:
    with pytest.raises(UnauthorizedWrite) as err:
        r.accept(room, writer, [0], [PAGE], [PAGE])
    return err.value.refusal, str(err.value).replace(str(room), "R")


def test_a_bound_room_admits_only_its_writers_and_says_nothing_to_others() -> None:
    r = _receiver()
    r.advertise(RoomGrant.of(5, [1], slot=0, bound=True))
    nobody = _refusal(r, 6, "thief")
    assert _refusal(r, 5, "real") == nobody  # bound to nobody yet: nobody writes
    r.writers.bind(5, "real")
    assert _refusal(r, 5, "thief") == nobody
    assert r.rooms.status(5).state is KVPoll.WAITING_FOR_INPUT  # the refusals changed nothing
    r.accept(5, "real", [0], [PAGE], [PAGE])
    assert r.rooms.status(5).state is KVPoll.TRANSFERRING
    # Once released, its own writer learns why; another writer reads what any room reads.
    r.rooms.note_release(5, "the decode aborted it")
    r.release(5)
    assert "the decode aborted it" in _refusal(r, 5, "real")[1]
    assert _refusal(r, 5, "thief") == nobody
    assert r.writers.foreign == 3
