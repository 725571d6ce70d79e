"""``python -m pdgrpc.cluster smg-1p1d --tls auto --auth-token auto`` serves smg's clients.

smg presents no credential to its gRPC workers (test_smg_credentials.py), so each secured
worker also listens for it on loopback, in plaintext, where every caller is the
``gateway`` role alone (``--gateway-listen``); smg's HTTP side takes only the cluster's
api key, which is on no command line. One real CLI start over tcp: a request with the key
gets the tokens of colocated generation, one without it gets 401; the gateway listener refuses what smg never calls,
and the main listener still refuses a caller without credentials. Each worker (its
argument parser) and ``start_server`` refuse a gateway listener off loopback.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from pdgrpc.cluster.smg import smg_executable
from pdgrpc.colocated.server import build_parser as colocated_parser
from pdgrpc.decode.cli import build_parser as decode_parser
from pdgrpc.errors import ConfigError
from pdgrpc.gateway import DEFAULT_SERVED_MODEL_NAME
from pdgrpc.prefill.cli import build_parser as prefill_parser
from pdgrpc.rpc.server import start_server
from pdgrpc.v1 import bootstrap_pb2, bootstrap_pb2_grpc, decode_pb2_grpc, prefill_pb2
from tests.e2e.harness import Case, reference_outputs
from tests.gateway import smg_http
from tests.prefill.procs import Proc

pytestmark = pytest.mark.timeout(180)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, dict]]:
    """(smg's base URL, its api key, cluster.json's processes) of the CLI's secured smg-1p1d."""
    try:
        smg_executable()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    log_dir = tmp_path_factory.mktemp("smg-secured")
    argv = [sys.executable, "-m", "pdgrpc.cluster", "smg-1p1d", "--tls", "auto", "--auth-token", "auto", "--transport", "tcp",
            "--log-dir", str(log_dir), "--grace", "5"]
    # Its own process group: stop() kills whatever the CLI leaves, smg included.
    with Proc(argv, log_dir, "cli", env={"PYTHONPATH": str(REPO)}, cwd=REPO, new_session=True) as cli:
        url = cli.wait_for(r"base URL: (\S+)/v1", timeout=150).group(1)
        key = (log_dir / "security" / "smg-api-key").read_text().strip()
        yield url, key, json.loads((log_dir / "cluster.json").read_text())["processes"]
        assert cli.stop(60, signal.SIGINT) == 0, cli.tail()


def test_smg_serves_with_its_api_key_and_refuses_without(secured: tuple[str, str, dict]) -> None:
    url, key, procs = secured
    assert key.encode() not in Path(f"/proc/{procs['smg']['pid']}/cmdline").read_bytes()  # what every local user may read
    case = Case((256, *b"secured smg"), 8)
    body = {"model": DEFAULT_SERVED_MODEL_NAME, "input_ids": list(case.input_ids),
            "sampling_params": {"max_new_tokens": case.max_new_tokens, "temperature": 0.0}}
    status, reply = smg_http.post(url, "/generate", body, api_key=key)
    assert status == 200, reply
    ((ids, _reason),) = reference_outputs("smg-1p1d", [case])
    assert tuple(reply[0]["output_ids"]) == ids
    chat = {"model": DEFAULT_SERVED_MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    status, reply = smg_http.post(url, "/v1/chat/completions", chat, api_key=key)
    assert status == 200 and reply["usage"]["completion_tokens"] == 4, reply
    status, reply = smg_http.post(url, "/v1/chat/completions", chat)
    assert status == 401, reply


def test_the_gateway_listener_grants_the_gateway_role_alone(secured: tuple[str, str, dict]) -> None:
    _, _, procs = secured

    async def calls() -> None:
        async with grpc.aio.insecure_channel(procs["prefill"]["gateway_address"]) as prefill:
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await bootstrap_pb2_grpc.BootstrapServiceStub(prefill).RegisterWorker(bootstrap_pb2.RegisterWorkerRequest(), timeout=10)
            assert ei.value.code() is grpc.StatusCode.PERMISSION_DENIED, ei.value
        async with grpc.aio.insecure_channel(procs["decode"]["gateway_address"]) as decode:
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await decode_pb2_grpc.DecodeServiceStub(decode).GetStats(prefill_pb2.GetStatsRequest(), timeout=10)
            assert ei.value.code() is grpc.StatusCode.PERMISSION_DENIED, ei.value
        # The main listener still takes only callers with a certificate.
        async with grpc.aio.insecure_channel(procs["decode"]["address"]) as main:
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await decode_pb2_grpc.DecodeServiceStub(main).GetStats(prefill_pb2.GetStatsRequest(), timeout=10)
            assert ei.value.code() is grpc.StatusCode.UNAVAILABLE, ei.value

    asyncio.run(calls())


@pytest.mark.parametrize("parser", [decode_parser, prefill_parser, colocated_parser], ids=["decode", "prefill", "colocated"])
def test_a_worker_refuses_a_gateway_listener_off_loopback(parser, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        parser().parse_args(["--gateway-listen", "0.0.0.0:5000"])
    assert exit.value.code == 2 and "--gateway-listen: '0.0.0.0' is not a loopback address" in capsys.readouterr().err
    assert parser().parse_args(["--gateway-listen", "127.0.0.1:5000"]).gateway_listen == "127.0.0.1:5000"


def test_a_server_refuses_a_gateway_listener_off_loopback() -> None:
    with pytest.raises(ConfigError, match="--gateway-listen: '10.0.0.1' is not a loopback address"):
        asyncio.run(start_server([], gateway_listen="10.0.0.1:5000"))
