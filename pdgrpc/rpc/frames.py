"""Length-prefixed frames on a stream socket: the framing of pdgrpc's own links.

A frame is a 13-byte header ``<IBQ`` (payload length in bytes, kind, call id), then the
payload. :class:`Framed` splits what a socket delivers into frames and hands each to its
subclass; what the kinds mean is the subclass's protocol (the prefill controller's link to
its workers, :mod:`pdgrpc.prefill.link`; the local socket, :mod:`pdgrpc.rpc.local`). A
frame that breaks the protocol closes the connection, logged.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from typing import cast

__all__ = ["HEAD", "MAX_PAYLOAD", "Framed", "frame"]

log = logging.getLogger("pdgrpc.rpc.frames")

HEAD = struct.Struct("<IBQ")
# Far above any real request (a 1M-token prompt is ~5 MB): a larger length is a broken peer.
MAX_PAYLOAD = 256 * 1024 * 1024


def frame(kind: int, call_id: int, payload: bytes = b"") -> bytes:
    return HEAD.pack(len(payload), kind, call_id) + payload


class Framed(asyncio.Protocol):
    """Splits the byte stream into frames; a subclass handles each one (:meth:`_frame`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._closed = False
        self._queued: list[bytes] = []  # frames for the write at the end of this loop pass

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos = 0
        while len(buf) - pos >= HEAD.size:
            length, kind, call_id = HEAD.unpack_from(buf, pos)
            if length > MAX_PAYLOAD:
                self._broken(f"frame of {length} bytes (limit {MAX_PAYLOAD})")
                return
            end = pos + HEAD.size + length
            if len(buf) < end:
                break
            payload = bytes(buf[pos + HEAD.size : end])
            pos = end
            try:
                self._frame(kind, call_id, payload)
            except Exception as exc:  # a payload that does not parse, an unknown kind
                self._broken(f"bad frame (kind {kind}, call {call_id}): {exc!r}")
                return
        del buf[:pos]

    def _broken(self, why: str) -> None:
        log.error("%s: closing the link: %s", self.name, why)
        self._buf.clear()
        self.close_socket()

    def _send(self, data: bytes) -> None:
        """Write ``data`` now, after any frames queued before it (their order holds)."""
        if self._queued:
            self._queued.append(data)
            data = b"".join(self._queued)
            self._queued.clear()
        # Not to a transport being closed: uvloop raises once its handle is gone.
        if self._transport is not None and not self._closed and not self._transport.is_closing():
            self._transport.write(data)

    def _send_soon(self, data: bytes) -> None:
        """Write ``data`` once the loop's pass ends, in one write with every frame queued in it.

        One pass often produces a frame per call (a decode step's token for each of its
        streams); one system call for all of them, and one wake-up of the reader, costs
        less than one per frame. The frame waits only for the callbacks already due."""
        if self._transport is None or self._closed or self._transport.is_closing():
            return
        self._queued.append(data)
        if len(self._queued) == 1:
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        if self._queued:
            self._send(b"")

    def close_socket(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    def _frame(self, kind: int, call_id: int, payload: bytes) -> None:
        raise NotImplementedError
