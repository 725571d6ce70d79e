"""Rooms whose prefill failed in its controller (RecordRoomFailures / QueryRoomFailures,
issue 17): a decode finds the record under its room's secret, and nothing made or asked
without the secret fails a room or tells whether one failed."""

from __future__ import annotations

import secrets

import grpc
import pytest

from pdgrpc.bootstrap.client import BootstrapClient
from pdgrpc.bootstrap.failures import MAX_BATCH, RoomFailures
from pdgrpc.rpc.open_calls import TooManyOpenCalls
from pdgrpc.bootstrap.service import BootstrapServer
from pdgrpc.decode.prefills import PrefillDirectory
from pdgrpc.metrics.catalog import ServerAbortReason
from pdgrpc.rpc.errors import RpcError
from pdgrpc.serving.room_proof import draw_secret, failure_tag
from pdgrpc.v1 import bootstrap_pb2 as pb

ROOM = 4242


def record(room: int, secret: bytes, reason: str = "no live prefill worker", never_forwarded: bool = True) -> pb.RoomFailure:
    key = pb.RoomFailureKey(bootstrap_room=room, tag=failure_tag(secret, room))
    return pb.RoomFailure(key=key, code=grpc.StatusCode.UNAVAILABLE.value[0], reason=reason, never_forwarded=never_forwarded)


async def test_the_decode_finds_its_rooms_failure_under_the_rooms_secret(server: BootstrapServer, client: BootstrapClient) -> None:
    secret = draw_secret()
    assert await client.record_room_failures([record(ROOM, secret)]) == 1
    directory = PrefillDirectory()
    found = await directory.room_failures(server.address, {ROOM: secret, ROOM + 1: draw_secret()})
    (failure, never_forwarded) = found[ROOM]
    assert set(found) == {ROOM} and never_forwarded
    assert failure.code == grpc.StatusCode.UNAVAILABLE and "no live prefill worker" in failure.message
    assert failure.reason is ServerAbortReason.PREFILL_ERROR


async def test_a_record_or_a_query_without_the_secret_changes_and_learns_nothing(
    server: BootstrapServer, client: BootstrapClient
) -> None:
    secret, forger = draw_secret(), draw_secret()
    directory = PrefillDirectory()
    # Forged records for the room: under another secret, and a random tag.
    forged = pb.RoomFailure(key=pb.RoomFailureKey(bootstrap_room=ROOM, tag=secrets.token_bytes(32)), code=10, reason="forged")
    await client.record_room_failures([record(ROOM, forger, "forged"), forged])
    assert await directory.room_failures(server.address, {ROOM: secret}) == {}  # the room's decode finds nothing
    # The genuine record is found beside them, and a caller without the secret learns nothing of it.
    await client.record_room_failures([record(ROOM, secret)])
    assert set(await directory.room_failures(server.address, {ROOM: secret})) == {ROOM}
    assert await client.query_room_failures([pb.RoomFailureKey(bootstrap_room=ROOM, tag=secrets.token_bytes(32))]) == []
    # A tag is bound to its room: the right tag with another room finds nothing.
    assert await client.query_room_failures([pb.RoomFailureKey(bootstrap_room=ROOM + 1, tag=failure_tag(secret, ROOM))]) == []


@pytest.mark.parametrize(
    ("key", "field"),
    [
        (pb.RoomFailureKey(bootstrap_room=0, tag=bytes(32)), r"\[0\]\.bootstrap_room must be in \[1, 2\*\*63\), got 0"),
        (pb.RoomFailureKey(bootstrap_room=2**63, tag=bytes(32)), r"\[0\]\.bootstrap_room must be in \[1, 2\*\*63\)"),
        (pb.RoomFailureKey(bootstrap_room=ROOM, tag=b"short"), "tag"),
    ],
)
async def test_bad_keys_are_refused_naming_the_field(client: BootstrapClient, key: pb.RoomFailureKey, field: str) -> None:
    with pytest.raises(RpcError, match="INVALID_ARGUMENT: .*" + field):
        await client.query_room_failures([key])
    with pytest.raises(RpcError, match="INVALID_ARGUMENT: .*" + field):
        await client.record_room_failures([pb.RoomFailure(key=key)])
    with pytest.raises(RpcError, match="INVALID_ARGUMENT: .*limit"):
        await client.query_room_failures([pb.RoomFailureKey(bootstrap_room=ROOM, tag=bytes(32))] * (MAX_BATCH + 1))


