"""What one RegisterWorker caller can make a real bootstrap hold, log or repeat: every
size it names is bounded, each refusal names the field and its limit, and a legitimate
worker still registers and is found afterwards."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import AsyncIterator

import grpc
import pytest

from pdgrpc.bootstrap.client import BootstrapClient
from pdgrpc.bootstrap.registry import MAX_CANDIDATES, MAX_PENDING_WORKERS, MAX_WORKERS, WorkerRegistry
from pdgrpc.bootstrap.service import SERVICE_NAME, BootstrapServicer, add_bootstrap_servicer
from pdgrpc.bootstrap.table import RoomTable
from pdgrpc.rpc.certs import issue, make_ca
from pdgrpc.rpc.errors import RpcError
from pdgrpc.rpc.limits import MAX_ADDRESS_CHARS, MAX_NAME_CHARS, MAX_TRANSPORT_ENDPOINT_BYTES
from pdgrpc.rpc.security import Security
from pdgrpc.rpc.server import start_server
from pdgrpc.v1 import bootstrap_pb2 as pb
from pdgrpc.v1 import bootstrap_pb2_grpc as pb_grpc

from bootstrap_helpers import parallel_info, worker


async def registers_and_is_found(client: BootstrapClient) -> None:
    for dp in range(2):
        await client.register_worker(worker(dp), parallel_info(dp=2))
    (w,) = (await client.get_workers_response(1)).workers
    assert (w.transfer_address, w.generation) == ("10.0.0.1:7000", 1)


@pytest.mark.parametrize(
    "sizes",
    [dict(dp=MAX_WORKERS + 1), dict(dp=256, tp=64, pp_size=2), dict(dp=2**16, tp=2**16, pp_size=2**16)],
)
async def test_a_topology_over_max_workers_is_invalid_argument(client: BootstrapClient, sizes: dict[str, int]) -> None:
    """dp_size x tp_size x pp_size was unbounded: a caller registered slot after slot of a
    2**20-worker topology, each held for good, and sizes whose product overflows the
    response's uint32 count ended the call UNKNOWN."""
    with pytest.raises(RpcError) as e:
        await client.register_worker(worker(1), parallel_info(**sizes))  # type: ignore[arg-type]
    assert e.value.code.name == "INVALID_ARGUMENT", e.value
    assert "RegisterWorkerRequest.parallel_info: dp_size" in e.value.details
    assert f"workers, over the limit of {MAX_WORKERS}" in e.value.details
    await registers_and_is_found(client)


@pytest.mark.parametrize(
    "field, value, shown",
    [
        ("transfer_address", "a" * 9000, f"9000 characters, over the limit of {MAX_ADDRESS_CHARS}"),
        ("transport", "t" * 9000, f"9000 characters, over the limit of {MAX_NAME_CHARS}"),
        ("transport_endpoint", b"e" * (MAX_TRANSPORT_ENDPOINT_BYTES + 1),
         f"{MAX_TRANSPORT_ENDPOINT_BYTES + 1} bytes, over the limit of {MAX_TRANSPORT_ENDPOINT_BYTES}"),
    ],
)
async def test_oversized_worker_fields_are_refused_and_never_logged(
    client: BootstrapClient, caplog: pytest.LogCaptureFixture, field: str, value: object, shown: str
) -> None:
    """Each was held whole, and the address and transport were logged whole."""
    w = worker(0)
    setattr(w, field, value)
    with caplog.at_level(logging.INFO, logger="pdgrpc"):
        with pytest.raises(RpcError) as e:
            await client.register_worker(w, parallel_info(dp=2))
    assert e.value.code.name == "INVALID_ARGUMENT", e.value
    assert e.value.details == f"RegisterWorkerRequest.worker.{field}: {shown}"
    assert not [r for r in caplog.records if len(r.getMessage()) > 1000]
    await registers_and_is_found(client)


async def test_a_mismatch_does_not_repeat_an_oversized_field(client: BootstrapClient) -> None:
    """Against a fixed topology, a 9000-character kv_dtype came back whole in the
    FAILED_PRECONDITION message (and a compatibility hash twice its size, in hex)."""
    await registers_and_is_found(client)
    with pytest.raises(RpcError) as e:
        await client.register_worker(worker(0), parallel_info(dp=2, kv_dtype="d" * 9000))
    assert e.value.code.name == "INVALID_ARGUMENT", e.value
    assert e.value.details == f"RegisterWorkerRequest.parallel_info.kv_dtype: 9000 characters, over the limit of {MAX_NAME_CHARS}"
    (w,) = (await client.get_workers_response(0)).workers
    assert w.generation == 1


