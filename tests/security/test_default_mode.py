"""``python -m pdgrpc.cluster TOPOLOGY`` serves mTLS with roles unless told ``--insecure``.

The real CLI on a colocated topology: with no flags, a plaintext client is refused, the
client flags it prints get a completion, and they call ``Generate`` only. Plain mode needs
``--insecure`` and says so; a topology's own ``[security]`` still decides.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import sys
from pathlib import Path

import grpc
import pytest

from pdgrpc.cluster.__main__ import build_parser, tls_mode
from pdgrpc.cluster.client import generate
from pdgrpc.cluster.topology import load_topology, parse_topology
from pdgrpc.errors import ConfigError
from pdgrpc.rpc.security import Security
from pdgrpc.v1 import drain_pb2, drain_pb2_grpc
from pdgrpc.v1.generate_pb2_grpc import GenerateServiceStub
from tests.prefill.procs import Proc

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]


def test_tls_is_on_unless_insecure_or_the_topology_says() -> None:
    def mode(topology: str, *argv: str) -> str | None:
        return tls_mode(build_parser().parse_args([topology, *argv]), load_topology(topology))

    assert mode("1p1d") == "auto"
    assert mode("1p1d", "--insecure") == "off"
    assert mode("1p1d", "--tls", "off") == "off"
    assert mode("smg-1p1d") == "auto"  # smg reaches its workers on their gateway listeners
    with pytest.raises(ConfigError, match="--insecure"):
        mode("1p1d", "--insecure", "--tls", "auto")
    said = parse_topology({"process": [{"name": "c", "role": "colocated"}], "security": {"tls": "off"}}, "t")
    assert tls_mode(argparse.Namespace(tls=None, insecure=False), said) is None  # the topology's own: off


def test_the_cli_serves_mtls_with_roles_by_default(tmp_path: Path) -> None:
    cli = Proc(
        [sys.executable, "-m", "pdgrpc.cluster", "colocated", "--log-dir", str(tmp_path), "--grace", "5"],
        tmp_path, "cli", cwd=REPO, env={"PYTHONPATH": str(REPO)}, new_session=True,
    )
    try:
        router = cli.wait_for(r"listening on (\S+)\n").group(1)
        m = re.search(r"clients present:(.*)", cli.out())
        assert m, cli.tail()
        present = m.group(1).strip()
        flags = dict(re.findall(r"--(\S+) (\S+)", present))
        client = Security(cert=Path(flags["tls-cert"]), key=Path(flags["tls-key"]), ca=Path(flags["tls-ca"]))

        async def calls() -> None:
            async with grpc.aio.insecure_channel(router) as plain:
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await generate(GenerateServiceStub(plain), prompt="hi", max_new_tokens=2, timeout=10)
                assert ei.value.code() is grpc.StatusCode.UNAVAILABLE
            async with client.channel(router) as ch:
                done = await generate(GenerateServiceStub(ch), prompt="hi", max_new_tokens=2, timeout=30)
                assert len(done.token_ids) == 2
                # The client's certificate calls Generate only: not Drain.
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await drain_pb2_grpc.DrainServiceStub(ch).Drain(drain_pb2.DrainRequest(), timeout=10)
                assert ei.value.code() is grpc.StatusCode.PERMISSION_DENIED

        asyncio.run(calls())
        cli.proc.send_signal(signal.SIGINT)
        cli.proc.wait(60)  # it stops on SIGINT
    finally:
        cli.stop()