@pytest.mark.parametrize("code", [0, 17, 2**32 - 1])
async def test_a_record_whose_code_is_no_failure_status_is_refused(server: BootstrapServer, client: BootstrapClient, code: int) -> None:
    """A record says which gRPC status its prefill answered: OK, or a number that is no
    status, is refused naming the field, and nothing of the call is kept."""
    secret = draw_secret()
    bad = pb.RoomFailure(key=record(ROOM + 7, secret).key, code=code, reason="x")
    with pytest.raises(RpcError, match=rf"INVALID_ARGUMENT: RecordRoomFailuresRequest.failures\[1\].code must be a gRPC status code in \[1, 16\], got {code}"):
        await client.record_room_failures([record(ROOM + 6, secret), bad])
    assert await client.query_room_failures([record(ROOM + 6, secret).key]) == []  # all or none


def test_the_records_are_bounded_in_count_and_age() -> None:
    table = RoomFailures(capacity=2, ttl_s=10.0)
    s = [draw_secret() for _ in range(3)]
    table.record([record(1, s[0]), record(2, s[1]), record(3, s[2])], now=0.0)
    assert len(table) == 2
    assert table.query([record(1, s[0]).key], now=0.0) == []  # the oldest went first
    assert len(table.query([record(3, s[2]).key], now=5.0)) == 1
    assert table.query([record(3, s[2]).key], now=10.5) == [] and len(table) == 0  # expired
    # A long reason is cut.
    table.record([record(4, s[0], reason="x" * 5000)], now=11.0)
    assert len(table.query([record(4, s[0]).key], now=11.0)[0].reason) == 1000


async def test_a_held_query_answers_when_its_room_is_recorded_and_is_bounded(server: BootstrapServer, client: BootstrapClient) -> None:
    """The decode's held QueryRoomFailures answers the moment its room's failure is
    recorded (not at the end of its wait); a record under another secret does not wake
    it; past the cap on held calls a query is refused RESOURCE_EXHAUSTED."""
    import asyncio

    secret = draw_secret()
    held = asyncio.ensure_future(client.query_room_failures([record(ROOM + 7, secret).key], max_wait_s=10.0, timeout=20))
    await asyncio.sleep(0.1)
    await client.record_room_failures([record(ROOM + 7, draw_secret())])  # someone else's tag
    await asyncio.sleep(0.1)
    assert not held.done()
    await client.record_room_failures([record(ROOM + 7, secret)])
    found = await asyncio.wait_for(held, 2.0)
    assert [f.key.bootstrap_room for f in found] == [ROOM + 7]
    # Nothing recorded: the wait ends empty.
    assert await client.query_room_failures([record(ROOM + 8, secret).key], max_wait_s=0.05, timeout=5) == []

    table = RoomFailures(max_held_keys=1)
    first = asyncio.ensure_future(table.wait([record(ROOM, secret).key], lambda: 0.0, 10.0, caller="a"))
    await asyncio.sleep(0)
    with pytest.raises(TooManyOpenCalls, match="limit 1"):
        await table.wait([record(ROOM + 1, secret).key], lambda: 0.0, 10.0, caller="b")
    table.record([record(ROOM, secret)], 0.0)
    assert len(await first) == 1


async def test_held_queries_are_bounded_by_their_keys_and_per_caller() -> None:
    """Audit: the cap counted held calls, not their keys, and not per caller: one decode's
    credential held 4096 calls of 1024 keys each (about 1 GB of the bootstrap's memory
    per 1024 calls) and every other decode's query was refused meanwhile. The keys held
    are capped in all and per caller; another caller's query is still held and answered."""
    import asyncio

    secret = draw_secret()
    table = RoomFailures(max_held_keys=8, max_held_keys_per_caller=4)
    keys = [record(ROOM + i, secret).key for i in range(4)]
    flood = asyncio.ensure_future(table.wait(keys, lambda: 0.0, 10.0, caller="cn:mallory"))
    await asyncio.sleep(0)
    with pytest.raises(TooManyOpenCalls, match="cn:mallory .*limit 4 per caller"):
        await table.wait([record(ROOM + 9, secret).key], lambda: 0.0, 10.0, caller="cn:mallory")
    held = asyncio.ensure_future(table.wait([record(ROOM + 10, secret).key], lambda: 0.0, 10.0, caller="cn:decode"))
    await asyncio.sleep(0)
    assert not held.done()
    table.record([record(ROOM + 10, secret)], 0.0)
    assert [f.key.bootstrap_room for f in await held] == [ROOM + 10]
    big = [record(ROOM + 20 + i, secret).key for i in range(5)]
    with pytest.raises(TooManyOpenCalls, match="QueryRoomFailuresRequest.keys: 5 keys .*limit 4 per caller"):
        await table.wait(big, lambda: 0.0, 10.0, caller="cn:other")
    others = asyncio.ensure_future(table.wait(big[:4], lambda: 0.0, 10.0, caller="cn:other"))
    await asyncio.sleep(0)
    with pytest.raises(TooManyOpenCalls, match="8 keys of QueryRoomFailures calls are held on this server .limit 8"):
        await table.wait([record(ROOM + 30, secret).key], lambda: 0.0, 10.0, caller="cn:third")
    flood.cancel()
    others.cancel()
