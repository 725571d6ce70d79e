"""A gateway request that names another request's ``bootstrap_room`` cannot end it.

smg's ``Abort`` on a decode ends the decode stream of the aborted request's room. A second
caller that sends a ``Generate`` with a room already in flight, and aborts its own request
while the decode still holds that call (waiting for its page share, say), would end the
first caller's stream. The facade refuses a room one of its requests holds, at once, so
an abort only ever reaches its own request's room.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import grpc
import pytest

pytest.importorskip("smg_grpc_proto", reason="the gateway extra (pdgrpc[gateway]) is not installed")

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb  # noqa: E402

from pdgrpc.engine.tokenizer import ByteTokenizer  # noqa: E402
from pdgrpc.errors import RequestFailed  # noqa: E402
from pdgrpc.gateway.servicer import DecodeLeg, WorkerInfo  # noqa: E402
from pdgrpc.v1 import decode_pb2  # noqa: E402
from tests.servicer_context import Context, Refused  # noqa: E402

pytestmark = pytest.mark.timeout(30)


class Decode:
    """A decode server as the facade drives it: the first request of a room waits for its
    KV; a later one of the same room waits (for its page share) until ``admit`` is set,
    then is refused as the real decode refuses a room in use. ``end_stream`` ends the
    stream of whichever request holds the room, as the real scheduler's does."""

    def __init__(self) -> None:
        self.scheduler = self
        self.streams: dict[int, asyncio.Queue[Any]] = {}
        self.admit = asyncio.Event()

    def end_stream(self, room: int, failure: RequestFailed) -> bool:
        out = self.streams.get(room)
        if out is None:
            return False
        out.put_nowait(failure)
        return True

    async def Decode(self, request: decode_pb2.DecodeRequest, context: Context) -> AsyncIterator[decode_pb2.DecodeResponse]:  # noqa: N802
        room = request.bootstrap_room
        if room in self.streams:
            await self.admit.wait()
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"bootstrap_room {room} is already in use on this decode")
        out = self.streams[room] = asyncio.Queue()
        try:
            item = await out.get()
            await context.abort(item.code, item.message)
            yield decode_pb2.DecodeResponse()
        finally:
            del self.streams[room]


def request(request_id: str, room: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id, tokenized=pb.TokenizedInput(input_ids=[256, 104]), logprob_start_len=-1, stream=True,
        sampling_params=pb.SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=4, n=1),
        disaggregated_params=pb.DisaggregatedParams(bootstrap_host="127.0.0.1", bootstrap_port=4000, bootstrap_room=room),
    )


async def drain(stream: AsyncIterator[Any]) -> None:
    async for _ in stream:
        pass


async def test_an_abort_of_a_request_on_a_room_in_flight_leaves_that_rooms_request_running() -> None:
    info = WorkerInfo(mode="decode", served_model_name="m", transport="tcp", max_seq_len=64, max_prompt_tokens=32,
                      max_running_requests=4, bootstrap_port=0, tokenizer=ByteTokenizer())
    decode = Decode()
    leg = DecodeLeg(decode, lambda: info, active=lambda: 0, healthy=lambda: True)
    victim, attacker = Context("smg-a"), Context("smg-b")
    running = asyncio.ensure_future(drain(leg.Generate(request("victim", 9), victim)))
    await asyncio.sleep(0.05)  # the victim's request waits for its KV
    colliding = asyncio.ensure_future(drain(leg.Generate(request("mine", 9), attacker)))
    await asyncio.sleep(0.05)
    reply = await leg.Abort(pb.AbortRequest(request_id="mine", reason="x"), attacker)
    decode.admit.set()
    with pytest.raises(Refused) as info_:
        await colliding
    assert info_.value.code is grpc.StatusCode.ALREADY_EXISTS
    assert "bootstrap_room 9" in info_.value.message, info_.value.message
    assert not reply.success
    await asyncio.sleep(0.05)
    assert not running.done()  # the victim's request still waits for its KV
    assert (await leg.Abort(pb.AbortRequest(request_id="victim"), victim)).success
    with pytest.raises(Refused) as ended:
        await running
    assert ended.value.code is grpc.StatusCode.CANCELLED
