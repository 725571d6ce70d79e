"""A request whose prefill or decode is unavailable before its first token (the process
is gone, unreachable, or its worker died: UNAVAILABLE) is sent again, with a fresh room,
to another instance of that role (``--retries``, default 1). Real gRPC servers on real
ports; the scripted upstreams of :mod:`tests.router.test_router`."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from pdgrpc.metrics import start_metrics_server
from tests.scrape import scrape
from pdgrpc.router.service import GenerateServicer, PrefillBackend, RouterConfig, service_names
from pdgrpc.rpc.server import start_server
from pdgrpc.serving.kv_events import LOCAL_PREFILL
from pdgrpc.state.cache_events import StoredBlock
from pdgrpc.state.prefix_index import PrefixIndex
from pdgrpc.v1 import generate_pb2, generate_pb2_grpc
from tests.router.test_router import ScriptedDecode, ScriptedPrefill, collect, serve_decode, serve_prefill, wait_for

pytestmark = pytest.mark.timeout(60)

DEAD = "127.0.0.1:1"  # nothing listens there: connection refused, UNAVAILABLE


class Upstreams:
    """Two scripted prefills and two scripted decodes on real ports, and a router over
    them (built per test by :meth:`router`)."""

    def __init__(self) -> None:
        self.prefills = [ScriptedPrefill(), ScriptedPrefill()]
        self.decodes = [ScriptedDecode(), ScriptedDecode()]
        self.servers: list = []
        self.routers: list[GenerateServicer] = []
        self.channels: list[grpc.aio.Channel] = []
        self.p_addrs: list[str] = []
        self.d_addrs: list[str] = []

    async def start(self) -> None:
        for p in self.prefills:
            srv = await serve_prefill(p)
            self.servers.append(srv)
            self.p_addrs.append(srv.address)
        for d in self.decodes:
            await self.start_decode(d)

    async def start_decode(self, d: ScriptedDecode) -> None:
        srv = await serve_decode(d)
        self.servers.append(srv)
        self.d_addrs.append(srv.address)

    async def router(
        self, prefills: list[str], decodes: list[str], servicer: dict | None = None, **config
    ) -> tuple[GenerateServicer, generate_pb2_grpc.GenerateServiceStub]:
        """A router over these instances; ``servicer``: GenerateServicer's other arguments."""
        router = GenerateServicer(
            RouterConfig(prefills=tuple(PrefillBackend(a, DEAD) for a in prefills), decodes=tuple(decodes), **config), **(servicer or {})
        )
        (name,) = service_names()
        srv = await start_server([(name, lambda s: generate_pb2_grpc.add_GenerateServiceServicer_to_server(router, s))])
        self.servers.append(srv)
        self.routers.append(router)
        channel = grpc.aio.insecure_channel(srv.address)
        self.channels.append(channel)
        return router, generate_pb2_grpc.GenerateServiceStub(channel)


@pytest.fixture
async def up():
    u = Upstreams()
    await u.start()
    try:
        yield u
    finally:
        for ch in u.channels:
            await ch.close()
        for r in u.routers:
            await r.close()
        for s in u.servers:
            await s.stop(0)


async def test_a_prefill_worker_that_died_is_retried_on_the_other_prefill(up, caplog):
    caplog.set_level(logging.INFO, logger="pdgrpc.router")
    up.prefills[0].fail = (grpc.StatusCode.UNAVAILABLE, "room 1: prefill worker dp0 died (exit code -9)")
    up.decodes[0].wait_forever = True  # the first attempt's decode waits for KV that never comes
    up.prefills[0].gate = up.decodes[0].started  # and the prefill fails once that decode has the request
    router, stub = await up.router(up.p_addrs, up.d_addrs)
    port, stop = start_metrics_server(router.metrics.registry, "127.0.0.1", 0)
    try:
        out = await collect(stub.Generate(generate_pb2.GenerateRequest(prompt="hi", request_id="q1")))
        assert [list(m.token_ids) for m in out] == [[104], [105]]
        (first,), (second,) = up.prefills[0].requests, up.prefills[1].requests
        (d_first,), (d_second,) = up.decodes[0].requests, up.decodes[1].requests
        # A fresh room (and secret) for the second attempt, the same request otherwise.
        assert first.bootstrap_room == d_first.bootstrap_room != second.bootstrap_room == d_second.bootstrap_room
        assert out[0].bootstrap_room == second.bootstrap_room
        assert first.room_secret != second.room_secret
        assert first.request_id == second.request_id == "q1" and list(first.input_ids) == list(second.input_ids)
        # The first attempt's decode was cancelled: it aborts the room and frees its pages.
        await wait_for(lambda: first.bootstrap_room in up.decodes[0].cancelled_at, 10.0)
        assert "retrying on prefill" in caplog.text and "dp0 died" in caplog.text
        s = await asyncio.to_thread(scrape, f"127.0.0.1:{port}")
        assert s.value("pdgrpc_retries_total", role="router") == 1
        assert s.value("pdgrpc_requests_total", role="router", state="finished") == 1
        assert s.value("pdgrpc_aborts_total", reason="peer_failure", role="router") == 0
    finally:
        stop()


