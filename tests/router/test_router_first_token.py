"""The first token from the prefill (``--first-token prefill``, the default): the prefill's
``PrefillStream`` sends it ahead of its KV, the router relays it at once, and the decode's
first message repeats it, its KV figures going with the client's next message. Real gRPC servers on real
ports; the scripted upstreams of :mod:`tests.router.test_router` (a real cluster:
tests/e2e)."""

from __future__ import annotations

import grpc
import pytest

from pdgrpc.router.service import RouterConfig
from pdgrpc.v1 import common_pb2, generate_pb2
from tests.router.test_router_retry import Upstreams, up  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(60)

PROMPT = [256, 72, 105]


def _request(max_new_tokens: int = 8) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        input_ids=PROMPT, request_id="f1", sampling=common_pb2.SamplingParams(seed=5, max_new_tokens=max_new_tokens)
    )


async def _stream(stub, request) -> list[generate_pb2.GenerateResponse]:
    return [m async for m in stub.Generate(request, timeout=20)]


def _ids(msgs: list[generate_pb2.GenerateResponse]) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


async def test_the_prefills_first_token_goes_ahead_and_the_figures_follow(up: Upstreams):
    prefill, decode = up.prefills[0], up.decodes[0]
    prefill.ahead = [104]
    decode.messages, decode.gap = [[104], [105], [33]], 0.3  # the KV is still on its way
    _, stub = await up.router(up.p_addrs[:1], up.d_addrs[:1])
    msgs = await _stream(stub, _request())
    assert prefill.streamed == 1
    assert _ids(msgs) == [104, 105, 33] and "".join(m.text for m in msgs) == "hi!"  # no token twice
    assert [list(m.token_ids) for m in msgs] == [[104], [105], [33]]
    ahead, second = msgs[0], msgs[1]
    assert ahead.text == "h"
    # The request's figures on the first message; the KV's, which the decode reports with
    # its repeat of the token sent ahead, on the next.
    assert 0 < ahead.ttft_seconds < decode.gap and ahead.bootstrap_room != 0 and ahead.seed == 5
    assert ahead.bytes_transferred == 0 and ahead.transfer_seconds == 0
    assert second.ttft_seconds == 0 and second.bootstrap_room == 0
    assert second.bytes_transferred == 8192 and second.transfer_seconds == pytest.approx(0.002)
    assert second.data_plane_seconds == pytest.approx(0.0005)
    assert all(m.bytes_transferred == 0 for m in msgs[2:])
    assert msgs[-1].finish_reason == "length" and sum(bool(m.finish_reason) for m in msgs) == 1


async def test_a_decode_whose_first_message_comes_first_is_relayed_as_before(up: Upstreams):
    prefill, decode = up.prefills[0], up.decodes[0]
    prefill.ahead, prefill.ahead_delay = [104], 0.3
    decode.messages = [[104], [105]]
    _, stub = await up.router(up.p_addrs[:1], up.d_addrs[:1])
    msgs = await _stream(stub, _request())
    assert [list(m.token_ids) for m in msgs] == [[104], [105]]  # the late token ahead is dropped
    assert msgs[0].ttft_seconds > 0 and msgs[0].bytes_transferred == 8192


async def test_first_token_decode_calls_prefill_and_waits_for_the_decode(up: Upstreams):
    prefill, decode = up.prefills[0], up.decodes[0]
    prefill.ahead = [104]
    decode.messages = [[104], [105]]
    _, stub = await up.router(up.p_addrs[:1], up.d_addrs[:1], first_token="decode")
    msgs = await _stream(stub, _request())
    assert prefill.streamed == 0 and len(prefill.requests) == 1  # a Prefill call
    assert [list(m.token_ids) for m in msgs] == [[104], [105]]
    assert msgs[0].ttft_seconds > 0 and msgs[0].bytes_transferred == 8192


async def test_a_request_with_one_token_left_waits_for_the_decode_to_say_why_it_ended(up: Upstreams):
    prefill, decode = up.prefills[0], up.decodes[0]
    prefill.ahead = [104]
    decode.messages = [[104]]
    _, stub = await up.router(up.p_addrs[:1], up.d_addrs[:1])
    msgs = await _stream(stub, _request(max_new_tokens=1))
    assert prefill.streamed == 0
    assert [list(m.token_ids) for m in msgs] == [[104]] and msgs[0].finish_reason == "length"


async def test_a_decode_that_contradicts_the_prefills_first_token_fails_the_request(up: Upstreams):
    prefill, decode = up.prefills[0], up.decodes[0]
    prefill.ahead = [104]
    decode.messages, decode.gap = [[99], [105]], 0.3
    _, stub = await up.router(up.p_addrs[:1], up.d_addrs[:1])
    msgs = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for m in stub.Generate(_request(), timeout=20):
            msgs.append(m)
    assert _ids(msgs) == [104]
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "sent tokens [99] where the prefill's first token was [104]" in err.value.details()


async def test_a_decode_lost_after_the_token_went_ahead_migrates_with_it(up: Upstreams):
    first, second = up.decodes
    for p in up.prefills:
        p.ahead = [72]
    first.wait_forever = True  # never sends: its KV never lands
    second.messages = [[105], [33]]
    router, stub = await up.router(up.p_addrs, up.d_addrs, migration_limit=1)
    call = stub.Generate(_request(max_new_tokens=3), timeout=20)
    head = await call.read()
    assert list(head.token_ids) == [72] and head.ttft_seconds > 0
    await first.started.wait()
    for p in up.prefills:  # the next pair's prefill computes prompt + [72]: its first token is the next one
        p.ahead = [105]
    for s in up.servers:  # the decode that holds the stream goes away
        if s.address == up.d_addrs[0]:
            await s.stop(0)
    rest = []
    while (m := await call.read()) is not grpc.aio.EOF:
        rest.append(m)
    ids = _ids([head, *rest])
    assert ids == [72, 105, 33]  # the second pair goes on from what the client has
    (d2,) = second.requests
    assert list(d2.input_ids) == PROMPT + [72] and d2.sampling.max_new_tokens == 2
    assert rest[-1].finish_reason == "length"


async def test_a_first_token_that_ends_the_stream_is_followed_by_the_decodes_reason(up: Upstreams):
    prefill, decode = up.prefills[0], up.decodes[0]
    prefill.ahead = [104]  # e.g. an EOS: the prefill cannot say the stream ends, the decode does
    decode.messages, decode.gap = [[104]], 0.3
    _, stub = await up.router(up.p_addrs[:1], up.d_addrs[:1])
    msgs = await _stream(stub, _request())
    assert [list(m.token_ids) for m in msgs] == [[104], []]
    assert msgs[0].finish_reason == "" and msgs[1].finish_reason == "length" and msgs[1].bytes_transferred == 8192
