"""smg's ``Abort`` ends only a request of the identity that started it.

A colocated server as smg's worker over a real gRPC port under mTLS with roles, and two
gateway certificates of the cluster's CA (two smg processes). A request that ``smg-a``
started keeps running when ``smg-b`` aborts it -- the answer is the one an unknown id
gets -- and ends when ``smg-a`` does.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import grpc
import pytest

pytest.importorskip("smg_grpc_proto", reason="the gateway extra (pdgrpc[gateway]) is not installed")

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb  # noqa: E402
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc  # noqa: E402

from pdgrpc.cluster import load_topology  # noqa: E402
from pdgrpc.cluster.credentials import ClusterCredentials  # noqa: E402
from pdgrpc.cluster.reference import reference_engine  # noqa: E402
from pdgrpc.colocated.server import ColocatedServer  # noqa: E402
from pdgrpc.gateway import colocated_service  # noqa: E402
from pdgrpc.rpc.drain import Drain  # noqa: E402
from pdgrpc.rpc.server import start_server  # noqa: E402
from tests.eventually import eventually_async  # noqa: E402

pytestmark = pytest.mark.timeout(60)


async def test_only_the_starting_gateway_may_abort(tmp_path: Path) -> None:
    creds = ClusterCredentials(tmp_path / "security", {"worker": "colocated", "smg-a": "smg", "smg-b": "smg"}, tls=True, token=False)
    impl = ColocatedServer(reference_engine(load_topology("colocated")), chunk_tokens=64)
    server = await start_server([colocated_service(impl, argparse.Namespace(served_model_name="m"), Drain())], what="test colocated",
                                security=creds.security("worker"))
    try:
        async with creds.security("smg-a").channel(server.address) as a, creds.security("smg-b").channel(server.address) as b:
            mine, theirs = pb_grpc.SglangSchedulerStub(a), pb_grpc.SglangSchedulerStub(b)
            req = pb.GenerateRequest(
                request_id="long", tokenized=pb.TokenizedInput(input_ids=(256,)), stream=True, logprob_start_len=-1,
                sampling_params=pb.SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=1500, n=1, ignore_eos=True),
            )
            call = mine.Generate(req)
            await call.read()
            unknown = await theirs.Abort(pb.AbortRequest(request_id="nothing-runs"))
            refused = await theirs.Abort(pb.AbortRequest(request_id="long"))
            assert not refused.success
            assert refused.message == unknown.message.replace("nothing-runs", "long")  # no oracle
            assert (await call.read()).HasField("chunk")  # still running
            assert (await mine.Abort(pb.AbortRequest(request_id="long"))).success
            with pytest.raises(grpc.aio.AioRpcError) as info:
                while await call.read() is not grpc.aio.EOF:
                    pass
            assert info.value.code() is grpc.StatusCode.CANCELLED
            await eventually_async(lambda: impl.active_requests() == 0, 10, 0.05, lambda: "the aborted request is still held")
    finally:
        await server.stop(0)
        await impl.close()
