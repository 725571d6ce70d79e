"""Early handshakes (a decode's handshake before its room's Prefill RPC) cannot be
turned against users.

A real ``python -m pdgrpc.prefill`` (controller and worker) under mTLS, on 127.0.0.1:

* the early-handshake quota is per caller identity: decode A floods the worker with early
  handshakes up to its per-peer quota, and its next one is refused RESOURCE_EXHAUSTED
  naming the per-peer limit; decode B's, from the same host, are still accepted;
* a room whose prefill never shows frees its pages on a short deadline: a real
  ``python -m pdgrpc.decode`` given a Decode whose Prefill never comes ends it
  DEADLINE_EXCEEDED after ``--claim-timeout`` (not ``--waiting-timeout``) and holds
  nothing after; a Decode whose Prefill comes, also a moment after it, is served exactly.
"""

from __future__ import annotations

import asyncio
import secrets
import sys
import time
from pathlib import Path
from typing import AsyncIterator, Iterator

import grpc
import pytest

from pdgrpc.engine.base import SamplingParams
from pdgrpc.engine.colocated import generate
from pdgrpc.engine.reference import ReferenceEngine
from pdgrpc.prefill.worker_config import WorkerConfig
from pdgrpc.rpc.certs import CertFiles, issue, make_ca
from pdgrpc.rpc.roles import DECODE, PREFILL, ROUTER
from pdgrpc.rpc.security import Security
from pdgrpc.transport.base import Descriptor
from pdgrpc.v1 import bootstrap_pb2 as bpb
from pdgrpc.v1 import bootstrap_pb2_grpc, decode_pb2, decode_pb2_grpc, handshake_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.decode.test_decode_server import assert_nothing_held
from tests.prefill.fake_decode import FakeDecode, Room
from tests.prefill.harness import CONFIG, new_room, sampling_to_proto
from tests.prefill.procs import ENGINE_FLAGS, PrefillProc, Proc

pytestmark = pytest.mark.timeout(180)
QUOTA = WorkerConfig().early_handshakes_per_peer
CLAIM_S = 2.0


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CertFiles]:
    d = tmp_path_factory.mktemp("pki")
    ca = make_ca(d)
    names = (("prefill", PREFILL), ("decode-a", DECODE), ("decode-b", DECODE), ("decode", DECODE), ("router", ROUTER))
    certs = {n: issue(ca, d, n, role=r) for n, r in names}
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
    async with FakeDecode(CONFIG) as d:
        yield d


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


def _tls(pki: dict[str, CertFiles], name: str) -> list[str]:
    return ["--tls-cert", str(pki[name].cert), "--tls-key", str(pki[name].key), "--tls-ca", str(pki["ca"].cert)]


@pytest.fixture(scope="module")
def decode_address(pki: dict[str, CertFiles], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    flags = [*ENGINE_FLAGS, "--transport", "tcp", "--num-slots", "8", "--no-decode-prefix-cache", "--metrics-port", "0",
             "--claim-timeout", str(CLAIM_S), "--waiting-timeout", "60", "--abort-lease", "60", "--num-pages", "256",
             *_tls(pki, "decode")]
    p = Proc([sys.executable, "-m", "pdgrpc.decode", "--host", "127.0.0.1", "--port", "0", *flags],
             tmp_path_factory.mktemp("decode"), "decode")
    try:
        yield p.wait_for(r"pdgrpc decode listening on (\S+:\d+)", source="log").group(1)
    finally:
        p.stop()


def _decode_request(prefill: PrefillProc, room: int, ids: list[int], secret: bytes) -> decode_pb2.DecodeRequest:
    return decode_pb2.DecodeRequest(
        bootstrap_room=room, request_id=f"r{room}", input_ids=ids, sampling=sampling_to_proto(SamplingParams(), 4),
        prefill_bootstrap_address=prefill.bootstrap, room_secret=secret,
    )


async def test_a_room_whose_prefill_never_shows_frees_its_pages_after_the_claim_timeout(
    prefill: PrefillProc, pki: dict[str, CertFiles], decode_address: str,
) -> None:
    router = Security(cert=pki["router"].cert, key=pki["router"].key, ca=pki["ca"].cert)
    ids = [5, 6, 7, 8, 9, 10]
    (want,) = generate(ReferenceEngine(CONFIG), [tuple(ids)], 4)
    async with router.channel(decode_address) as dch, router.channel(prefill.address) as pch:
        decode, prefill_stub = decode_pb2_grpc.DecodeServiceStub(dch), prefill_pb2_grpc.PrefillServiceStub(pch)

        async def serve(delay: float) -> list[int]:
            room, secret = new_room(), secrets.token_bytes(32)
            call = asyncio.ensure_future(_tokens(decode, _decode_request(prefill, room, ids, secret)))
            await asyncio.sleep(delay)
            req = prefill_pb2.PrefillRequest(bootstrap_room=room, request_id=f"r{room}", input_ids=ids,
                                             sampling=sampling_to_proto(SamplingParams(), 4), room_secret=secret)
            await prefill_stub.Prefill(req, timeout=30)
            return await call

        for delay in (0.0, 0.5):  # the Prefill with the Decode, and a moment after it
            assert await serve(delay) == list(want.token_ids)

        began = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as ended:  # no Prefill, ever
            await _tokens(decode, _decode_request(prefill, new_room(), ids, secrets.token_bytes(32)))
        took = time.monotonic() - began
        print(f"a Decode whose Prefill never came ended after {took:.2f} s (--claim-timeout {CLAIM_S:g})")
        assert ended.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED, ended.value.details()
        assert "--claim-timeout" in (ended.value.details() or "")
        assert CLAIM_S <= took < CLAIM_S + 5, took
        await assert_nothing_held(decode)  # its pages are back, within seconds: not at --waiting-timeout


async def _tokens(stub: decode_pb2_grpc.DecodeServiceStub, req: decode_pb2.DecodeRequest) -> list[int]:
    return [t async for m in stub.Decode(req, timeout=60) for t in m.token_ids]
