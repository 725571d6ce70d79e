"""The router against scripted in-process prefill and decode servers (real gRPC, real ports).

The scripted upstreams let each failure be forced exactly (a prefill that refuses, a
decode that aborts mid-stream, a client that walks away) and record what the router did
to them: which requests arrived, and whether and when their calls were cancelled.
End-to-end behaviour with the real servers is in ``tests/e2e``.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest

from pdgrpc.errors import ConfigError
from pdgrpc.metrics import start_metrics_server
from tests.scrape import scrape
from pdgrpc.router.service import GenerateServicer, PrefillBackend, RouterConfig, draw_room, parse_prefill, service_names
from pdgrpc.rpc.channels import ChannelPool
from pdgrpc.rpc.server import start_server
from tests.eventually import eventually_async
from pdgrpc.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    generate_pb2,
    generate_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

pytestmark = pytest.mark.timeout(60)


class ScriptedPrefill(prefill_pb2_grpc.PrefillServiceServicer):
    """Replies after ``delay`` s, or fails with ``fail`` = (code, message). A PrefillStream
    sends ``ahead`` first (token ids; None: nothing ahead), ``ahead_delay`` s in."""

    def __init__(self) -> None:
        self.requests: list[prefill_pb2.PrefillRequest] = []
        self.streamed = 0  # PrefillStream calls among requests
        self.cancelled_at: dict[int, float] = {}
        self.fail: tuple[grpc.StatusCode, str] | None = None
        self.delay = 0.0
        self.hang = False
        self.gate: asyncio.Event | None = None  # when set: fail only once this is set
        self.ahead: list[int] | None = None
        self.ahead_delay = 0.0

    async def PrefillStream(self, request, context):
        self.streamed += 1
        if self.ahead is not None:
            await asyncio.sleep(self.ahead_delay)
            await context.write(prefill_pb2.PrefillUpdate(token_ids=self.ahead))
        reply = await self.Prefill(request, context)
        await context.write(prefill_pb2.PrefillUpdate(reply=reply))

    async def Prefill(self, request, context):
        self.requests.append(request)
        try:
            if self.hang:
                await asyncio.sleep(3600)
            await asyncio.sleep(self.delay)
            if self.fail is not None and self.gate is not None:
                await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled_at[request.bootstrap_room] = time.monotonic()
            raise
        if self.fail is not None:
            await context.abort(*self.fail)
        return prefill_pb2.PrefillResponse(dp_rank=0, prompt_tokens=len(request.input_ids), bytes_transferred=4096, transfer_seconds=0.001)


class ScriptedDecode(decode_pb2_grpc.DecodeServiceServicer):
    """Streams ``messages`` (lists of token ids), ``gap`` s apart; ``fail_after`` messages
    in, fails with ``fail``; ``wait_forever`` holds the stream open (a request whose KV
    never arrives)."""

    def __init__(self) -> None:
        self.requests: list[decode_pb2.DecodeRequest] = []
        self.cancelled_at: dict[int, float] = {}
        self.messages: list[list[int]] = [[104], [105]]
        self.gap = 0.0
        self.fail_after: int | None = None
        self.fail: tuple[grpc.StatusCode, str] = (grpc.StatusCode.ABORTED, "metadata corruption in slot 3")
        self.wait_forever = False
        self.started = asyncio.Event()  # a Decode call reached the handler

    async def Decode(self, request, context):
        self.requests.append(request)
        try:
            self.started.set()
            if self.wait_forever:
                await asyncio.sleep(3600)
            for i, ids in enumerate(self.messages):
                if self.fail_after is not None and i == self.fail_after:
                    await context.abort(*self.fail)
                await asyncio.sleep(self.gap)
                last = i == len(self.messages) - 1
                await context.write(
                    decode_pb2.DecodeResponse(
                        token_ids=ids,
                        finish_reason="length" if last else "",
                        bytes_transferred=8192 if i == 0 else 0,
                        transfer_seconds=0.002 if i == 0 else 0.0,
                        data_plane_seconds=0.0005 if i == 0 else 0.0,
                    )
                )
        except asyncio.CancelledError:
            self.cancelled_at[request.bootstrap_room] = time.monotonic()
            raise


async def serve_prefill(prefill: ScriptedPrefill):
    """``prefill`` on a real gRPC server (127.0.0.1, a free port)."""
    return await start_server(
        [("pdgrpc.v1.PrefillService", lambda s: prefill_pb2_grpc.add_PrefillServiceServicer_to_server(prefill, s))])


async def serve_decode(decode: ScriptedDecode):
    """``decode`` on a real gRPC server (127.0.0.1, a free port)."""
    return await start_server(
        [("pdgrpc.v1.DecodeService", lambda s: decode_pb2_grpc.add_DecodeServiceServicer_to_server(decode, s))])


@pytest.fixture
async def cluster():
    prefill, decodes = ScriptedPrefill(), [ScriptedDecode(), ScriptedDecode()]
    p_srv = await serve_prefill(prefill)
    d_srvs = [await serve_decode(d) for d in decodes]
    router = GenerateServicer(
        RouterConfig(
            prefills=(PrefillBackend(p_srv.address, "127.0.0.1:1"),), decodes=tuple(s.address for s in d_srvs)
        )
    )
    (name,) = service_names()
    r_srv = await start_server([(name, lambda s: generate_pb2_grpc.add_GenerateServiceServicer_to_server(router, s))])
    channel = grpc.aio.insecure_channel(r_srv.address)
    stub = generate_pb2_grpc.GenerateServiceStub(channel)
    try:
        yield stub, prefill, decodes, p_srv.address, [s.address for s in d_srvs], router
    finally:
        await channel.close()
        await router.close()
        for s in (r_srv, p_srv, *d_srvs):
            await s.stop(0)


async def collect(call) -> list[generate_pb2.GenerateResponse]:
    return [m async for m in call]


async def test_streams_tokens_and_sends_both_sides_the_same_request(cluster):
    stub, prefill, decodes, _, _, _ = cluster
    # "é" is 0xC3 0xA9: split across two messages, it must arrive as one character.
    decodes[0].messages = [[104, 0xC3], [0xA9, 33], [257]]
    out = await collect(stub.Generate(generate_pb2.GenerateRequest(prompt="hi", request_id="q1")))
    assert [list(m.token_ids) for m in out] == [[104, 0xC3], [0xA9, 33], [257]]
    assert [m.text for m in out] == ["h", "é!", ""]
    assert "".join(m.text for m in out) == "hé!"
    first = out[0]
    assert first.ttft_seconds > 0 and first.bytes_transferred == 8192 and first.transfer_seconds == pytest.approx(0.002)
    assert first.data_plane_seconds == pytest.approx(0.0005)
    assert first.bootstrap_room != 0 and all(m.bootstrap_room == 0 for m in out[1:])
    assert out[-1].finish_reason == "length"
    (p,), (d,) = prefill.requests, decodes[0].requests
    assert p.bootstrap_room == d.bootstrap_room == first.bootstrap_room
    assert list(p.input_ids) == list(d.input_ids) == [256, ord("h"), ord("i")]  # BOS + bytes
    assert p.sampling.max_new_tokens == d.sampling.max_new_tokens == 16  # the proto's default for 0
    assert p.request_id == d.request_id == "q1"
    assert d.prefill_bootstrap_address == "127.0.0.1:1"
    assert not p.HasField("routed_dp_rank") and not d.HasField("routed_dp_rank")


async def test_incomplete_utf8_at_the_end_is_flushed_as_a_replacement(cluster):
    stub, _, decodes, *_ = cluster
    decodes[0].messages = [[0xE2, 0x82]]  # the first two bytes of "€", then the stream ends
    out = await collect(stub.Generate(generate_pb2.GenerateRequest(prompt="x")))
    assert "".join(m.text for m in out) == "\ufffd"


async def test_routed_dp_rank_and_sampling_reach_both_sides(cluster):
    stub, prefill, decodes, *_ = cluster
    sampling = common_pb2.SamplingParams(temperature=0.7, seed=99, max_new_tokens=5)
    await collect(stub.Generate(generate_pb2.GenerateRequest(input_ids=[256, 1, 2], sampling=sampling, routed_dp_rank=1)))
    (p,), (d,) = prefill.requests, decodes[0].requests
    assert p.routed_dp_rank == d.routed_dp_rank == 1
    assert p.sampling == d.sampling == sampling
    assert list(p.input_ids) == [256, 1, 2]


async def test_decodes_take_turns(cluster):
    stub, _, decodes, *_ = cluster
    for _ in range(4):
        await collect(stub.Generate(generate_pb2.GenerateRequest(prompt="x")))
    assert [len(d.requests) for d in decodes] == [2, 2]


async def test_prefill_refusal_reaches_client_and_cancels_decode(cluster):
    stub, prefill, decodes, p_addr, _, router = cluster
    prefill.fail = (grpc.StatusCode.INVALID_ARGUMENT, "token_ids: prompt has 9000 tokens, over max_prompt_tokens=2048")
    decodes[0].wait_forever = True  # the KV never comes: only the router can end this call
    # Fail only once the decode holds the request: a cancel that reaches the decode's
    # server before its handler starts leaves nothing to release, and nothing to observe.
    prefill.gate = decodes[0].started
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub.Generate(generate_pb2.GenerateRequest(prompt="x")))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"prefill {p_addr} failed" in err.value.details() and "over max_prompt_tokens=2048" in err.value.details()
    room = prefill.requests[0].bootstrap_room
    await wait_for(lambda: room in decodes[0].cancelled_at, 10.0)
    assert router.active == 0


async def test_decode_failure_reaches_client_and_cancels_prefill(cluster):
    stub, prefill, decodes, _, d_addrs, _ = cluster
    prefill.hang = True
    decodes[0].messages = [[104], [105], [106]]
    decodes[0].fail_after = 1
    call = stub.Generate(generate_pb2.GenerateRequest(prompt="x"))
    got = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for m in call:
            got.append(list(m.token_ids))
    assert got == [[104]]  # what was streamed before the failure, nothing after
    assert err.value.code() == grpc.StatusCode.ABORTED
    assert f"decode {d_addrs[0]} failed" in err.value.details() and "metadata corruption in slot 3" in err.value.details()
    room = decodes[0].requests[0].bootstrap_room
    await wait_for(lambda: room in prefill.cancelled_at, 10.0)


async def test_prefill_cause_wins_when_both_sides_fail(cluster):
    stub, prefill, decodes, *_ = cluster
    prefill.delay = 0.1
    prefill.fail = (grpc.StatusCode.FAILED_PRECONDITION, "routed_dp_rank 1 conflicts with follow_bootstrap_room (room % 2 = 0)")
    decodes[0].fail_after = 0
    decodes[0].fail = (grpc.StatusCode.ABORTED, "prefill aborted the room")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub.Generate(generate_pb2.GenerateRequest(prompt="x")))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "conflicts with follow_bootstrap_room" in err.value.details()
    assert "prefill aborted the room" in err.value.details()  # the decode's side is kept too


async def test_client_cancel_mid_stream_cancels_both_sides(cluster):
    stub, prefill, decodes, *_ = cluster
    prefill.hang = True
    decodes[0].messages = [[104]] * 50
    decodes[0].gap = 0.05
    call = stub.Generate(generate_pb2.GenerateRequest(prompt="x"))
    first = await call.read()
    assert list(first.token_ids) == [104]
    call.cancel()
    room = first.bootstrap_room
    await wait_for(lambda: room in decodes[0].cancelled_at and room in prefill.cancelled_at, 10.0)


async def test_token_outside_the_vocabulary_is_refused_before_any_upstream_call(cluster):
    stub, prefill, decodes, *_ = cluster
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub.Generate(generate_pb2.GenerateRequest(input_ids=[256, 300])))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input_ids[1] = 300" in err.value.details()
    assert not prefill.requests and not decodes[0].requests


@pytest.mark.parametrize("sampling, named", [
    (common_pb2.SamplingParams(temperature=-1.0), "sampling.temperature"),
    (common_pb2.SamplingParams(temperature=float("nan")), "sampling.temperature"),
    (common_pb2.SamplingParams(top_p=1.5), "sampling.top_p"),
    (common_pb2.SamplingParams(top_logprobs=21), "sampling.top_logprobs"),
], ids=["temperature-negative", "temperature-nan", "top_p", "top_logprobs"])
async def test_sampling_out_of_bounds_is_refused_before_any_upstream_call(cluster, sampling, named):
    """A client's bad sampling field is the client's mistake: refused by the router,
    counted as refused, and no prefill or decode spends a room on it."""
    stub, prefill, decodes, *_, router = cluster
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub.Generate(generate_pb2.GenerateRequest(prompt="x", sampling=sampling)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(named)
    assert not prefill.requests and not decodes[0].requests and not decodes[1].requests
    assert [m.token_ids for m in await collect(stub.Generate(generate_pb2.GenerateRequest(prompt="x")))] == [[104], [105]]


async def test_unreachable_decode_is_a_clear_unavailable(cluster):
    _, prefill, _, p_addr, _, _ = cluster
    prefill.hang = True
    router = GenerateServicer(RouterConfig(prefills=(PrefillBackend(p_addr, p_addr),), decodes=("127.0.0.1:1",)))
    (name,) = service_names()
    srv = await start_server([(name, lambda s: generate_pb2_grpc.add_GenerateServiceServicer_to_server(router, s))])
    try:
        async with grpc.aio.insecure_channel(srv.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(generate_pb2_grpc.GenerateServiceStub(ch).Generate(generate_pb2.GenerateRequest(prompt="x")))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "decode 127.0.0.1:1 failed" in err.value.details()
        # The prefill call is cancelled at once: the prefill drops it, or never starts it.
        await asyncio.sleep(0.5)
        assert len(prefill.cancelled_at) == len(prefill.requests) <= 1
    finally:
        await router.close()
        await srv.stop(0)


async def test_the_router_calls_through_the_channel_pool_it_is_given(cluster):
    """A pool passed in makes the router's channels, though it holds none yet (an empty
    pool is falsy)."""
    _, _, _, p_addr, d_addrs, _ = cluster
    pool = ChannelPool()
    router = GenerateServicer(RouterConfig(prefills=(PrefillBackend(p_addr, p_addr),), decodes=(d_addrs[0],)), pool=pool)
    (name,) = service_names()
    srv = await start_server([(name, lambda s: generate_pb2_grpc.add_GenerateServiceServicer_to_server(router, s))])
    try:
        async with grpc.aio.insecure_channel(srv.address) as ch:
            await collect(generate_pb2_grpc.GenerateServiceStub(ch).Generate(generate_pb2.GenerateRequest(prompt="x")))
        assert p_addr in pool and d_addrs[0] in pool
    finally:
        await router.close()
        await srv.stop(0)


class _KeptCalls:
    """``channel``, keeping each call it makes in ``calls``."""

    def __init__(self, channel: grpc.aio.Channel, calls: list) -> None:
        self.channel = channel
        self.calls = calls

    def unary_unary(self, *args, **kwargs):
        return self._kept(self.channel.unary_unary(*args, **kwargs))

    def unary_stream(self, *args, **kwargs):
        return self._kept(self.channel.unary_stream(*args, **kwargs))

    def _kept(self, method):
        def call(*args, **kwargs):
            made = method(*args, **kwargs)
            self.calls.append(made)
            return made

        return call


class NoChannelTo(ChannelPool):
    """A pool that cannot make a channel to ``target`` (it raises what a channel whose TLS
    files cannot be read raises) and keeps every call made on the others in ``calls``."""

    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target
        self.calls: list = []

    def get(self, target: str):
        if target == self.target:
            raise ConfigError("--tls-ca: cannot read '/etc/pdgrpc/ca.pem': No such file or directory")
        return _KeptCalls(super().get(target), self.calls)


async def test_a_decode_channel_that_cannot_be_made_leaves_no_call_and_is_no_cancel(cluster):
    """The router's own failure to open a channel ends the request INTERNAL, naming the
    instance and the cause; no call of it is left running upstream (a prefill call would
    compute, then wait for a handshake that never comes); and it counts as an internal
    error, not as a client's cancel."""
    _, prefill, _, p_addr, d_addrs, _ = cluster
    prefill.hang = True  # only the router's cancel ends a call to it
    pool = NoChannelTo(d_addrs[0])
    router = GenerateServicer(RouterConfig(prefills=(PrefillBackend(p_addr, p_addr),), decodes=(d_addrs[0],)), pool=pool)
    err = await internal_failure(router, p_addr)
    assert f"decode {d_addrs[0]}" in err.details() and "cannot read" in err.details()
    await eventually_async(lambda: all(call.done() for call in pool.calls), what="every call the router made is over")


