"""The controller <-> worker link (:mod:`pdgrpc.prefill.link`) over a real socketpair.

Both ends run in one loop; the worker's ``prefill`` is a stand-in, so each test controls
when and how a call ends. What the controller relies on: answers reach the right caller,
the worker's status arrives unchanged, cancelling a caller cancels the worker's call,
a closed socket fails every call in flight (and tells the worker to stop), and bytes
that break the framing close the link instead of being guessed at.
"""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from pdgrpc.prefill.errors import RequestFailed, WorkerLinkLost
from pdgrpc.prefill.link import ControllerLink, FirstToken, LinkCallFailed, WorkerLinkServer
from pdgrpc.rpc.frames import MAX_PAYLOAD
from pdgrpc.v1 import prefill_pb2


class _Worker:
    """``prefill`` that waits until the test releases the room (or fails it)."""

    def __init__(self) -> None:
        self.started: dict[int, asyncio.Event] = {}
        self.release: dict[int, asyncio.Future[None]] = {}
        self.cancelled: list[int] = []
        self.asked: dict[int, bool] = {}  # by room: whether the call asked for its first token

    def _of(self, room: int) -> asyncio.Future[None]:
        if room not in self.release:
            self.release[room] = asyncio.get_running_loop().create_future()
            self.started[room] = asyncio.Event()
        return self.release[room]

    async def prefill(self, req: prefill_pb2.PrefillRequest, first_token: FirstToken | None = None) -> prefill_pb2.PrefillResponse:
        fut = self._of(req.bootstrap_room)
        self.asked[req.bootstrap_room] = first_token is not None
        if first_token is not None:
            first_token(req.bootstrap_room + 1000)  # sampled before the pages are written
        self.started[req.bootstrap_room].set()
        try:
            await fut
        except asyncio.CancelledError:
            self.cancelled.append(req.bootstrap_room)
            raise
        return prefill_pb2.PrefillResponse(dp_rank=3, prompt_tokens=len(req.input_ids), bytes_transferred=req.bootstrap_room)

    async def wait_started(self, room: int) -> None:
        self._of(room)
        await asyncio.wait_for(self.started[room].wait(), 5)

    async def wait_cancelled(self) -> list[int]:
        """The rooms whose call was cancelled, once there is one (bounded: 1 s)."""
        for _ in range(100):
            if self.cancelled:
                break
            await asyncio.sleep(0.01)
        return self.cancelled


async def _started(link: ControllerLink, w: _Worker, room: int) -> asyncio.Future[prefill_pb2.PrefillResponse]:
    """A call of ``room`` that the worker is running."""
    call = asyncio.ensure_future(link.prefill(_req(room)))
    await w.wait_started(room)
    return call


async def _pair(worker: _Worker) -> tuple[ControllerLink, WorkerLinkServer, asyncio.Event]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    lost = asyncio.Event()
    server = await WorkerLinkServer.open(b, "dp0", worker.prefill, on_lost=lost.set)
    link = await ControllerLink.open(a, "dp0")
    return link, server, lost


def _req(room: int, n: int = 5) -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(bootstrap_room=room, input_ids=list(range(n)))


async def test_each_answer_reaches_its_own_caller() -> None:
    w = _Worker()
    link, server, _ = await _pair(w)
    calls = {room: asyncio.ensure_future(link.prefill(_req(room, room))) for room in (11, 12, 13)}
    for room in calls:
        await w.wait_started(room)
    assert link.in_flight == 3 and server.in_flight == 3
    for room in (13, 11, 12):  # answered out of order
        w.release[room].set_result(None)
        resp = await asyncio.wait_for(calls[room], 5)
        assert (resp.bytes_transferred, resp.prompt_tokens, resp.dp_rank) == (room, room, 3)
    assert link.in_flight == 0 and server.in_flight == 0
    link.close_socket()


