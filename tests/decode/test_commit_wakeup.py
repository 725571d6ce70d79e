"""A transfer that lands commits at once: the transport's news wakes the decode, not the
loop's periodic poll.

An in-process decode server whose loop would otherwise look again only after a minute
(``idle_poll_s=60``) against the fake prefill, which writes the KV and the metadata row
a while after it accepted the handshake (so the handshake's own wake-up finds nothing).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc

from pdgrpc.decode.job import Job, SchedulerConfig, Tokens
from pdgrpc.decode.scheduler import DecodeScheduler
from pdgrpc.decode.service import start_decode_server
from pdgrpc.engine.base import SamplingParams
from pdgrpc.engine.reference import ReferenceEngine
from pdgrpc.serving.convert import room_from_proto
from pdgrpc.state import DecodeDeadlines, DecodeState
from pdgrpc.transport.tcp import TcpTransport
from pdgrpc.v1 import decode_pb2_grpc
from tests.decode.fake_prefill import FakePrefill
from tests.decode.test_deadlines import CFG, wait_idle
from tests.decode.test_decode_server import collect, make_request
from tests.eventually import eventually_async


async def test_landed_kv_commits_without_waiting_for_the_next_periodic_poll() -> None:
    server = await start_decode_server(DecodeScheduler(ReferenceEngine(CFG), TcpTransport(), 4, SchedulerConfig(idle_poll_s=60.0)))
    prefill = await FakePrefill(ReferenceEngine(CFG)).start()
    try:
        prefill.send_delay_s = 0.3
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = decode_pb2_grpc.DecodeServiceStub(channel)
            start = time.monotonic()
            msgs = await asyncio.wait_for(collect(stub, make_request(prefill, "hello there", 3)), 20)
            took = time.monotonic() - start
        assert [len(m.token_ids) for m in msgs] == [1, 1, 1] and msgs[-1].finish_reason == "length"
        assert msgs[0].bytes_transferred > 0  # the first token came through the transfer
        assert took < 20  # a minute if only the periodic poll noticed the transfer
        await wait_idle(server)
    finally:
        await prefill.stop()
        await server.stop(grace=0)


async def test_a_decode_waiting_for_a_transfer_sleeps_until_it_lands() -> None:
    """Events wake the loop (the handshake's answer, the transfer's end), not a timer: a
    request whose KV comes after half a second costs a handful of loop passes, not one
    per ``idle_poll_s``."""
    sched = DecodeScheduler(ReferenceEngine(CFG), TcpTransport(), 4, SchedulerConfig(idle_poll_s=0.01))
    server = await start_decode_server(sched)
    prefill = await FakePrefill(ReferenceEngine(CFG)).start()
    ticks: list[float] = []
    tick = sched.queues.tick
    sched.queues.tick = lambda now: (ticks.append(now), tick(now))[1]  # type: ignore[method-assign]
    try:
        prefill.send_delay_s = 0.5
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = decode_pb2_grpc.DecodeServiceStub(channel)
            msgs = await asyncio.wait_for(collect(stub, make_request(prefill, "hello there", 2)), 20)
        assert [len(m.token_ids) for m in msgs] == [1, 1] and msgs[0].bytes_transferred > 0
        assert len(ticks) < 12, len(ticks)  # polling every 10 ms: over 50
        await wait_idle(server)
    finally:
        await prefill.stop()
        await server.stop(grace=0)



async def test_a_slot_back_from_quarantine_goes_to_the_request_waiting_for_it() -> None:
    """The one slot is quarantined under an aborted room; once the prefill acknowledged
    the abort, the request queued behind it gets the slot at once, not at its allocation
    deadline (a minute here)."""
    deadlines = DecodeDeadlines(allocate_s=60.0)
    sched = DecodeScheduler(ReferenceEngine(CFG), TcpTransport(), 1, SchedulerConfig(deadlines=deadlines))
    server = await start_decode_server(sched)
    prefill = await FakePrefill(ReferenceEngine(CFG)).start()

    async def submit(prompt: str) -> Job:
        req = make_request(prefill, prompt, 3)
        return await sched.submit(
            room_from_proto(req.bootstrap_room), req.request_id, tuple(req.input_ids), SamplingParams(), 3, prefill.address, None,
            req.room_secret,
        )

    try:
        prefill.mode = "hold"  # accepts the first handshake and never writes
        first = await submit("hello there")
        await asyncio.wait_for(prefill.workers[0].got_handshake.wait(), 20)
        prefill.mode = "ok"
        second = await submit("general kenobi")
        await eventually_async(lambda: sched.queues.state_of(second.room) is DecodeState.WAITING_FOR_MEMORY, 10)
        sched.cancel(first.room, "the client went away")  # its slot stays quarantined until the ack
        await asyncio.wait_for(prefill.workers[0].got_abort.wait(), 20)
        token = await asyncio.wait_for(second.out.get(), 20)  # a minute if the slot waited for the deadline
        assert isinstance(token, Tokens) and token.bytes_transferred > 0
        await wait_idle(server)
    finally:
        await prefill.stop()
        await server.stop(grace=0)

class _Followers:
    """A TP group of rank 0 whose followers are only counted: what rank 0 sends them."""

    rank, size = 0, 2

    def __init__(self) -> None:
        self.sent: list[str] = []

    def broadcast(self, cmd: Any = None) -> Any:
        self.sent.append(cmd[0])
        return cmd

    def all_reduce_min(self, t: Any) -> Any:
        return t

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj, obj]

    def close(self) -> None:
        pass


async def test_an_idle_tp_decode_keeps_its_followers_in_sync() -> None:
    """The followers wait in a collective that times out (--dist-timeout) unless rank 0
    syncs them: an idle rank 0 still syncs them every second."""
    followers = _Followers()
    sched = DecodeScheduler(ReferenceEngine(CFG), TcpTransport(), 4, SchedulerConfig(), tp=followers)  # type: ignore[arg-type]
    await sched.start()
    try:
        await asyncio.sleep(0.2)
        before = followers.sent.count("sync")
        await asyncio.sleep(2.5)
        assert followers.sent.count("sync") - before >= 2
    finally:
        await sched.close()