async def internal_failure(router: GenerateServicer, prefill: str) -> grpc.aio.AioRpcError:
    """One request through ``router`` that ends INTERNAL, counted as an internal error and
    not as a cancel, with nothing left in flight; its error. Closes the router."""
    (name,) = service_names()
    srv = await start_server([(name, lambda s: generate_pb2_grpc.add_GenerateServiceServicer_to_server(router, s))])
    port, stop = start_metrics_server(router.metrics.registry, "127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(srv.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(generate_pb2_grpc.GenerateServiceStub(ch).Generate(generate_pb2.GenerateRequest(prompt="x")))
        assert err.value.code() == grpc.StatusCode.INTERNAL, (err.value.code(), err.value.details())
        assert router.policy.load(prefill) == 0 and router.active == 0
        s = await asyncio.to_thread(scrape, f"127.0.0.1:{port}")
        assert s.value("pdgrpc_aborts_total", reason="internal_error", role="router") == 1
        assert s.value("pdgrpc_aborts_total", reason="cancelled", role="router") == 0
        return err.value
    finally:
        stop()
        await router.close()
        await srv.stop(0)


async def test_a_request_id_cannot_split_or_forge_a_log_line(cluster, caplog):
    """The caller's request_id goes into the router's log lines escaped: a line break in
    it (without a space, which was quoted already) starts no forged line of its own."""
    stub, *_ = cluster
    caplog.set_level(logging.INFO, logger="pdgrpc.router")
    forged = "q1\nroom=42\tfinished\trequest_id=forged"
    await collect(stub.Generate(generate_pb2.GenerateRequest(prompt="x", request_id=forged)))
    lines = [r.getMessage() for r in caplog.records if r.name == "pdgrpc.router"]
    assert any("finished" in line for line in lines)
    assert all("\n" not in line and "\t" not in line for line in lines), lines
    assert all(repr(forged) in line for line in lines if "request_id=" in line)


async def test_a_router_bug_ends_the_request_internal_and_is_no_cancel(cluster, monkeypatch):
    """An exception the router does not expect (a bug) ends the request INTERNAL, logged
    with its traceback and counted as an internal error: not as a client's cancel, and
    not as grpc's bare UNKNOWN."""
    _, _, _, p_addr, d_addrs, _ = cluster

    async def broken(self, *args, **kwargs):
        raise RuntimeError("a bug in the relay")

    monkeypatch.setattr(GenerateServicer, "_relay", broken)
    router = GenerateServicer(RouterConfig(prefills=(PrefillBackend(p_addr, p_addr),), decodes=(d_addrs[0],)))
    assert "a bug in the relay" in ((await internal_failure(router, p_addr)).details() or "")


def test_rooms_are_63_bit_and_never_zero(monkeypatch):
    draws = iter([0, 0, 5])
    monkeypatch.setattr("pdgrpc.router.service.secrets.randbits", lambda bits: next(draws))
    assert draw_room() == 5
    monkeypatch.undo()
    rooms = {draw_room() for _ in range(1000)}
    assert len(rooms) == 1000 and all(0 < r < 2**63 for r in rooms)


def test_prefill_spec_parsing():
    assert parse_prefill("127.0.0.1:5000") == PrefillBackend("127.0.0.1:5000", "127.0.0.1:5000")
    assert parse_prefill("h:1,bootstrap=h:2") == PrefillBackend("h:1", "h:2")
    for bad in ("nohost", "h:1,boot=h:2", "h:1,bootstrap=x", "h:99999"):
        with pytest.raises(ValueError):
            parse_prefill(bad)


async def wait_for(cond, timeout: float) -> None:
    """Poll ``cond`` until true. The bound only keeps a broken router from hanging the
    test (without the router's cancel, the scripted side waits for an hour); it is not a
    speed check -- the machine may be loaded."""
    await eventually_async(cond, timeout, 0.01)


async def test_metrics_count_each_request_once_by_how_it_ended(cluster):
    """Scraped over HTTP: finished requests with their TTFT and tokens; a bad prompt
    refused; a prefill failure, a decode failure and a client cancel aborted, each
    under its cause; and no request left active."""
    stub, prefill, decodes, *_, router = cluster
    router.metrics.bind(lambda: {"active_requests": router.active})
    port, stop = start_metrics_server(router.metrics.registry, "127.0.0.1", 0)
    try:
        decodes[0].messages = decodes[1].messages = [[104], [105, 106], [107]]
        for _ in range(3):
            await collect(stub.Generate(generate_pb2.GenerateRequest(prompt="x")))
        with pytest.raises(grpc.aio.AioRpcError):  # refused by the router itself
            await collect(stub.Generate(generate_pb2.GenerateRequest(input_ids=[256, 300])))
        prefill.fail = (grpc.StatusCode.INTERNAL, "the engine failed")
        for d in decodes:
            d.wait_forever = True  # only the prefill's failure can end this request
        with pytest.raises(grpc.aio.AioRpcError):
            await collect(stub.Generate(generate_pb2.GenerateRequest(prompt="x")))
        prefill.fail = None
        for d in decodes:
            d.wait_forever = False
        prefill.hang = True
        for d in decodes:
            d.fail_after = 1
        with pytest.raises(grpc.aio.AioRpcError):
            await collect(stub.Generate(generate_pb2.GenerateRequest(prompt="x")))
        before_cancel = await asyncio.to_thread(scrape, f"127.0.0.1:{port}")
        # Every request that streamed a first token has a TTFT: 3 finished, and the one that
        # failed after its first token.
        assert before_cancel.value("pdgrpc_time_to_first_token_seconds_count", role="router") == 4
        assert before_cancel.value("pdgrpc_output_tokens_total", role="router") == 3 * 4 + 1
        for d in decodes:
            d.fail_after, d.messages, d.gap = None, [[104]] * 50, 0.05
        call = stub.Generate(generate_pb2.GenerateRequest(prompt="x"))
        await call.read()
        call.cancel()
        await wait_for(lambda: router.active == 0, 10.0)

        s = await asyncio.to_thread(scrape, f"127.0.0.1:{port}")
        r = {"role": "router"}
        assert s.value("pdgrpc_requests_total", state="finished", **r) == 3
        assert s.value("pdgrpc_requests_total", state="refused", **r) == 1
        assert s.value("pdgrpc_requests_total", state="aborted", **r) == 3
        assert s.value("pdgrpc_aborts_total", reason="prefill_error", **r) == 1
        assert s.value("pdgrpc_aborts_total", reason="decode_error", **r) == 1
        assert s.value("pdgrpc_aborts_total", reason="cancelled", **r) == 1
        assert s.value("pdgrpc_time_to_first_token_seconds_count", **r) == 5  # and the cancelled one
        assert s.value("pdgrpc_output_tokens_total", **r) >= 3 * 4 + 1 + 1  # it streamed one or more
        assert s.value("pdgrpc_active_requests", **r) == 0
    finally:
        router.metrics.unbind()
        stop()


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE])
@pytest.mark.parametrize("side", ["prefill", "decode"])
async def test_a_request_an_upstream_refuses_as_invalid_is_counted_as_a_bad_request(cluster, side, code):
    """A prefill or decode that refuses the request as invalid failed nothing: the client
    gets that status with the upstream's message, and the router counts the abort as
    bad_request, not as prefill_error or decode_error."""
    stub, prefill, decodes, p_addr, d_addrs, router = cluster
    port, stop = start_metrics_server(router.metrics.registry, "127.0.0.1", 0)
    try:
        if side == "prefill":
            prefill.fail = (code, "sampling.top_k must be >= 0, got -3")
            for d in decodes:
                d.wait_forever = True  # only the prefill's refusal can end this request
        else:
            prefill.hang = True  # only the decode's refusal can end this request
            for d in decodes:
                d.fail_after, d.fail = 0, (code, "sampling.top_k must be >= 0, got -3")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub.Generate(generate_pb2.GenerateRequest(prompt="x")))
        assert err.value.code() == code
        upstream = p_addr if side == "prefill" else d_addrs[0]
        assert err.value.details() == f"{side} {upstream} failed: {code.name}: sampling.top_k must be >= 0, got -3"
        await wait_for(lambda: router.active == 0, 10.0)
        s = await asyncio.to_thread(scrape, f"127.0.0.1:{port}")
        r = {"role": "router"}
        assert s.value("pdgrpc_requests_total", state="aborted", **r) == 1
        assert s.value("pdgrpc_aborts_total", reason="bad_request", **r) == 1
        for other in ("prefill_error", "decode_error", "cancelled", "internal_error"):
            assert s.value("pdgrpc_aborts_total", reason=other, **r) == 0, other
    finally:
        stop()


