"""A worker's loopback gateway listener (``--gateway-listen``) serves only local processes
of the server's own user and those ``--gateway-uid`` names, not any local process.

A real decode process with smg's protocol and ``--gateway-listen 127.0.0.1:0
--gateway-uid 1``; clients are real processes run as other users by ``setpriv``: one as
``nobody`` is refused PERMISSION_DENIED, one as uid 1 (``daemon``) and this test itself
(the server's user) are served. ``tests/security/test_smg_secured.py`` shows smg, run by
the launcher as the cluster's user, still served.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from pdgrpc.decode.cli import build_parser as decode_parser
from pdgrpc.rpc.loopback_peer import peer_uid
from tests.prefill.procs import DecodeProc
from tests.security.conftest import FLAGS

pytest.importorskip("smg_grpc_proto", reason="smg's worker protocol needs the pdgrpc[gateway] extra")
pytestmark = pytest.mark.timeout(90)

METHOD = "/sglang.grpc.scheduler.SglangScheduler/GetModelInfo"
CLIENT = """
import sys, grpc
with grpc.insecure_channel(sys.argv[1]) as channel:
    try:
        channel.unary_unary(sys.argv[2])(b"", timeout=20)
        print("OK")
    except grpc.RpcError as exc:
        print(exc.code().name, exc.details())
"""


def call_as(uid: int, address: str) -> str:
    """The status name (and message) of one GetModelInfo call by a process of ``uid``."""
    out = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable, "-c", CLIENT, address, METHOD],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}, cwd="/",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_the_gateway_listener_serves_only_its_users(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("running a client as another user (setpriv --reuid) needs root")
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed: no way to run a client as another user")
    for uid in (65534, 1):
        probe = subprocess.run(
            ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable, "-c", "import grpc"],
            capture_output=True, timeout=60, cwd="/",
        )
        if probe.returncode:
            pytest.skip(f"uid {uid} cannot import grpc from {sys.prefix} (a directory above it is private to its "
                        "owner, e.g. a checkout under mktemp -d): no client to run as another user")
    tmp_path.chmod(0o755)
    with DecodeProc([*FLAGS, "--gateway-listen", "127.0.0.1:0", "--gateway-uid", "1"], tmp_path) as decode:
        address = decode.wait_for(r"gateway listener on (\S+:\d+)", source="log").group(1)
        refused = call_as(65534, address)
        assert refused.startswith("PERMISSION_DENIED") and "user" in refused, refused
        assert call_as(1, address) == "OK"
        with grpc.insecure_channel(address) as channel:
            assert channel.unary_unary(METHOD)(b"", timeout=20) is not None  # the server's own user


def test_gateway_uid_names_a_uid() -> None:
    with pytest.raises(SystemExit):
        decode_parser().parse_args(["--gateway-listen", "127.0.0.1:0", "--gateway-uid", "smg"])
    assert decode_parser().parse_args(["--gateway-uid", "7", "--gateway-uid", "8"]).gateway_uid == [7, 8]


@pytest.mark.parametrize("family, host, scheme", [(socket.AF_INET, "127.0.0.1", "ipv4:{}:{}"), (socket.AF_INET6, "::1", "ipv6:[{}]:{}")])
def test_a_connections_user_is_its_client_sockets_while_it_lasts(family: socket.AddressFamily, host: str, scheme: str) -> None:
    with socket.socket(family) as listener:
        try:
            listener.bind((host, 0))
        except OSError as exc:
            pytest.skip(f"no {host} on this host: {exc}")
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection((host, port))
        accepted, _ = listener.accept()
        peer = scheme.format(host, client.getsockname()[1])
        assert peer_uid(peer, (host, port)) == os.geteuid()
        assert peer_uid(peer, (host, port + 1 if port < 65535 else port - 1)) is None  # another listener's
        client.close()
        accepted.close()
        assert peer_uid(peer, (host, port)) is None  # ended: its address may be another process's next
    assert peer_uid("unix:/tmp/x", (host, port)) is None
