"""pdgrpc.rpc.local: a server's methods on its local socket answer as over gRPC -- replies,
statuses, trailing metadata, the token, the drain -- and cancellation, deadlines and a
stopping server end calls as they do there; only its user may connect."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, AsyncIterator

import grpc
import pytest

from pdgrpc.errors import ConfigError
from pdgrpc.rpc.channels import ChannelPool
from pdgrpc.rpc.errors import reason_metadata, reason_of
from pdgrpc.rpc.certs import issue, make_ca, write_token
from pdgrpc.rpc.frames import frame
from pdgrpc.rpc.local import CALL, LocalChannel
from pdgrpc.rpc.security import Security, peer_identity, token_digest
from pdgrpc.rpc.server import start_server
from pdgrpc.state.outcomes import AbortReason
from pdgrpc.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.eventually import eventually_async

PREFILL = prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name
DECODE = decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name


class Servers(prefill_pb2_grpc.PrefillServiceServicer, decode_pb2_grpc.DecodeServiceServicer):
    """``Prefill`` echoes the prompt's length, refuses room 7 (with a reason) and holds
    room 9 until cancelled; ``Decode`` streams one token per prompt id, then fails room 8."""

    def __init__(self) -> None:
        self.cancelled: list[int] = []
        self.held = asyncio.Event()
        self.peers: list[str] = []
        self.callers: list[str] = []

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: Any) -> prefill_pb2.PrefillResponse:  # noqa: N802
        self.peers.append(context.peer())
        self.callers.append(peer_identity(context))
        if request.bootstrap_room == 7:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "room 7: full", trailing_metadata=reason_metadata(AbortReason.CANCELLED))
        if request.bootstrap_room == 9:
            self.held.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.cancelled.append(9)
                raise
        return prefill_pb2.PrefillResponse(prompt_tokens=len(request.input_ids), dp_rank=3)

    async def Decode(self, request: decode_pb2.DecodeRequest, context: Any) -> AsyncIterator[decode_pb2.DecodeResponse]:  # noqa: N802
        for t in request.input_ids:
            yield decode_pb2.DecodeResponse(token_ids=[t])
        if request.bootstrap_room == 8:
            raise RuntimeError("broke")


@pytest.fixture
def sock_dir() -> Any:
    with tempfile.TemporaryDirectory(prefix="pdgrpc-t-") as d:  # mode 0700
        yield Path(d)


async def _start(servers: Servers, path: Path, security: Security | None = None) -> Any:
    return await start_server(
        [(PREFILL, lambda s: prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servers, s)),
         (DECODE, lambda s: decode_pb2_grpc.add_DecodeServiceServicer_to_server(servers, s))],
        local_socket=str(path), security=security or Security(),
    )


Served = tuple[Servers, Any, prefill_pb2_grpc.PrefillServiceStub]


@pytest.fixture
async def served(sock_dir: Path) -> AsyncIterator[Served]:
    """A server on ``sock_dir/s.sock`` and a prefill stub over its local channel."""
    servers = Servers()
    server = await _start(servers, sock_dir / "s.sock")
    local = LocalChannel(str(sock_dir / "s.sock"))
    try:
        yield servers, server, prefill_pb2_grpc.PrefillServiceStub(local)
    finally:
        await local.close()
        await server.stop(0)


async def _outcome(call: Any) -> Any:
    try:
        return await call
    except grpc.RpcError as exc:
        return exc.code(), exc.details(), reason_of(exc)


async def _stream(call: Any) -> Any:
    got = []
    try:
        while (m := await call.read()) is not grpc.aio.EOF:
            got.append(list(m.token_ids))
    except grpc.RpcError as exc:
        return got, exc.code(), exc.details().split(":")[0]
    return got, None


async def test_replies_and_statuses_equal_grpcs(sock_dir: Path) -> None:
    servers = Servers()
    server = await _start(servers, sock_dir / "s.sock")
    pool = ChannelPool(security=Security())
    local = LocalChannel(str(sock_dir / "s.sock"))
    try:
        assert stat.S_IMODE(os.stat(sock_dir / "s.sock").st_mode) == 0o600
        out = {}
        for way, channel in (("grpc", pool.get(server.address)), ("local", local)):
            p = prefill_pb2_grpc.PrefillServiceStub(channel)
            d = decode_pb2_grpc.DecodeServiceStub(channel)
            out[way] = [
                await _outcome(p.Prefill(prefill_pb2.PrefillRequest(bootstrap_room=1, input_ids=[1, 2, 3]), timeout=5)),
                await _outcome(p.Prefill(prefill_pb2.PrefillRequest(bootstrap_room=7), timeout=5)),
                await _stream(d.Decode(decode_pb2.DecodeRequest(bootstrap_room=1, input_ids=[4, 5]), timeout=5)),
                await _stream(d.Decode(decode_pb2.DecodeRequest(bootstrap_room=8, input_ids=[6]), timeout=5)),
                # Not a valid PrefillRequest: the server's parsing refuses it, naming the type.
                await _outcome(channel.unary_unary(f"/{PREFILL}/Prefill", request_serializer=bytes,
                                                   response_deserializer=bytes)(b"\xff\xff", timeout=5)),
            ]
        assert out["local"] == out["grpc"]
        assert out["local"][0].prompt_tokens == 3 and out["local"][1][0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert out["local"][1][2] == "cancelled" and out["local"][3] == ([[6]], grpc.StatusCode.UNKNOWN, "Unexpected <class 'RuntimeError'>")
        assert out["local"][4][0] == grpc.StatusCode.INVALID_ARGUMENT
        assert servers.peers[-1].startswith("unix:")
    finally:
        await local.close()
        await pool.close()
        await server.stop(0)


async def test_a_call_is_on_the_socket_as_it_is_made(sock_dir: Path) -> None:
    """On a connected channel a call is written before the caller's next line: the server
    (a bare socket here, read without yielding to the loop) starts on it at once."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock_dir / "s.sock"))
    listener.listen()
    local = LocalChannel(str(sock_dir / "s.sock"))
    await local.connection()
    server_side, _ = listener.accept()
    try:
        call = prefill_pb2_grpc.PrefillServiceStub(local).Prefill(prefill_pb2.PrefillRequest(bootstrap_room=1), timeout=5)
        server_side.setblocking(False)
        assert f"/{PREFILL}/Prefill".encode() in server_side.recv(65536)
        call.cancel()
    finally:
        await local.close()
        server_side.close()
        listener.close()