async def test_an_unreachable_prefill_or_decode_is_retried_on_another(up):
    up.decodes[0].wait_forever = True  # a decode has no token before its prefill's KV
    _, stub = await up.router([DEAD, up.p_addrs[1]], up.d_addrs)
    out = await collect(stub.Generate(generate_pb2.GenerateRequest(prompt="hi")))
    assert [list(m.token_ids) for m in out] == [[104], [105]]
    assert len(up.prefills[1].requests) == 1 and len(up.decodes[1].requests) == 1

    up.prefills[1].delay = 2.0  # still computing when its decode turns out unreachable
    _, stub = await up.router([up.p_addrs[1]], [DEAD, up.d_addrs[1]])
    out = await collect(stub.Generate(generate_pb2.GenerateRequest(prompt="hi")))
    assert [list(m.token_ids) for m in out] == [[104], [105]]
    # One prefill call per attempt; the first attempt's is cancelled at once (its decode is
    # gone), perhaps before it arrived.
    assert len(up.decodes[1].requests) == 2 and len(up.prefills[1].requests) in (2, 3)
    await asyncio.sleep(0.5)
    assert len(up.prefills[1].cancelled_at) == len(up.prefills[1].requests) - 2


async def test_no_retry_without_another_instance_with_retries_0_or_after_a_token(up):
    up.prefills[0].fail = (grpc.StatusCode.UNAVAILABLE, "room 1: prefill worker dp0 died (exit code -9)")
    for d in up.decodes:
        d.wait_forever = True
    _, stub = await up.router([up.p_addrs[0]], up.d_addrs)  # the only prefill
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub.Generate(generate_pb2.GenerateRequest(prompt="x")))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "dp0 died" in err.value.details()
    assert len(up.prefills[0].requests) == 1

    _, stub = await up.router(up.p_addrs, up.d_addrs, retries=0)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub.Generate(generate_pb2.GenerateRequest(prompt="x")))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert len(up.prefills[0].requests) == 2 and not up.prefills[1].requests

    # After a token reached the client the request is not sent again (it would repeat
    # output the client already has); with migration off the failure reaches the client.
    for d in up.decodes:
        d.wait_forever = False
        d.fail_after, d.fail = 1, (grpc.StatusCode.UNAVAILABLE, "decode going away")
    _, stub = await up.router([up.p_addrs[1]], up.d_addrs, migration_limit=0)
    got = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for m in stub.Generate(generate_pb2.GenerateRequest(prompt="x")):
            got.append(list(m.token_ids))
    # Both decodes fail the same way, so a retry would have shown [104] twice.
    assert got == [[104]] and err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "decode going away" in err.value.details() and len(up.prefills[1].requests) <= 1  # sent once (cancelled at once, perhaps before it arrived)


async def test_other_failures_are_not_retried(up):
    up.prefills[0].fail = (grpc.StatusCode.INVALID_ARGUMENT, "prompt too long for this prefill")
    for d in up.decodes:
        d.wait_forever = True
    _, stub = await up.router(up.p_addrs, up.d_addrs)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub.Generate(generate_pb2.GenerateRequest(prompt="x")))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not up.prefills[1].requests


@pytest.mark.parametrize("retries", [-1, 101])
def test_retries_must_be_in_0_to_100(retries):
    with pytest.raises(ValueError, match=rf"--retries must be in \[0, 100\], got {retries}"):
        RouterConfig(prefills=(PrefillBackend("127.0.0.1:5", DEAD),), decodes=("127.0.0.1:6",), retries=retries)


async def test_a_dead_instance_costs_one_retry_while_it_is_ejected(up, caplog):
    """After a call to it fails UNAVAILABLE, an instance is passed over by the next
    requests (``--eject-s``); without ejection every request meets it first."""
    caplog.set_level(logging.INFO, logger="pdgrpc.router")
    up.decodes[1].gap = 0.2  # no token before the dead prefill's failure is known
    for eject_s, retries in ((30.0, 1), (0.0, 4)):
        router, stub = await up.router([DEAD, up.p_addrs[1]], up.d_addrs[1:], eject_s=eject_s)
        port, stop = start_metrics_server(router.metrics.registry, "127.0.0.1", 0)
        try:
            for _ in range(4):
                out = await collect(stub.Generate(generate_pb2.GenerateRequest(prompt="hi")))
                assert [list(m.token_ids) for m in out] == [[104], [105]]
            s = await asyncio.to_thread(scrape, f"127.0.0.1:{port}")
            assert s.value("pdgrpc_retries_total", role="router") == retries
            assert s.value("pdgrpc_ejections_total", role="router") == (1 if eject_s else 0)
        finally:
            stop()
    assert caplog.text.count(f"ejecting prefill {DEAD} for 30.0 s") == 1

    # A dead decode likewise.
    router, stub = await up.router(up.p_addrs[1:], [DEAD, up.d_addrs[0]])
    for _ in range(3):
        out = await collect(stub.Generate(generate_pb2.GenerateRequest(prompt="hi")))
        assert [list(m.token_ids) for m in out] == [[104], [105]]
    assert f"ejecting decode {DEAD} for 5.0 s" in caplog.text
    assert len(up.decodes[0].requests) == 3  # every request, the first one's retry included


