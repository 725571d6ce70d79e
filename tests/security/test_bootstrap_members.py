"""A bootstrap takes room registrations and failure records only from its own prefill.

A real ``python -m pdgrpc.bootstrap`` process under mTLS: the prefill's workers register
with the prefill's certificate. A caller with another certificate of the same CA (a
client's) can no longer register rooms (which filled the table for everyone) or record
failures (which pushed genuine records out): both are refused PERMISSION_DENIED, and
nothing is kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import grpc
import pytest

from pdgrpc.rpc.certs import CertFiles, issue, make_ca
from pdgrpc.rpc.security import Security
from pdgrpc.v1 import bootstrap_pb2 as pb
from pdgrpc.v1 import bootstrap_pb2_grpc as pb_grpc
from tests.prefill.procs import BootstrapProc

ROOM = 123_456_789


class Pki:
    def __init__(self, root: Path) -> None:
        ca = make_ca(root)
        self.ca = ca.cert
        self.server, self.prefill, self.client = (issue(ca, root, n) for n in ("bootstrap", "prefill", "client"))

    def security(self, cert: CertFiles) -> Security:
        return Security(cert=cert.cert, key=cert.key, ca=self.ca)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def bootstrap(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with BootstrapProc(
        tmp_path_factory.mktemp("bootstrap"), "--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key),
        "--tls-ca", str(pki.ca),
    ) as bootstrap:
        yield bootstrap.address


def stub(pki: Pki, cert: CertFiles, address: str) -> tuple[grpc.aio.Channel, pb_grpc.BootstrapServiceStub]:
    channel = pki.security(cert).channel(address)
    return channel, pb_grpc.BootstrapServiceStub(channel)


async def test_only_the_prefills_own_identity_registers_rooms_and_failures(pki: Pki, bootstrap: str) -> None:
    info = pb.ParallelInfo(tp_size=1, dp_size=2, pp_size=1, page_size=16, kv_dtype="float32", kv_layout="HND",
                           compatibility_hash=b"x", load_balance_method=pb.LOAD_BALANCE_METHOD_ROUND_ROBIN)
    pc, prefill = stub(pki, pki.prefill, bootstrap)
    cc, client = stub(pki, pki.client, bootstrap)
    async with pc, cc:
        for dp in range(2):
            await prefill.RegisterWorker(pb.RegisterWorkerRequest(
                worker=pb.WorkerInfo(dp_rank=dp, transfer_address=f"127.0.0.1:{1000 + dp}", transport="tcp"), parallel_info=info),
                timeout=10)
        failure = pb.RoomFailure(key=pb.RoomFailureKey(bootstrap_room=ROOM, tag=b"t" * 32), code=14, reason="x")
        for call in (client.RegisterDpRanks(pb.RegisterDpRanksRequest(bootstrap_rooms=[ROOM], dp_ranks=[1]), timeout=10),
                     client.RecordRoomFailures(pb.RecordRoomFailuresRequest(failures=[failure]), timeout=10)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "client" in err.value.details() and "registered no worker" in err.value.details()
        found = await prefill.QueryDpRanks(pb.QueryDpRanksRequest(bootstrap_rooms=[ROOM]), timeout=10)
        assert list(found.missing_rooms) == [ROOM]  # nothing of the refused call was kept
        await prefill.RegisterDpRanks(pb.RegisterDpRanksRequest(bootstrap_rooms=[ROOM], dp_ranks=[1]), timeout=10)
        found = await prefill.QueryDpRanks(pb.QueryDpRanksRequest(bootstrap_rooms=[ROOM]), timeout=10)
        assert [(e.bootstrap_room, e.dp_rank) for e in found.entries] == [(ROOM, 1)]
        assert (await prefill.RecordRoomFailures(pb.RecordRoomFailuresRequest(failures=[failure]), timeout=10)).recorded == 1
