"""The early-handshake quota is per caller identity.

A real ``python -m pdgrpc.prefill`` (controller and worker) under mTLS. Two decodes with
their own certificates, both on 127.0.0.1: decode A floods the worker with early
handshakes (rooms no Prefill RPC claims) up to its per-peer quota, and its next one is
refused RESOURCE_EXHAUSTED naming the per-peer limit; decode B's handshakes, from the
same host, are still accepted.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import AsyncIterator, Iterator

import grpc
import pytest

from pdgrpc.prefill.worker_config import WorkerConfig
from pdgrpc.rpc.certs import CertFiles, issue, make_ca
from pdgrpc.rpc.roles import DECODE, PREFILL
from pdgrpc.rpc.security import Security
from pdgrpc.transport.base import Descriptor
from pdgrpc.v1 import bootstrap_pb2 as bpb
from pdgrpc.v1 import bootstrap_pb2_grpc, handshake_pb2_grpc
from tests.prefill.fake_decode import FakeDecode, Room
from tests.prefill.harness import CONFIG, new_room
from tests.prefill.procs import ENGINE_FLAGS, PrefillProc

pytestmark = pytest.mark.timeout(180)
QUOTA = WorkerConfig().early_handshakes_per_peer


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CertFiles]:
    d = tmp_path_factory.mktemp("pki")
    ca = make_ca(d)
    certs = {n: issue(ca, d, n, role=r) for n, r in (("prefill", PREFILL), ("decode-a", DECODE), ("decode-b", DECODE))}
    return {"ca": ca, **certs}


@pytest.fixture(scope="module")
def prefill(pki: dict[str, CertFiles], tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefillProc]:
    tls = ["--tls-cert", str(pki["prefill"].cert), "--tls-key", str(pki["prefill"].key), "--tls-ca", str(pki["ca"].cert)]
    p = PrefillProc([*ENGINE_FLAGS, "--transport", "tcp", "--dp-size", "1", *tls], tmp_path_factory.mktemp("prefill"))
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
async def decode() -> AsyncIterator[FakeDecode]:
    d = FakeDecode(CONFIG)
    await d.start()
    try:
        yield d
    finally:
        await d.close()


async def test_one_identity_flooding_early_handshakes_leaves_anothers_quota(
    prefill: PrefillProc, pki: dict[str, CertFiles], decode: FakeDecode,
) -> None:
    ca = pki["ca"].cert
    channels = {n: Security(cert=pki[n].cert, key=pki[n].key, ca=ca).channel(prefill.bootstrap) for n in ("decode-a", "decode-b")}
    try:
        bootstrap = bootstrap_pb2_grpc.BootstrapServiceStub(channels["decode-a"])
        (worker,) = (await bootstrap.GetWorkers(bpb.GetWorkersRequest(dp_rank=0), timeout=10)).workers
        writer = Descriptor.from_bytes(worker.transport_endpoint).instance_id
        for ch in channels.values():
            await ch.close()
        channels = {
            n: Security(cert=pki[n].cert, key=pki[n].key, ca=ca).channel(worker.transfer_address) for n in ("decode-a", "decode-b")
        }
        stubs = {n: handshake_pb2_grpc.HandshakeServiceStub(ch) for n, ch in channels.items()}

        async def early(who: str) -> None:
            req = decode.handshake_request(Room(new_room(), pages=[0], slot=0))
            req.transport_credential = decode.transport.issue_credential(writer)
            await stubs[who].Handshake(req, timeout=30)

        for start in range(0, QUOTA, 64):  # the flood, 64 calls at a time
            await asyncio.gather(*(early("decode-a") for _ in range(start, min(start + 64, QUOTA))))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await early("decode-a")
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"limit {QUOTA} per peer" in (refused.value.details() or "")
        for _ in range(3):  # the other decode, same host: untouched
            await early("decode-b")
    finally:
        for ch in channels.values():
            await ch.close()
