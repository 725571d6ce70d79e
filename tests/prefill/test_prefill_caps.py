"""Per-client cap on open ``Prefill`` calls (issue 16: a per-peer cap on rooms in flight).

Each open ``Prefill`` holds a room on the prefill (it waits for the decode's handshake,
then for pages, computes and transfers), so one client with many open calls could hold
all of them. A real grpc.aio server on 127.0.0.1 serves ``WirePrefillServicer`` -- what a
controller and each worker serve PrefillService as -- over an inner service that holds
every call until the test lets it go."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import AsyncIterator

import grpc
import pytest

from pdgrpc.prefill.link import FirstToken
from pdgrpc.prefill.services import WirePrefillServicer
from pdgrpc.serving.room_proof import draw_secret
from pdgrpc.v1 import prefill_pb2, prefill_pb2_grpc


class _Held:
    """An inner PrefillService whose calls wait for ``release``."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.entered = 0

    async def Prefill(  # noqa: N802
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext, first_token: FirstToken | None = None
    ) -> prefill_pb2.PrefillResponse:
        self.entered += 1
        if first_token is not None:
            first_token(request.input_ids[-1] + 100)  # sampled before anything is held up
        await self.release.wait()
        return prefill_pb2.PrefillResponse(prompt_tokens=len(request.input_ids))

    async def GetStats(self, request: prefill_pb2.GetStatsRequest, context: grpc.aio.ServicerContext) -> prefill_pb2.GetStatsResponse:  # noqa: N802
        return prefill_pb2.GetStatsResponse()


@pytest.fixture
async def served() -> AsyncIterator[tuple[_Held, list[int], prefill_pb2_grpc.PrefillServiceStub]]:
    inner, refused = _Held(), [0]
    server = grpc.aio.server()
    wire = WirePrefillServicer(inner, lambda: refused.__setitem__(0, refused[0] + 1), max_per_client=2)
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(wire, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield inner, refused, prefill_pb2_grpc.PrefillServiceStub(channel)
    finally:
        inner.release.set()
        await channel.close()
        await server.stop(None)


def _request(room: int) -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(bootstrap_room=room, input_ids=[1, 2, 3], room_secret=draw_secret())


async def test_one_client_cannot_hold_more_than_its_share_of_prefill_calls(
    served: tuple[_Held, list[int], prefill_pb2_grpc.PrefillServiceStub],
) -> None:
    inner, refused, stub = served
    held = [asyncio.ensure_future(stub.Prefill(_request(room), timeout=30)) for room in (11, 12)]
    while inner.entered < 2:
        await asyncio.sleep(0.01)
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await stub.Prefill(_request(13), timeout=30)
    assert ei.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "already has 2 Prefill calls open" in ei.value.details()
    assert "--max-prefills-per-client" in ei.value.details()
    assert refused == [1] and inner.entered == 2  # refused before it reached the prefill
    # The calls already open are not harmed, and once they end the client may call again.
    inner.release.set()
    assert [r.prompt_tokens for r in await asyncio.gather(*held)] == [3, 3]
    assert (await stub.Prefill(_request(14), timeout=30)).prompt_tokens == 3


async def test_prefill_stream_counts_against_the_same_cap_and_sends_its_token_ahead(
    served: tuple[_Held, list[int], prefill_pb2_grpc.PrefillServiceStub],
) -> None:
    inner, refused, stub = served
    streams = [stub.PrefillStream(_request(room), timeout=30) for room in (21, 22)]
    for call in streams:  # the first token, while the call is still held open
        assert list((await call.read()).token_ids) == [103]
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await stub.Prefill(_request(23), timeout=30)
    assert ei.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and refused == [1]
    inner.release.set()
    for call in streams:
        last = await call.read()
        assert not last.token_ids and last.reply.prompt_tokens == 3
        assert await call.read() is grpc.aio.EOF


def test_the_cap_is_a_documented_flag_passed_to_every_worker() -> None:
    out = subprocess.run([sys.executable, "-m", "pdgrpc.prefill", "--help"], capture_output=True, text=True, check=True).stdout
    assert "--max-prefills-per-client" in out
    from pdgrpc.prefill.cli import build_parser, worker_argv

    ns = build_parser().parse_args(["--max-prefills-per-client", "7"])
    argv = worker_argv(ns)
    assert argv[argv.index("--max-prefills-per-client") + 1] == "7"
