"""A caller without the token cannot make a server hold its messages.

A real ``python -m pdgrpc.decode`` with ``--auth-token-file``: 100 ``Decode`` calls
without the token, each carrying an 8 MiB message (the largest a server accepts), 20 at
a time, are refused UNAUTHENTICATED, and the decode's resident memory grows by less than
one batch of them held whole: the token is checked before the message is read. A caller with the
token is still served (its bad request is refused naming the field, so it was read).
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import grpc
import pytest

from pdgrpc.rpc.certs import write_token
from pdgrpc.rpc.limits import MAX_MESSAGE_BYTES
from pdgrpc.rpc.security import Security
from pdgrpc.v1 import decode_pb2, decode_pb2_grpc
from tests.decode.test_decode_server import DECODE_FLAGS
from tests.prefill.procs import DecodeProc

pytestmark = pytest.mark.timeout(180)
CALLS, AT_ONCE = 100, 20
# Less than one batch held whole (a server that reads before it checks retained about
# 300 MiB here): what arrives unread is bounded by HTTP/2's receive window per call,
# which the servers fix (no bandwidth probes) so that it cannot grow toward a whole
# message; with probes on, a loaded host saw 209 MiB here.
GROWTH_BOUND_MIB = AT_ONCE * (MAX_MESSAGE_BYTES >> 20)


def rss_mib(pid: int) -> float:
    m = re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    assert m is not None
    return int(m.group(1)) / 1024


async def test_unauthenticated_8mib_messages_do_not_grow_the_decode(tmp_path: Path) -> None:
    token = write_token(tmp_path / "token")
    with DecodeProc([*DECODE_FLAGS, "--auth-token-file", str(token)], tmp_path) as decode:
        address = decode.address
        # The largest message the server takes: a prompt of junk bytes in a field it skips.
        big = decode_pb2.DecodeRequest(request_id="x" * (MAX_MESSAGE_BYTES - 64))
        options = [("grpc.max_send_message_length", 2 * MAX_MESSAGE_BYTES)]
        async with grpc.aio.insecure_channel(address, options=options) as ch:
            stub = decode_pb2_grpc.DecodeServiceStub(ch)

            async def one() -> grpc.StatusCode:
                try:
                    async for _ in stub.Decode(big, timeout=60):
                        pass
                except grpc.aio.AioRpcError as exc:
                    return exc.code()
                return grpc.StatusCode.OK

            assert await one() == grpc.StatusCode.UNAUTHENTICATED  # connected, and warmed up
            before = rss_mib(decode.pid)
            codes: list[grpc.StatusCode] = []
            for _ in range(CALLS // AT_ONCE):
                codes += await asyncio.gather(*(one() for _ in range(AT_ONCE)))
            after = rss_mib(decode.pid)
        print(f"decode RSS {before:.0f} MiB -> {after:.0f} MiB after {CALLS} unauthenticated {MAX_MESSAGE_BYTES >> 20} MiB messages")
        assert set(codes) == {grpc.StatusCode.UNAUTHENTICATED}
        assert after - before < GROWTH_BOUND_MIB
        async with Security(token_file=token).channel(address) as ch:
            try:
                async for _ in decode_pb2_grpc.DecodeServiceStub(ch).Decode(decode_pb2.DecodeRequest(), timeout=30):
                    pass
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc
                assert "room_secret" in (exc.details() or ""), exc.details()
            else:
                raise AssertionError("an empty Decode was served")
