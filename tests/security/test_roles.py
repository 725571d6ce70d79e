"""Every caller has a role, and each RPC takes only its roles (docs/security.md, "Roles").

A real ``python -m pdgrpc.bootstrap`` process with the launcher's credentials
(:class:`~pdgrpc.cluster.credentials.ClusterCredentials`), under mTLS alone, the role
tokens alone, and both: a client's certificate or token cannot register a worker or read
the workers, a prefill's can register and a decode's can read; a caller whose
certificate and token name different roles gets neither role. Every RPC the servers
serve is in the one table.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2

from pdgrpc.cluster.credentials import CLIENT, ClusterCredentials
from pdgrpc.rpc.roles import CALLERS, OPEN_METHODS, callers
from pdgrpc.rpc.security import Security
from pdgrpc.v1 import bootstrap_pb2 as pb
from pdgrpc.v1 import bootstrap_pb2_grpc as pb_grpc
from pdgrpc.v1 import decode_pb2, drain_pb2, generate_pb2, handshake_pb2, prefill_pb2
from tests.prefill.procs import BootstrapProc

pytestmark = pytest.mark.timeout(60)

PROCESSES = {"bootstrap": "bootstrap", "prefill": "prefill", "decode": "decode"}
INFO = pb.ParallelInfo(tp_size=1, dp_size=1, pp_size=1, page_size=16, load_balance_method=pb.LOAD_BALANCE_METHOD_ROUND_ROBIN)
MODES = {"mtls": (True, False), "tokens": (False, True), "mtls+tokens": (True, True)}


def test_every_rpc_has_its_roles() -> None:
    for module in (pb, decode_pb2, drain_pb2, generate_pb2, handshake_pb2, prefill_pb2, sglang_scheduler_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                assert callers(f"/{service.full_name}/{method.name}"), f"{service.full_name}/{method.name} is in no role's table"
    assert callers("/pdgrpc.v1.BootstrapService/NoSuchMethod") == frozenset()
    assert callers("/pdgrpc.v1.GenerateService/Generate") == {"client"}
    assert not OPEN_METHODS & set(CALLERS)


@pytest.fixture(scope="module", params=list(MODES))
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ClusterCredentials, str]]:
    """A bootstrap process under one security mode, and the credentials of its cluster."""
    tls, token = MODES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    creds = ClusterCredentials(root / "security", PROCESSES, tls=tls, token=token)
    with BootstrapProc(root, *creds.flags("bootstrap")) as bootstrap:
        yield creds, bootstrap.address


async def code(security: Security, address: str, rpc: str) -> grpc.StatusCode:
    async with security.channel(address) as channel:
        stub = pb_grpc.BootstrapServiceStub(channel)
        try:
            if rpc == "register":
                await stub.RegisterWorker(pb.RegisterWorkerRequest(
                    worker=pb.WorkerInfo(dp_rank=0, transfer_address="127.0.0.1:1000", transport="tcp"), parallel_info=INFO),
                    timeout=10)
            else:
                await stub.GetWorkers(pb.GetWorkersRequest(dp_rank=0), timeout=10)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() != grpc.StatusCode.PERMISSION_DENIED or "it takes" in (exc.details() or ""), exc.details()
            return exc.code()
    return grpc.StatusCode.OK


async def test_a_client_cannot_register_a_worker_nor_read_the_workers(cluster: tuple[ClusterCredentials, str]) -> None:
    creds, address = cluster
    client = creds.security(CLIENT)
    assert await code(client, address, "register") is grpc.StatusCode.PERMISSION_DENIED
    assert await code(client, address, "workers") is grpc.StatusCode.PERMISSION_DENIED
    # A decode reads the workers but registers none; the prefill registers.
    assert await code(creds.security("decode"), address, "register") is grpc.StatusCode.PERMISSION_DENIED
    assert await code(creds.security("prefill"), address, "register") is grpc.StatusCode.OK
    assert await code(creds.security("decode"), address, "workers") is grpc.StatusCode.OK
    if creds.roles_file is not None and creds.ca is not None:
        # A client's certificate with a stolen prefill token still calls as a client.
        p = creds.security("prefill")
        mixed = Security(cert=client.cert, key=client.key, ca=client.ca, token_file=p.token_file)
        assert await code(mixed, address, "register") is grpc.StatusCode.PERMISSION_DENIED


def test_docs_show_the_table() -> None:
    rows = re.findall(r"^\| `(/[^`]+)`[^|]*\| ([a-z, ]+) \|$", (Path(__file__).parents[2] / "docs" / "security.md").read_text(), re.M)
    assert {method: frozenset(roles.split(", ")) for method, roles in rows} == dict(CALLERS)