async def test_a_dead_upstream_is_counted_as_a_peer_failure(cluster):
    """Audit (issue 16): the requests of a killed prefill worker were counted as cancelled.
    An upstream that answers UNAVAILABLE (its worker died) is counted as peer_failure."""
    stub, prefill, decodes, *_, router = cluster
    port, stop = start_metrics_server(router.metrics.registry, "127.0.0.1", 0)
    try:
        prefill.fail = (grpc.StatusCode.UNAVAILABLE, "room 1: prefill worker dp0 died (exit code -9)")
        for d in decodes:
            d.wait_forever = True  # only the prefill's failure can end this request
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub.Generate(generate_pb2.GenerateRequest(prompt="x")))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "dp0 died" in err.value.details()
        s = await asyncio.to_thread(scrape, f"127.0.0.1:{port}")
        assert s.value("pdgrpc_aborts_total", reason="peer_failure", role="router") == 1
        assert s.value("pdgrpc_aborts_total", reason="cancelled", role="router") == 0
    finally:
        stop()


async def test_one_client_holds_at_most_its_limit_of_open_requests():
    """The prefills and decodes count the router as one client: one of its clients holding
    every request the router may have open there would refuse every other client's. Past
    --max-requests-per-client, a client's next request is refused; one that ends frees its place."""
    prefill, decode = ScriptedPrefill(), ScriptedDecode()
    decode.wait_forever = True
    p_srv, d_srv = await serve_prefill(prefill), await serve_decode(decode)
    router = GenerateServicer(RouterConfig(
        prefills=(PrefillBackend(p_srv.address, "127.0.0.1:1"),), decodes=(d_srv.address,), max_requests_per_client=2,
    ))
    (name,) = service_names()
    r_srv = await start_server([(name, lambda s: generate_pb2_grpc.add_GenerateServiceServicer_to_server(router, s))])
    try:
        async with grpc.aio.insecure_channel(r_srv.address) as channel:
            stub = generate_pb2_grpc.GenerateServiceStub(channel)
            held = [stub.Generate(generate_pb2.GenerateRequest(prompt="hi", request_id=f"h{i}")) for i in range(2)]
            await wait_for(lambda: len(decode.requests) == 2, 10)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub.Generate(generate_pb2.GenerateRequest(prompt="hi", request_id="third")))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "already has 2 Generate calls open (limit 2 per client, --max-requests-per-client)" in err.value.details()
            assert len(decode.requests) == 2  # the refused one reached nobody
            held[0].cancel()
            decode.wait_forever = False
            await wait_for(lambda: router.active == 1, 10)
            assert [t for m in await collect(stub.Generate(generate_pb2.GenerateRequest(prompt="hi"))) for t in m.token_ids] == [104, 105]
            held[1].cancel()
    finally:
        await router.close()
        for s in (r_srv, p_srv, d_srv):
            await s.stop(0)