async def test_a_call_that_asks_gets_its_first_token_before_the_answer() -> None:
    w = _Worker()
    link, _, _ = await _pair(w)
    tokens: dict[int, list[int]] = {14: [], 15: []}
    asking = asyncio.ensure_future(link.prefill(_req(14), first_token=tokens[14].append))
    plain = asyncio.ensure_future(link.prefill(_req(15)))
    for room in (14, 15):
        await w.wait_started(room)
    await asyncio.sleep(0.05)  # the FIRST frame is on its way, if there is one
    assert tokens[14] == [1014] and not asking.done()  # ahead of the answer, to its own call
    assert w.asked == {14: True, 15: False}  # a plain CALL does not ask
    for room in (14, 15):
        w.release[room].set_result(None)
    assert (await asyncio.wait_for(asking, 5)).bytes_transferred == 14
    assert (await asyncio.wait_for(plain, 5)).bytes_transferred == 15
    assert tokens == {14: [1014], 15: []}
    link.close_socket()


async def test_the_workers_status_arrives_unchanged() -> None:
    w = _Worker()
    link, server, _ = await _pair(w)
    call = await _started(link, w, 21)
    w.release[21].set_exception(RequestFailed(grpc.StatusCode.FAILED_PRECONDITION, "room 21: pages gone — ünïcode kept"))
    with pytest.raises(LinkCallFailed) as ei:
        await asyncio.wait_for(call, 5)
    assert ei.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert ei.value.message == "room 21: pages gone — ünïcode kept"
    # A bug in the worker is an INTERNAL answer, and the link keeps serving.
    call = await _started(link, w, 22)
    w.release[22].set_exception(ZeroDivisionError("oops"))
    with pytest.raises(LinkCallFailed) as ei:
        await asyncio.wait_for(call, 5)
    assert ei.value.code is grpc.StatusCode.INTERNAL and "ZeroDivisionError" in ei.value.message
    call = await _started(link, w, 23)
    w.release[23].set_result(None)
    assert (await asyncio.wait_for(call, 5)).bytes_transferred == 23
    link.close_socket()


async def test_cancelling_the_caller_cancels_the_workers_call_only() -> None:
    w = _Worker()
    link, server, lost = await _pair(w)
    doomed = await _started(link, w, 31)
    other = await _started(link, w, 32)
    doomed.cancel()
    with pytest.raises(asyncio.CancelledError):
        await doomed
    assert await w.wait_cancelled() == [31]
    assert server.in_flight == 1 and not lost.is_set()
    w.release[32].set_result(None)
    assert (await asyncio.wait_for(other, 5)).bytes_transferred == 32
    link.close_socket()


async def test_a_closed_link_fails_every_call_and_stops_the_worker() -> None:
    w = _Worker()
    link, server, lost = await _pair(w)
    calls = [await _started(link, w, room) for room in (41, 42)]
    server.close_socket()  # what the worker's exit does to the controller's end
    for call in calls:
        with pytest.raises(WorkerLinkLost, match="dp0"):
            await asyncio.wait_for(call, 5)
    assert link.lost.is_set() and link.in_flight == 0
    with pytest.raises(WorkerLinkLost, match="closed"):
        await link.prefill(_req(43))
    # The worker side: its calls were cancelled, and it was told to stop.
    await asyncio.wait_for(lost.wait(), 5)
    await asyncio.sleep(0)
    assert sorted(w.cancelled) == [41, 42] and server.in_flight == 0


async def test_the_controller_going_away_cancels_the_workers_calls() -> None:
    w = _Worker()
    link, server, lost = await _pair(w)
    await _started(link, w, 51)
    link.close_socket()
    await asyncio.wait_for(lost.wait(), 5)
    assert await w.wait_cancelled() == [51]


async def test_a_stopping_worker_lets_calls_finish_and_refuses_new_ones() -> None:
    w = _Worker()
    link, server, _ = await _pair(w)
    running = await _started(link, w, 61)
    draining = asyncio.ensure_future(server.close(grace=5.0, cancel=False))
    with pytest.raises(LinkCallFailed) as ei:
        await asyncio.wait_for(link.prefill(_req(62)), 5)
    assert ei.value.code is grpc.StatusCode.UNAVAILABLE and "room 62" in ei.value.message and "stopping" in ei.value.message
    w.release[61].set_result(None)
    assert (await asyncio.wait_for(running, 5)).bytes_transferred == 61
    await asyncio.wait_for(draining, 5)
    # After the grace: what still runs is cancelled and the socket closes.
    late = asyncio.ensure_future(link.prefill(_req(63)))
    with pytest.raises(LinkCallFailed):
        await asyncio.wait_for(late, 5)
    await server.close(grace=0.0)
    await asyncio.wait_for(link.lost.wait(), 5)


