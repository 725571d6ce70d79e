"""Issue 16, forged output: a Handshake or AbortRoom from anyone but the decode the router
chose is refused, and cannot displace or block the real one.

A real prefill process (dp 1, tcp) and two fake decodes with real tcp receivers: the
victim (knows the room's secret, as the router's chosen decode does) and an attacker
that knows the room (rooms travel in handshakes and logs) but not its secret.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import AsyncIterator, Iterator

import grpc
import pytest

from pdgrpc.engine.base import SamplingParams
from pdgrpc.serving.room_proof import abort_proof, draw_secret, handshake_proof
from pdgrpc.v1 import handshake_pb2 as hpb
from pdgrpc.v1 import prefill_pb2_grpc
from tests.eventually import eventually_async
from tests.prefill.fake_decode import FakeDecode, KVPoll, Room
from tests.prefill.harness import (
    CONFIG, active_requests, assert_landed_bit_exact, assert_settles_to_zero, new_room, prefill_stub, prompt, request, run_one,
)
from tests.prefill.procs import ENGINE_FLAGS, PrefillProc

pytestmark = pytest.mark.timeout(180)

FLAGS = [*ENGINE_FLAGS, "--transport", "tcp", "--dp-size", "1", "--handshake-timeout", "20", "--log-level", "info"]
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def prefill(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefillProc]:
    p = PrefillProc(FLAGS, Path(tmp_path_factory.mktemp("binding")), "binding")
    try:
        yield p
    finally:
        assert p.stop() == 0, p.log()[-3000:]


@pytest.fixture
async def decodes() -> AsyncIterator[tuple[FakeDecode, FakeDecode]]:
    victim, attacker = FakeDecode(CONFIG, "tcp"), FakeDecode(CONFIG, "tcp")
    await victim.start()
    await attacker.start()
    try:
        yield victim, attacker
    finally:
        await victim.close()
        await attacker.close()


def signed(d: FakeDecode, r: Room, secret: bytes) -> hpb.HandshakeRequest:
    """``r``'s handshake signed under ``secret`` (its stub adds the credential and signs
    again, as decode signs after adding it)."""
    d.secrets[r.room] = secret
    req = d.handshake_request(r, room_proof=b"")
    req.room_proof = handshake_proof(secret, req)
    return req


async def test_forged_handshake_neither_steals_kv_nor_blocks_the_real_decode(
    prefill: PrefillProc, decodes: tuple[FakeDecode, FakeDecode]
) -> None:
    victim, attacker = decodes
    ids = prompt(9, 1)
    (worker,) = prefill.worker_addresses
    ch, stub = await prefill_stub(prefill)
    try:
        # 1. Before the Prefill RPC: the forgery comes first (no proof, then a wrong one),
        #    the real handshake after it; the Prefill then arrives with the secret.
        room, secret = new_room(), draw_secret()
        real, fake = victim.allocate(room, len(ids)), attacker.allocate(room, len(ids))
        await attacker.stub(worker).Handshake(attacker.handshake_request(fake, room_proof=b""), timeout=10)
        await attacker.stub(worker).Handshake(signed(attacker, fake, draw_secret()), timeout=10)
        await victim.stub(worker).Handshake(signed(victim, real, secret), timeout=10)
        req = request(room, ids, GREEDY)
        req.room_secret = secret
        await stub.Prefill(req, timeout=60)
        assert (await victim.wait(real, 30)).state is KVPoll.SUCCESS
        assert_landed_bit_exact(victim, real, ids, GREEDY)
        assert attacker.transport.status(room).state is not KVPoll.SUCCESS
        assert attacker.rows.room(fake.slot) == 0  # nothing reached the attacker
        victim.free(real)
        attacker.free(fake)

        # 2. While the Prefill RPC waits: the forgery is refused at once, the real one wins.
        room, secret = new_room(), draw_secret()
        real, fake = victim.allocate(room, len(ids)), attacker.allocate(room, len(ids))
        req = request(room, ids, GREEDY)
        req.room_secret = secret
        call = asyncio.ensure_future(stub.Prefill(req, timeout=60))
        await eventually_async(lambda: active_requests(stub), 15, what="the worker holds the request")
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await attacker.stub(worker).Handshake(attacker.handshake_request(fake, room_proof=b""), timeout=10)
        assert ei.value.code() is grpc.StatusCode.PERMISSION_DENIED and "room_proof" in ei.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await attacker.stub(worker).AbortRoom(hpb.AbortRoomRequest(bootstrap_room=room, reason="forged"), timeout=10)
        assert ei.value.code() is grpc.StatusCode.PERMISSION_DENIED
        await victim.stub(worker).Handshake(signed(victim, real, secret), timeout=10)
        await call
        assert (await victim.wait(real, 30)).state is KVPoll.SUCCESS
        assert_landed_bit_exact(victim, real, ids, GREEDY)
        assert attacker.rows.room(fake.slot) == 0
        victim.free(real)
        attacker.free(fake)

        # 3. A forgery before the Prefill RPC claiming another decode TP size, the real
        #    handshake only after the Prefill RPC: the forgery's TP size binds nothing.
        room, secret = new_room(), draw_secret()
        real, fake = victim.allocate(room, len(ids)), attacker.allocate(room, len(ids))
        with pytest.raises(grpc.aio.AioRpcError):  # refused (its pages do not fit TP 2), yet it was seen
            await attacker.stub(worker).Handshake(attacker.handshake_request(fake, decode_tp_size=2, room_proof=b""), timeout=10)
        req = request(room, ids, GREEDY)
        req.room_secret = secret
        call = asyncio.ensure_future(stub.Prefill(req, timeout=60))
        await eventually_async(lambda: active_requests(stub), 15, what="the worker holds the request")
        await victim.stub(worker).Handshake(signed(victim, real, secret), timeout=10)
        await call
        assert (await victim.wait(real, 30)).state is KVPoll.SUCCESS
        victim.free(real)
        attacker.free(fake)
    finally:
        await ch.close()
    await assert_settles_to_zero(prefill, dp_size=1)


async def test_only_a_proven_abort_stops_a_room(prefill: PrefillProc, decodes: tuple[FakeDecode, FakeDecode]) -> None:
    victim, attacker = decodes
    ids = prompt(7, 2)
    (worker,) = prefill.worker_addresses
    ch, stub = await prefill_stub(prefill)
    try:
        # A forged abort before the Prefill RPC changes nothing: the request is served.
        room, secret = new_room(), draw_secret()
        real = victim.allocate(room, len(ids))
        await attacker.stub(worker).AbortRoom(hpb.AbortRoomRequest(bootstrap_room=room, reason="forged"), timeout=10)
        await victim.stub(worker).Handshake(signed(victim, real, secret), timeout=10)
        req = request(room, ids, GREEDY)
        req.room_secret = secret
        await stub.Prefill(req, timeout=60)
        assert (await victim.wait(real, 30)).state is KVPoll.SUCCESS
        victim.free(real)

        # The chosen decode's abort, with its proof, still stops a room before its Prefill.
        room = new_room()
        ok = hpb.AbortRoomRequest(bootstrap_room=room, reason="decode timed out", room_proof=abort_proof(secret, room))
        await victim.stub(worker).AbortRoom(ok, timeout=10)
        req = request(room, ids, GREEDY)
        req.room_secret = secret
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.Prefill(req, timeout=10)
        assert ei.value.code() is grpc.StatusCode.ABORTED and "decode timed out" in ei.value.details()
    finally:
        await ch.close()
    await assert_settles_to_zero(prefill, dp_size=1)


async def test_a_prefill_without_its_room_secret_is_refused(prefill: PrefillProc, decodes: tuple[FakeDecode, FakeDecode]) -> None:
    """Issue 16: a Prefill with no room_secret would accept any handshake for its room, so
    whoever reached the port could send a request's KV anywhere. Sent to the controller or
    straight to a worker, it is refused naming the field; with the secret it is served."""
    victim, _ = decodes
    ids = prompt(5, 3)
    (worker,) = prefill.worker_addresses
    for address in (prefill.address, worker):
        async with grpc.aio.insecure_channel(address) as ch:
            stub = prefill_pb2_grpc.PrefillServiceStub(ch)
            for secret in (b"", b"short"):
                req = request(new_room(), ids, GREEDY)
                req.room_secret = secret
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await stub.Prefill(req, timeout=10)
                assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT, (address, ei.value)
                assert "room_secret" in ei.value.details()
    resp, r = await run_one(prefill, victim, ids, GREEDY, query=False, dp_size=1)
    assert resp.prompt_tokens == len(ids)
    victim.free(r)
    await assert_settles_to_zero(prefill, dp_size=1)


@pytest.mark.parametrize("room", [0, 2**63])
async def test_a_room_out_of_range_is_refused_at_every_entry(
    prefill: PrefillProc, decodes: tuple[FakeDecode, FakeDecode], room: int
) -> None:
    """A room a metadata row cannot hold, or 0 ("not written"), is refused naming the
    field by the controller's and a worker's Prefill and by Handshake, AbortRoom and
    WatchRoom; it holds nothing, and the next request is served."""
    victim, _ = decodes
    ids = prompt(5, 4)
    (worker,) = prefill.worker_addresses
    want = f"bootstrap_room must be in [1, 2**63), got {room}"
    for address in (prefill.address, worker):
        async with grpc.aio.insecure_channel(address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await prefill_pb2_grpc.PrefillServiceStub(ch).Prefill(request(room, ids, GREEDY), timeout=10)
            assert (ei.value.code(), ei.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, want), address
    r = victim.allocate(new_room(), len(ids))
    hs = victim.stub(worker)
    for call, msg in (
        (hs.Handshake, victim.handshake_request(r, bootstrap_room=room)),
        (hs.AbortRoom, hpb.AbortRoomRequest(bootstrap_room=room, reason="bad room")),
        (hs.WatchRoom, hpb.WatchRoomRequest(bootstrap_room=room)),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await call(msg, timeout=10)  # type: ignore[operator]
        assert (ei.value.code(), ei.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, want), type(msg).__name__
    victim.free(r)
    resp, r = await run_one(prefill, victim, ids, GREEDY, query=False, dp_size=1)
    assert resp.prompt_tokens == len(ids)
    victim.free(r)
    await assert_settles_to_zero(prefill, dp_size=1)


async def test_a_handshake_whose_credential_was_swapped_after_signing_is_refused(
    prefill: PrefillProc, decodes: tuple[FakeDecode, FakeDecode]
) -> None:
    """The data-plane credential is part of what the room proof signs: a genuine handshake
    whose ``transport_credential`` was replaced after the chosen decode signed it (the
    worker would then fail to prove itself to the real decode) is refused, before or
    during the Prefill RPC, and changes nothing; the genuine one is served."""
    victim, attacker = decodes
    ids = prompt(6, 4)
    (worker,) = prefill.worker_addresses
    writer = await victim.writer_id(worker)
    assert writer
    ch, stub = await prefill_stub(prefill)

    def genuine_and_swapped(r: Room, secret: bytes) -> tuple[hpb.HandshakeRequest, hpb.HandshakeRequest]:
        genuine = victim.handshake_request(r, transport_credential=victim.transport.issue_credential(writer), room_proof=b"")
        genuine.room_proof = handshake_proof(secret, genuine)
        swapped = hpb.HandshakeRequest()
        swapped.CopyFrom(genuine)
        swapped.transport_credential = attacker.transport.issue_credential(writer)  # well-formed, not the victim's
        return genuine, swapped

    try:
        # 1. Before the Prefill RPC: the swapped copy comes first and is held unverified.
        room, secret = new_room(), draw_secret()
        real = victim.allocate(room, len(ids))
        genuine, swapped = genuine_and_swapped(real, secret)
        await victim.stub(worker).Handshake(swapped, timeout=10)
        await victim.stub(worker).Handshake(genuine, timeout=10)
        req = request(room, ids, GREEDY)
        req.room_secret = secret
        await stub.Prefill(req, timeout=60)
        assert (await victim.wait(real, 30)).state is KVPoll.SUCCESS
        assert_landed_bit_exact(victim, real, ids, GREEDY)
        victim.free(real)

        # 2. While the Prefill RPC waits: refused at once; the genuine one then lands.
        room = new_room()
        real = victim.allocate(room, len(ids))
        genuine, swapped = genuine_and_swapped(real, secret)
        req = request(room, ids, GREEDY)
        req.room_secret = secret
        call = asyncio.ensure_future(stub.Prefill(req, timeout=60))
        await eventually_async(lambda: active_requests(stub), 15, what="the worker holds the request")
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await victim.stub(worker).Handshake(swapped, timeout=10)
        assert ei.value.code() is grpc.StatusCode.PERMISSION_DENIED and "room_proof" in ei.value.details()
        await victim.stub(worker).Handshake(genuine, timeout=10)
        await call
        assert (await victim.wait(real, 30)).state is KVPoll.SUCCESS
        assert_landed_bit_exact(victim, real, ids, GREEDY)
        victim.free(real)
    finally:
        await ch.close()
    await assert_settles_to_zero(prefill, dp_size=1)