async def test_cancel_and_deadline_cancel_the_handler(served: Served) -> None:
    servers, _, stub = served
    call = stub.Prefill(prefill_pb2.PrefillRequest(bootstrap_room=9), timeout=30)
    await asyncio.wait_for(servers.held.wait(), 5)
    assert call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await eventually_async(lambda: servers.cancelled == [9], timeout=1, what=lambda: f"cancelled: {servers.cancelled}")
    servers.held.clear()
    with pytest.raises(grpc.RpcError) as info:
        await stub.Prefill(prefill_pb2.PrefillRequest(bootstrap_room=9), timeout=0.3)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await eventually_async(lambda: servers.cancelled == [9, 9], timeout=1, what=lambda: f"cancelled: {servers.cancelled}")


async def test_stop_ends_running_calls_unavailable_and_drain_refuses(served: Served, sock_dir: Path) -> None:
    servers, server, stub = served
    server.gate.start()  # draining: new entry calls are refused
    assert await _outcome(stub.Prefill(prefill_pb2.PrefillRequest(bootstrap_room=1), timeout=5)) == (
        grpc.StatusCode.UNAVAILABLE, f"/{PREFILL}/Prefill: this server is draining (shutting down); try another instance", None)
    server2 = await _start(servers, sock_dir / "t.sock")
    local2 = LocalChannel(str(sock_dir / "t.sock"))
    try:
        call = prefill_pb2_grpc.PrefillServiceStub(local2).Prefill(prefill_pb2.PrefillRequest(bootstrap_room=9), timeout=30)
        await asyncio.wait_for(servers.held.wait(), 5)
        await server2.stop(0.1)
        code = (await _outcome(call))[0]
        assert code == grpc.StatusCode.UNAVAILABLE
        assert not (sock_dir / "t.sock").exists()
        # Nothing listens now: a call fails UNAVAILABLE, as a gRPC call to a closed port does.
        assert (await _outcome(prefill_pb2_grpc.PrefillServiceStub(local2).Prefill(prefill_pb2.PrefillRequest(bootstrap_room=1), timeout=5)))[0] == grpc.StatusCode.UNAVAILABLE
    finally:
        await local2.close()


async def test_the_token_applies(sock_dir: Path) -> None:
    token = sock_dir / "token"
    token.write_text("s3cret")
    token.chmod(0o600)
    security = Security(token_file=token)
    server = await _start(Servers(), sock_dir / "s.sock", security)
    anonymous = LocalChannel(str(sock_dir / "s.sock"))
    holder = LocalChannel(str(sock_dir / "s.sock"), security.call_metadata())
    try:
        req = prefill_pb2.PrefillRequest(bootstrap_room=1, input_ids=[1])
        assert (await _outcome(prefill_pb2_grpc.PrefillServiceStub(anonymous).Prefill(req, timeout=5)))[0] == grpc.StatusCode.UNAUTHENTICATED
        assert (await prefill_pb2_grpc.PrefillServiceStub(holder).Prefill(req, timeout=5)).prompt_tokens == 1
    finally:
        await anonymous.close()
        await holder.close()
        await server.stop(0)