@pytest.mark.parametrize(
    "garbage",
    [
        (MAX_PAYLOAD + 1).to_bytes(4, "little") + bytes([3]) + (1).to_bytes(8, "little"),  # absurd length
        (4).to_bytes(4, "little") + bytes([9]) + (1).to_bytes(8, "little") + b"abcd",  # unknown kind
        (3).to_bytes(4, "little") + bytes([3]) + (1).to_bytes(8, "little") + b"\xff\xff\xff",  # REPLY that is not a message
    ],
    ids=["oversized", "unknown-kind", "unparsable"],
)
async def test_a_frame_that_breaks_the_protocol_closes_the_link(garbage: bytes, caplog: pytest.LogCaptureFixture) -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    link = await ControllerLink.open(a, "dp7")
    call = asyncio.ensure_future(link.prefill(_req(71)))
    await asyncio.sleep(0.01)
    b.sendall(garbage)
    with pytest.raises(WorkerLinkLost):
        await asyncio.wait_for(call, 5)
    assert "dp7: closing the link" in caplog.text
    b.close()


async def test_a_traced_call_runs_under_the_controllers_span_in_the_worker(tmp_path, monkeypatch) -> None:
    """The span context crosses the link (a TRACED frame): the worker's span and the hops
    its call records are children of the controller's span, in the same trace."""
    from pdgrpc.rpc import tracing

    monkeypatch.setattr(tracing, "enabled", False)  # restored after the test: tracing is process-wide
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_on")
    tracing.setup_tracing(f"file:{tmp_path}", "test")

    async def prefill(req: prefill_pb2.PrefillRequest, first_token: FirstToken | None = None) -> prefill_pb2.PrefillResponse:
        tracing.hop("compute")
        return prefill_pb2.PrefillResponse(prompt_tokens=len(req.input_ids))

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    server = await WorkerLinkServer.open(b, "dp0", prefill)
    link = await ControllerLink.open(a, "dp0")
    try:
        caller = tracing.server("controller.dispatch", None)
        assert (await link.prefill(_req(81), caller.pack())).prompt_tokens == 5
        assert (await link.prefill(_req(82))).prompt_tokens == 5  # untraced: a plain CALL, no span
        caller.end()
    finally:
        link.close_socket()
        await server.close()
        await asyncio.sleep(0)  # spans are made on the loop's next turn
        tracing.shutdown()
    spans = {s["name"]: s for s in tracing.read_spans(tmp_path)}
    assert sorted(spans) == ["compute", "controller.dispatch", "worker"]
    assert spans["worker"]["parent_id"] == spans["controller.dispatch"]["span_id"]
    assert spans["compute"]["parent_id"] == spans["worker"]["span_id"]
    assert len({s["trace_id"] for s in spans.values()}) == 1


async def test_the_workers_kv_event_batches_reach_the_controller_in_order_between_calls() -> None:
    """Each batch the worker sends arrives once, in order, beside the calls; a link that
    follows no events (a TP group's other ranks) drops them and its calls go on."""
    w = _Worker()
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    got: list[bytes] = []
    server = await WorkerLinkServer.open(b, "dp0", w.prefill)
    link = await ControllerLink.open(a, "dp0", on_events=got.append)
    batches = [prefill_pb2.KvEventBatch(sequence_number=i, timestamp=float(i)).SerializeToString() for i in (1, 2, 3)]
    server.send_events(batches[0])
    call = await _started(link, w, 7)
    server.send_events(batches[1])
    server.send_events(batches[2])
    w.release[7].set_result(None)
    assert (await asyncio.wait_for(call, 5)).bytes_transferred == 7
    assert got == batches

    a2, b2 = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    deaf_server = await WorkerLinkServer.open(b2, "dp0.tp1", w.prefill)
    deaf = await ControllerLink.open(a2, "dp0.tp1")
    deaf_server.send_events(batches[0])
    call = await _started(deaf, w, 8)
    w.release[8].set_result(None)
    assert (await asyncio.wait_for(call, 5)).bytes_transferred == 8
    for end in (link, server, deaf, deaf_server):
        end.close_socket()
