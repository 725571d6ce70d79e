"""A stream whose decode fails after tokens reached the client migrates: the request goes
on on another prefill and decode with prompt + relayed tokens, the tokens left, the same
seed and a new room, and the client's stream continues with no duplicate and no gap
(``--migration-limit``, default 1). Real gRPC servers on real ports; the scripted
upstreams of :mod:`tests.router.test_router` (a real cluster: tests/e2e/test_migration.py)."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from pdgrpc.bench.chaos import migrated_rooms
from pdgrpc.metrics import start_metrics_server
from pdgrpc.router.service import RouterConfig
from pdgrpc.v1 import common_pb2, decode_pb2, generate_pb2
from tests.router.test_router import ScriptedDecode, serve_decode
from tests.router.test_router_retry import Upstreams, up  # noqa: F401 - the fixture
from tests.scrape import scrape

pytestmark = pytest.mark.timeout(60)

PROMPT = [256, 72, 105]


def _request(max_new_tokens: int = 8, seed: int = 77) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        input_ids=PROMPT, request_id="m1",
        sampling=common_pb2.SamplingParams(temperature=0.8, seed=seed, max_new_tokens=max_new_tokens),
    )


async def _stream(stub, request) -> tuple[list[int], str, list[generate_pb2.GenerateResponse]]:
    msgs = []
    async for m in stub.Generate(request, timeout=20):
        msgs.append(m)
    return [t for m in msgs for t in m.token_ids], "".join(m.text for m in msgs), msgs


async def test_a_decode_that_fails_mid_stream_is_replaced_with_no_duplicate_and_no_gap(up: Upstreams, caplog):
    caplog.set_level(logging.INFO, logger="pdgrpc.router")
    first, second = up.decodes
    # "é" is two bytes split across the failure: the text decoder carries over.
    first.messages = [[72], [105], [0xC3], [99]]
    first.fail_after, first.fail = 3, (grpc.StatusCode.UNAVAILABLE, "Socket closed")
    second.messages = [[0xA9], [33], [10], [111], [107]]
    router, stub = await up.router(up.p_addrs, up.d_addrs)
    port, stop = start_metrics_server(router.metrics.registry, "127.0.0.1", 0)
    try:
        ids, text, msgs = await _stream(stub, _request())
        assert ids == [72, 105, 0xC3, 0xA9, 33, 10, 111, 107]
        assert text == "Hié!\nok"
        assert msgs[-1].finish_reason == "length" and msgs[0].ttft_seconds > 0
        assert sum(m.ttft_seconds > 0 for m in msgs) == 1  # the request's figures once, in its first message
        (d1,), (d2,) = first.requests, second.requests
        assert list(d1.input_ids) == PROMPT and d1.sampling.max_new_tokens == 8
        # The new pair goes on from what the client has: prompt + relayed tokens, the rest
        # of the budget, the same seed, a new room (and secret).
        assert list(d2.input_ids) == PROMPT + [72, 105, 0xC3] and d2.sampling.max_new_tokens == 5
        assert d2.sampling.seed == d1.sampling.seed == 77 and d2.sampling.temperature == d1.sampling.temperature
        assert d2.bootstrap_room != d1.bootstrap_room and d2.room_secret != d1.room_secret
        p2 = [r for p in up.prefills for r in p.requests if r.bootstrap_room == d2.bootstrap_room]
        assert len(p2) == 1 and list(p2[0].input_ids) == list(d2.input_ids) and p2[0].sampling.seed == 77
        assert "migrating after 3 token(s)" in caplog.text
        # bench chaos finds the migrated streams by the room of their first message.
        assert migrated_rooms(caplog.text) == {msgs[0].bootstrap_room} == {d1.bootstrap_room}
        s = await asyncio.to_thread(scrape, f"127.0.0.1:{port}")
        assert s.value("pdgrpc_router_migrations_total", role="router", reason="peer_failure") == 1
        assert s.value("pdgrpc_retries_total", role="router") == 0
        assert s.value("pdgrpc_requests_total", role="router", state="finished") == 1
        assert s.value("pdgrpc_output_tokens_total", role="router") == 8
    finally:
        stop()


async def test_past_the_migration_limit_the_second_failure_reaches_the_client(up: Upstreams):
    up.decodes.append(type(up.decodes[0])())  # a third decode: there is somewhere to go, but the limit says no
    await up.start_decode(up.decodes[2])
    for d in up.decodes:
        d.messages = [[1], [2], [3], [4]]
        d.fail_after, d.fail = 2, (grpc.StatusCode.UNAVAILABLE, "decode going away")
    _, stub = await up.router(up.p_addrs, up.d_addrs, migration_limit=1)
    got: list[int] = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for m in stub.Generate(_request(), timeout=20):
            got += m.token_ids
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "decode going away" in err.value.details()
    assert got == [1, 2, 1, 2]  # the scripted second decode repeats its script: two attempts, no third
    assert sum(len(d.requests) for d in up.decodes) == 2


async def test_a_request_error_or_too_long_a_sequence_does_not_migrate(up: Upstreams):
    first, second = up.decodes
    first.messages = second.messages = [[1], [2], [3]]
    first.fail_after = second.fail_after = 1
    first.fail = second.fail = (grpc.StatusCode.ABORTED, "metadata corruption in slot 3")
    _, stub = await up.router(up.p_addrs, up.d_addrs)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _stream(stub, _request())
    assert err.value.code() == grpc.StatusCode.ABORTED
    assert len(first.requests) + len(second.requests) == 1

    first.fail = second.fail = (grpc.StatusCode.UNAVAILABLE, "decode going away")
    _, stub = await up.router(up.p_addrs, up.d_addrs, migration_max_seq_len=len(PROMPT))  # prompt + 1 token > limit
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _stream(stub, _request())
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert len(first.requests) + len(second.requests) == 2


@pytest.mark.parametrize("field, value", [("migration_limit", -1), ("migration_max_seq_len", -5)])
def test_migration_flags_must_not_be_negative(field: str, value: int):
    with pytest.raises(ValueError, match=f"--{field.replace('_', '-')} must be >= 0"):
        RouterConfig(prefills=(), decodes=("127.0.0.1:2",), discovery=True, **{field: value})


class _DecodeThatDies(ScriptedDecode):
    """Streams ``before`` tokens, then, once ``dies`` is set, ends as a killed process's
    stream does (UNAVAILABLE naming no reason) a moment after its prefill has failed."""

    def __init__(self, before: int, dies: asyncio.Event) -> None:
        super().__init__()
        self.before = before
        self.dies = dies

    async def Decode(self, request, context):
        self.requests.append(request)
        for t in range(self.before):
            await context.write(decode_pb2.DecodeResponse(token_ids=[72 + t]))
        await self.dies.wait()
        await asyncio.sleep(0.05)  # its prefill's transfer fails first: the peer is gone
        await context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")


@pytest.mark.parametrize("before", [0, 2], ids=["before-first-token", "mid-stream"])
async def test_a_decode_dying_is_blamed_though_its_prefill_reports_the_loss_first(up: Upstreams, before: int):
    """A decode that dies fails its prefill's transfer too, and the prefill may say so
    before the decode's stream ends: the router blames the decode (it retries or migrates
    the request to another decode) rather than the prefill, whose ABORTED would reach the
    client."""
    dies = asyncio.Event()
    dying = _DecodeThatDies(before, dies)
    up.servers.append(srv := await serve_decode(dying))
    up.prefills[0].fail = (grpc.StatusCode.ABORTED, "room 1: transfer failed: peer lost: connection reset")
    up.prefills[0].gate = dies
    up.decodes[1].messages = [[80], [81]]
    # round_robin: the first attempt goes to prefill 0 and the dying decode, the next to the others.
    _, stub = await up.router(up.p_addrs, [srv.address, up.d_addrs[1]], policy="round_robin")
    call = stub.Generate(_request(max_new_tokens=before + 2), timeout=20)
    got = [t for _ in range(before) for t in (await call.read()).token_ids]
    dies.set()
    while (m := await call.read()) is not grpc.aio.EOF:
        got += m.token_ids
    assert got == [72 + t for t in range(before)] + [80, 81]
    assert len(up.decodes[1].requests) == 1 and len(up.prefills[1].requests) == 1
