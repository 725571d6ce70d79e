"""A raw tcp-transport client for tests: speaks the wire format by hand, so a test can
send what no well-behaved sender would (malformed frames, claimed identities, wrong
proofs of identity)."""

from __future__ import annotations

import asyncio
import socket

from pdgrpc.transport import peerauth
from pdgrpc.transport.descriptor import Descriptor
from pdgrpc.transport.receiver import MessageType
from pdgrpc.transport.tcp_wire import HEADER, OP


class RawClient:
    """One plain socket to a tcp transport's listener (blocking calls run in a thread)."""

    def __init__(self, descriptor: bytes) -> None:
        d = Descriptor.from_bytes(descriptor)
        host, _, port = d.endpoint.decode().rpartition(":")
        self.target = d.instance_id
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.nonce: bytes | None = None  # the receiver's CHALLENGE, once read

    async def challenge(self) -> bytes:
        """The nonce of the receiver's CHALLENGE (the first frame on every connection)."""
        if self.nonce is None:
            ftype, _n, _room, payload_len, _aux = HEADER.unpack(await self.recv_exactly(HEADER.size))
            assert ftype == MessageType.CHALLENGE, ftype
            self.nonce = await self.recv_exactly(payload_len)
        return self.nonce

    async def send(self, data: bytes) -> None:
        await asyncio.to_thread(self.sock.sendall, data)

    async def hello(self, claimed_id: str = "raw-client", credential: bytes | None = None, nonce: bytes | None = None) -> int:
        """HELLO claiming ``claimed_id``, answering the challenge (or ``nonce``, to replay
        an old one) with ``credential`` (default: the one the receiver would issue, known
        when it lives in this process; ``b""``: no credential); returns the answer's
        frame type."""
        got = await self.challenge()
        cred = peerauth.known_credential(self.target, claimed_id) if credential is None else credential
        answer = peerauth.proof(cred, b"tcp", got if nonce is None else nonce, claimed_id, self.target) if cred else b""
        body = f"{claimed_id} {self.target} {answer.hex()}".encode()
        await self.send(HEADER.pack(MessageType.HELLO, 0, 0, len(body), 0) + body)
        head = await self.recv_exactly(HEADER.size)
        ftype, _n, _room, payload_len, _aux = HEADER.unpack(head)
        if payload_len:
            await self.recv_exactly(payload_len)
        return int(ftype)

    async def write_frame(self, room: int, ops: list[tuple[int, int, int]], payload_len: int | None = None,
                          ftype: int = MessageType.WRITE, aux: int = 0) -> None:
        """A data frame's header and op table (no payload): ``ops`` are (region, offset, length)."""
        total = sum(n for _, _, n in ops) if payload_len is None else payload_len
        table = b"".join(OP.pack(r, o, n) for r, o, n in ops)
        await self.send(HEADER.pack(ftype, len(ops), room, total, aux) + table)

    async def recv_exactly(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = await asyncio.to_thread(self.sock.recv, n - len(out))
            if not chunk:
                raise ConnectionError("closed by the transport")
            out += chunk
        return out

    async def closed_by_peer(self, timeout: float = 10.0) -> bool:
        """True once the transport closed this connection (EOF or reset), reading and
        dropping anything it sent before; False if it is still open at ``timeout``."""
        self.sock.settimeout(timeout)
        try:
            while True:
                chunk = await asyncio.to_thread(self.sock.recv, 65536)
                if not chunk:
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except (socket.timeout, TimeoutError):
            return False

    def close(self) -> None:
        self.sock.close()
