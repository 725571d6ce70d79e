"""The raw socket baseline of ``bench transport`` for socket backends: one plain blocking
TCP socket per direction, ``sendall`` of one contiguous buffer, the receiver (a child
process) ``recv_into`` a preallocated buffer, then one byte back."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import socket
import time

import numpy as np

from pdgrpc.transport.testing.peer import digest

SOCKBUF = 4 << 20  # the tcp backend's default socket buffer size; the raw baseline uses the same


def raw_tcp_receiver(conn: multiprocessing.connection.Connection, max_bytes: int) -> None:
    """Child: accept one connection; per round read an 8-byte size, ``recv_into`` that
    many bytes into a preallocated buffer, reply one byte. Reports a digest at the end."""
    lsock = socket.socket()
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKBUF)  # before listen: inherited, sets the window
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    conn.send(lsock.getsockname()[1])
    s, _ = lsock.accept()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = np.zeros(max_bytes, dtype=np.uint8)
    view = buf.data  # memoryview(buf); numpy's stubs declare ndarray.__buffer__ only for Python 3.12+
    last = 0
    while True:
        head = s.recv(8, socket.MSG_WAITALL)
        if len(head) < 8:
            break
        n = int.from_bytes(head, "little")
        got = 0
        while got < n:
            k = s.recv_into(view[got:n])
            if k == 0:
                raise ConnectionError("sender went away")
            got += k
        last = n
        s.sendall(b"!")
    conn.send(digest(view[:last]))
    s.close()
    lsock.close()


class RawTcp:
    """The raw socket baseline, kept alive so its iterations can alternate with the
    backend's: on a shared machine, load then hits both the same way."""

    def __init__(self, max_bytes: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=raw_tcp_receiver, args=(child, max_bytes), daemon=True)
        self._proc.start()
        child.close()
        if not self._conn.poll(60):
            raise RuntimeError("raw tcp receiver did not start")
        port = self._conn.recv()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKBUF)  # before connect, like the backend
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.connect(("127.0.0.1", port))
        self._sock = s
        self._src = (np.arange(max_bytes, dtype=np.uint32) % 251).astype(np.uint8)
        self._last = 0

    def once(self, n: int) -> float:
        t0 = time.perf_counter()
        self._sock.sendall(n.to_bytes(8, "little"))
        self._sock.sendall(self._src.data[:n])
        if self._sock.recv(1) != b"!":
            raise RuntimeError("raw tcp receiver did not acknowledge")
        self._last = n
        return time.perf_counter() - t0

    def close(self) -> None:
        try:
            self._sock.close()
            if not self._conn.poll(60) or self._conn.recv() != digest(self._src.data[: self._last]):
                raise RuntimeError("raw tcp baseline: received bytes differ from those sent")
        finally:
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5)
            self._conn.close()
