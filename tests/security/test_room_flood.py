"""One worker looping ``RegisterDpRanks`` does not lock the others out of the room table.

A real ``python -m pdgrpc.bootstrap`` process under mTLS, dp 2, with a small table
(``--max-rooms 64``): the worker of dp rank 0 floods it with new rooms; the worker of
dp rank 1 keeps registering, a decode keeps querying, and a room the decode has already
found survives the flood. A flooder whose credential also holds the decode role, and
which queries its own rooms, gains nothing by it: a room its registrant queried still
counts against that registrant's quota and is still evicted first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import grpc
import pytest

from pdgrpc.rpc.certs import issue, make_ca
from pdgrpc.rpc.security import Security
from pdgrpc.v1 import bootstrap_pb2 as pb
from pdgrpc.v1 import bootstrap_pb2_grpc as pb_grpc
from tests.prefill.procs import BootstrapProc

MAX_ROOMS = 64
BATCH = 16


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, Security]]]:
    root = tmp_path_factory.mktemp("pki")
    ca = make_ca(root)
    certs = {name: issue(ca, root, name) for name in ("bootstrap", "flooder", "prefill", "decode")}
    with BootstrapProc(
        root, "--max-rooms", str(MAX_ROOMS), "--max-batch", str(BATCH),
        "--tls-cert", str(certs["bootstrap"].cert), "--tls-key", str(certs["bootstrap"].key), "--tls-ca", str(ca.cert),
    ) as bootstrap:
        yield bootstrap.address, {n: Security(cert=c.cert, key=c.key, ca=ca.cert) for n, c in certs.items()}


def register(rooms: list[int], rank: int) -> pb.RegisterDpRanksRequest:
    return pb.RegisterDpRanksRequest(bootstrap_rooms=rooms, dp_ranks=[rank] * len(rooms))


@pytest.mark.parametrize("self_queries", [False, True], ids=["registers", "registers-and-queries-its-own"])
async def test_a_flooding_worker_fails_no_one_else_and_queried_rooms_survive(
    cluster: tuple[str, dict[str, Security]], tmp_path: Path, self_queries: bool
) -> None:
    address, sec = cluster
    info = pb.ParallelInfo(tp_size=1, dp_size=2, pp_size=1, page_size=16, kv_dtype="float32", kv_layout="HND",
                           compatibility_hash=b"x", load_balance_method=pb.LOAD_BALANCE_METHOD_ROUND_ROBIN)
    channels = {n: sec[n].channel(address) for n in ("flooder", "prefill", "decode")}
    flooder, prefill, decode = (pb_grpc.BootstrapServiceStub(channels[n]) for n in ("flooder", "prefill", "decode"))
    try:
        for dp, stub in ((0, flooder), (1, prefill)):
            await stub.RegisterWorker(pb.RegisterWorkerRequest(
                worker=pb.WorkerInfo(dp_rank=dp, transfer_address=f"127.0.0.1:{1000 + dp}", transport="tcp"), parallel_info=info),
                timeout=10)
        await prefill.RegisterDpRanks(register([7], 1), timeout=10)
        found = await decode.QueryDpRanks(pb.QueryDpRanksRequest(bootstrap_rooms=[7]), timeout=10)
        assert [(e.bootstrap_room, e.dp_rank) for e in found.entries] == [(7, 1)]  # the decode is using room 7

        refused = 0
        for i in range(8 * MAX_ROOMS // BATCH):  # the flood: eight tables' worth of new rooms
            base = 1_000_000 + i * BATCH
            try:
                await flooder.RegisterDpRanks(register(list(range(base, base + BATCH)), 0), timeout=10)
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "flooder" in exc.details(), exc.details()
                refused += 1
            else:
                if self_queries:  # its certificate names no role, so it may query too
                    mine = await flooder.QueryDpRanks(pb.QueryDpRanksRequest(bootstrap_rooms=range(base, base + BATCH)), timeout=10)
                    assert len(mine.entries) == BATCH
            # Meanwhile the other worker registers a room and the decode finds it: never refused.
            room = 100 + i
            await prefill.RegisterDpRanks(register([room], 1), timeout=10)
            found = await decode.QueryDpRanks(pb.QueryDpRanksRequest(bootstrap_rooms=[room]), timeout=10)
            assert [e.bootstrap_room for e in found.entries] == [room]
        assert refused  # the flooder ran into its own cap

        found = await decode.QueryDpRanks(pb.QueryDpRanksRequest(bootstrap_rooms=[7]), timeout=10)
        assert [(e.bootstrap_room, e.dp_rank) for e in found.entries] == [(7, 1)]  # the queried room survived
    finally:
        for ch in channels.values():
            await ch.close()