async def test_a_path_others_may_reach_is_refused(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    with pytest.raises(ConfigError, match="--local-socket"):
        await _start(Servers(), open_dir / "s.sock")


async def test_a_path_in_a_missing_directory_is_refused_naming_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--local-socket .*: cannot read its directory: No such file or directory"):
        await _start(Servers(), tmp_path / "missing" / "s.sock")


def test_a_server_given_a_missing_directory_exits_2_naming_the_flag(tmp_path: Path) -> None:
    path = tmp_path / "missing" / "s.sock"
    cmd = [sys.executable, "-m", "pdgrpc.decode", "--transport", "fake", "--port", "0", "--local-socket", str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert f"--local-socket {str(path)!r}: cannot read its directory" in out.stderr
    assert "Traceback" not in out.stderr


async def _code(channel: Any, method: str, request: bytes) -> Any:
    try:
        await channel.unary_unary(method, request_serializer=bytes, response_deserializer=bytes)(request, timeout=5)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def test_under_mtls_a_local_caller_is_the_router_alone(sock_dir: Path) -> None:
    """A server with mTLS and role tokens serves its local socket: the uid stands for the
    certificate and makes the caller the router, so the router's token passes, another
    role's token (even one that may call Prefill over gRPC) does not, and a method other
    than the router's Prefill and Decode is refused PERMISSION_DENIED."""
    ca = make_ca(sock_dir)
    own = issue(ca, sock_dir, "prefill", role="prefill")
    tokens = {role: write_token(sock_dir / role) for role in ("router", "prefill", "client")}
    roles = sock_dir / "roles"
    roles.write_text("".join(f"{role} {token_digest(path.read_text().strip())}\n" for role, path in tokens.items()))
    server = await _start(Servers(), sock_dir / "s.sock", Security(cert=own.cert, key=own.key, ca=ca.cert, roles_file=roles))
    channels = {role: LocalChannel(str(sock_dir / "s.sock"), Security(token_file=path).call_metadata()) for role, path in tokens.items()}
    channels["none"] = LocalChannel(str(sock_dir / "s.sock"))
    prefill = prefill_pb2.PrefillRequest(bootstrap_room=1, input_ids=[1, 2]).SerializeToString()
    try:
        got = {role: await _code(ch, f"/{PREFILL}/Prefill", prefill) for role, ch in channels.items()}
        assert got == {"router": grpc.StatusCode.OK, "prefill": grpc.StatusCode.PERMISSION_DENIED,
                       "client": grpc.StatusCode.PERMISSION_DENIED, "none": grpc.StatusCode.UNAUTHENTICATED}
        router = channels["router"]
        for method in (f"/{PREFILL}/GetStats", f"/{DECODE}/GetStats", "/pdgrpc.v1.HandshakeService/AbortRoom", "/pdgrpc.v1.DrainService/Drain"):
            assert await _code(router, method, b"") == grpc.StatusCode.PERMISSION_DENIED, method
    finally:
        for ch in channels.values():
            await ch.close()
        await server.stop(0)


async def test_under_mtls_alone_the_local_caller_needs_no_certificate(sock_dir: Path) -> None:
    """... and is named per process, as each router's certificate names its own."""
    ca = make_ca(sock_dir)
    own = issue(ca, sock_dir, "decode", role="decode")
    servers = Servers()
    server = await _start(servers, sock_dir / "s.sock", Security(cert=own.cert, key=own.key, ca=ca.cert))
    local = LocalChannel(str(sock_dir / "s.sock"))
    try:
        await prefill_pb2_grpc.PrefillServiceStub(local).Prefill(prefill_pb2.PrefillRequest(bootstrap_room=1), timeout=5)
        assert servers.callers == [f"cn:local router pid {os.getpid()}"]
        got, end = await _stream(decode_pb2_grpc.DecodeServiceStub(local).Decode(decode_pb2.DecodeRequest(bootstrap_room=1, input_ids=[4, 5]), timeout=5))
        assert (got, end) == ([[4], [5]], None)
        assert await _code(local, "/grpc.health.v1.Health/Check", b"") == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await local.close()
        await server.stop(0)


_PEEK = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
try:
    s.connect(sys.argv[1])
except OSError as exc:
    print("refused", exc.errno)
    raise SystemExit
try:
    s.sendall(bytes.fromhex(sys.argv[2]))
    print("answered" if s.recv(65536) else "closed")
except (BrokenPipeError, ConnectionResetError):  # closed with the call unread
    print("closed")
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="running a client as another user (nobody) takes root and setpriv")
async def test_another_user_is_closed_at_connect(sock_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """With the directory and the socket opened to everyone, so that only the server's
    SO_PEERCRED check stands, a process of another uid is closed at connect, unanswered,
    while one of the server's uid is answered."""
    server = await _start(Servers(), sock_dir / "s.sock")
    try:
        os.chmod(sock_dir, 0o755)
        os.chmod(sock_dir / "s.sock", 0o666)
        head = json.dumps([f"/{PREFILL}/Prefill", 5, []]).encode()
        call = frame(CALL, 1, struct.pack("<I", len(head)) + head + prefill_pb2.PrefillRequest(bootstrap_room=1).SerializeToString())
        argv = [sys.executable, "-I", "-c", _PEEK, str(sock_dir / "s.sock"), call.hex()]
        nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        out = {}
        for who, prefix in (("nobody", nobody), ("self", [])):
            proc = await asyncio.create_subprocess_exec(*prefix, *argv, cwd="/", stdout=asyncio.subprocess.PIPE)
            out[who] = (await asyncio.wait_for(proc.communicate(), 30))[0].decode().strip()
        assert out == {"nobody": "closed", "self": "answered"}
        assert "refused a connection from another user" in caplog.text
    finally:
        await server.stop(0)