class Credentials:
    """One CA's certificates: the bootstrap's, the real prefill's and another caller's."""

    def __init__(self, root: Path) -> None:
        self.ca = make_ca(root)
        self.server, self.prefill, self.intruder = (issue(self.ca, root, n) for n in ("bootstrap", "prefill", "intruder"))

    def security(self, name: str) -> Security:
        cert = getattr(self, name)
        return Security(cert=cert.cert, key=cert.key, ca=self.ca.cert)


@pytest.fixture(scope="module")
def credentials(tmp_path_factory: pytest.TempPathFactory) -> Credentials:
    return Credentials(tmp_path_factory.mktemp("pki"))


@contextlib.asynccontextmanager
async def mtls_bootstrap(credentials: Credentials, registry: WorkerRegistry) -> AsyncIterator[str]:
    """A bootstrap serving ``registry`` over mTLS: a worker slot belongs to the
    certificate that registered it."""
    servicer = BootstrapServicer(RoomTable(), registry, owners=True)
    server = await start_server(
        [(SERVICE_NAME, lambda s: add_bootstrap_servicer(servicer, s))], host="127.0.0.1", port=0,
        security=credentials.security("server"),
    )
    try:
        yield server.address
    finally:
        await server.stop(0)


async def test_another_credential_announcing_topologies_cannot_drop_the_real_pending_one(credentials: Credentials) -> None:
    """Before a topology is complete, the pending ones were bounded for all callers
    together, the least recently updated dropped first: a caller with any certificate of
    the CA announced MAX_CANDIDATES topologies of its own, the real prefill's pending
    topology went with its first worker, and its last worker left it 1 of 2 for good."""
    async with mtls_bootstrap(credentials, WorkerRegistry()) as address:
        async with credentials.security("prefill").channel(address) as pc, credentials.security("intruder").channel(address) as ic:
            prefill, intruder = pb_grpc.BootstrapServiceStub(pc), pb_grpc.BootstrapServiceStub(ic)
            await prefill.RegisterWorker(pb.RegisterWorkerRequest(worker=worker(0), parallel_info=parallel_info(dp=2)), timeout=10)
            for n in range(3, 3 + 2 * MAX_CANDIDATES):  # a slot of each topology, at an address of its own
                await intruder.RegisterWorker(
                    pb.RegisterWorkerRequest(worker=worker(n - 1, address=f"10.6.6.6:{n}"), parallel_info=parallel_info(dp=n)), timeout=10
                )
            last = await prefill.RegisterWorker(pb.RegisterWorkerRequest(worker=worker(1), parallel_info=parallel_info(dp=2)), timeout=10)
            assert (last.registered_workers, last.expected_workers) == (2, 2)
            found = await intruder.GetWorkers(pb.GetWorkersRequest(dp_rank=1), timeout=10)
            assert [w.transfer_address for w in found.workers] == ["10.0.0.1:7000"]


async def test_pending_workers_over_the_limit_for_all_callers_are_resource_exhausted(credentials: Credentials) -> None:
    """Other identities hold MAX_PENDING_WORKERS pending workers: a new one is refused
    RESOURCE_EXHAUSTED naming the limit, and the others' registrations go on."""
    registry = WorkerRegistry()
    held = {"cn:a": MAX_WORKERS - 1, "cn:b": MAX_WORKERS - 1, "cn:c": MAX_PENDING_WORKERS - 2 * (MAX_WORKERS - 1)}
    for page_size, (who, n) in zip((16, 32, 64), held.items()):
        for dp in range(n):  # none of the three topologies is complete
            registry.register(worker(dp), parallel_info(dp=MAX_WORKERS, page_size=page_size), owner=who)
    async with mtls_bootstrap(credentials, registry) as address:
        async with credentials.security("intruder").channel(address) as ic:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await pb_grpc.BootstrapServiceStub(ic).RegisterWorker(
                    pb.RegisterWorkerRequest(worker=worker(0), parallel_info=parallel_info(dp=2)), timeout=10
                )
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
    assert f"the limit for all registrants together (MAX_PENDING_WORKERS={MAX_PENDING_WORKERS})" in (e.value.details() or "")
    assert "of cn:intruder" in (e.value.details() or "")
    assert registry.held == MAX_PENDING_WORKERS and not registry.registered_by("cn:intruder")