async def test_when_every_instance_is_ejected_requests_still_go_and_a_success_readmits(up, caplog):
    caplog.set_level(logging.INFO, logger="pdgrpc.router")
    up.prefills[0].fail = (grpc.StatusCode.UNAVAILABLE, "room 1: prefill worker dp0 died (exit code -9)")
    up.decodes[0].gap = 0.2
    router, stub = await up.router(up.p_addrs[:1], up.d_addrs[:1], eject_s=30.0)
    with pytest.raises(grpc.aio.AioRpcError) as err:  # ejected, and nowhere else to go
        await collect(stub.Generate(generate_pb2.GenerateRequest(prompt="x")))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    up.prefills[0].fail = None  # its worker is back
    out = await collect(stub.Generate(generate_pb2.GenerateRequest(prompt="x")))
    assert [list(m.token_ids) for m in out] == [[104], [105]]
    assert len(up.prefills[0].requests) == 2
    assert f"prefill {up.p_addrs[0]} answered again; no longer ejected" in caplog.text


async def test_a_local_prefill_readmits_no_prefill_it_never_called(up, caplog):
    """A success ends an ejection only of an instance it called: a request the decode
    prefilled itself (local prefill) says nothing about the ejected prefill it was paired
    with; the next request that the prefill answers readmits it."""
    caplog.set_level(logging.INFO, logger="pdgrpc.router")
    held = [256, *range(1, 16)]  # a page the decode holds: a prompt lacking little of it is prefilled there
    index = PrefixIndex()
    index.stored(up.d_addrs[0], [StoredBlock(1, None, tuple(held))])
    servicer = {"index": index, "decode_capabilities": lambda address: frozenset({LOCAL_PREFILL})}
    router, stub = await up.router(up.p_addrs[:1], up.d_addrs[:1], servicer, eject_s=30.0)
    up.prefills[0].fail = (grpc.StatusCode.UNAVAILABLE, "room 1: prefill worker dp0 died (exit code -9)")
    up.decodes[0].gap = 0.2  # no token before the prefill's failure is known
    with pytest.raises(grpc.aio.AioRpcError):  # ejected, and nowhere else to go
        await collect(stub.Generate(generate_pb2.GenerateRequest(input_ids=[256, 7, 7, 7])))
    readmitted = f"prefill {up.p_addrs[0]} answered again; no longer ejected"

    await collect(stub.Generate(generate_pb2.GenerateRequest(input_ids=[*held, 1, 2])))
    assert up.decodes[0].requests[-1].local_prefill and len(up.prefills[0].requests) == 1
    assert readmitted not in caplog.text

    up.prefills[0].fail = None  # its worker is back
    await collect(stub.Generate(generate_pb2.GenerateRequest(input_ids=[256, 7, 7, 7])))
    assert len(up.prefills[0].requests) == 2
    assert readmitted in caplog.text


def test_eject_s_is_bounded():
    for bad in (-1.0, 3601.0, float("nan")):
        with pytest.raises(ValueError, match="--eject-s must be between 0 and 3600 seconds"):
            RouterConfig(prefills=(PrefillBackend("127.0.0.1:5", DEAD),), decodes=("127.0.0.1:6",), eject_s=bad)


async def test_a_call_cancelled_by_its_stopping_server_is_retried(up):
    """A server that drained stops; a call it took in just then ends CANCELLED, naming no
    reason. The router did not cancel it: the server is going away, so the request goes
    to another instance as for UNAVAILABLE."""
    up.decodes[0].fail_after, up.decodes[0].fail = 0, (grpc.StatusCode.CANCELLED, "CANCELLED")
    _, stub = await up.router(up.p_addrs, up.d_addrs, policy="round_robin")
    out = await collect(stub.Generate(generate_pb2.GenerateRequest(prompt="hi")))
    assert [list(m.token_ids) for m in out] == [[104], [105]]
    assert len(up.decodes[0].requests) == 1 and len(up.decodes[1].requests) == 1
