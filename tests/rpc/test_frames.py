"""pdgrpc.rpc.frames: frames queued in one loop pass leave in one write, in order, and a
frame sent at once carries the queued ones ahead of it."""

from __future__ import annotations

import asyncio
from pdgrpc.rpc.frames import Framed, frame


class _Transport:
    """Records each write; ``close`` ends the connection as a socket's would."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True


class _Link(Framed):
    def __init__(self) -> None:
        super().__init__("test link")
        self.transport = _Transport()
        self.connection_made(self.transport)  # type: ignore[arg-type]

    def send(self, data: bytes) -> None:
        self._send(data)

    def send_soon(self, data: bytes) -> None:
        self._send_soon(data)

    def lose(self) -> None:
        self._closed = True

    def _frame(self, kind: int, call_id: int, payload: bytes) -> None:
        raise AssertionError("nothing is read here")


async def test_frames_queued_in_one_pass_leave_in_one_write_in_order() -> None:
    link = _Link()
    a, b, c = frame(3, 1, b"a"), frame(3, 2, b"b"), frame(4, 1)
    link.send_soon(a)
    link.send_soon(b)
    link.send_soon(c)
    assert link.transport.writes == []  # not before the pass ends
    await asyncio.sleep(0)
    assert link.transport.writes == [a + b + c]
    await asyncio.sleep(0)
    assert link.transport.writes == [a + b + c]  # written once


async def test_a_frame_sent_at_once_goes_after_the_queued_ones() -> None:
    link = _Link()
    a, b = frame(3, 1, b"later"), frame(3, 2, b"first token")
    link.send_soon(a)
    link.send(b)
    assert link.transport.writes == [a + b]
    await asyncio.sleep(0)
    assert link.transport.writes == [a + b]  # the pass's flush finds nothing left


async def test_a_connection_lost_before_the_pass_ends_writes_nothing() -> None:
    link = _Link()
    link.send_soon(frame(3, 1, b"a"))
    link.lose()
    await asyncio.sleep(0)
    link.send_soon(frame(3, 1, b"b"))
    await asyncio.sleep(0)
    assert link.transport.writes == []


async def test_a_socket_closed_before_the_pass_ends_is_not_written() -> None:
    # uvloop refuses a write to a transport it is closing (RuntimeError in the flush).
    link = _Link()
    link.send_soon(frame(3, 1, b"a"))
    link.close_socket()
    await asyncio.sleep(0)
    link.send(frame(4, 1))
    assert link.transport.writes == []
