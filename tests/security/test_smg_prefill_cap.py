"""smg's prefill legs count against ``--max-prefills-per-client``, as smg's.

A real ``python -m pdgrpc.prefill`` with ``--max-prefills-per-client 1``: smg's prefill
leg (``SglangScheduler.Generate`` with a bootstrap room) holds its room until a decode
asks for it; a second leg from the same caller while the first is open is refused
RESOURCE_EXHAUSTED naming the flag, like a second direct ``Prefill``. Before, smg's legs
went past the count, so one caller could hold every prefill room.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

pytest.importorskip("smg_grpc_proto", reason="smg's worker protocol needs the pdgrpc[gateway] extra")
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb  # noqa: E402
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc  # noqa: E402

from tests.decode.test_decode_server import ENGINE_FLAGS  # noqa: E402
from pdgrpc.v1 import prefill_pb2, prefill_pb2_grpc  # noqa: E402
from tests.eventually import eventually_async  # noqa: E402
from tests.prefill.procs import PrefillProc  # noqa: E402

pytestmark = pytest.mark.timeout(90)


def leg(room: int, port: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=f"cmpl-{room}", tokenized=pb.TokenizedInput(input_ids=[256, 65, 66, 67]),
        sampling_params=pb.SamplingParams(max_new_tokens=4),
        disaggregated_params=pb.DisaggregatedParams(bootstrap_host="127.0.0.1", bootstrap_port=port, bootstrap_room=room),
    )


async def test_a_second_smg_prefill_leg_over_the_cap_is_refused(tmp_path: Path) -> None:
    prefill = PrefillProc(
        [*ENGINE_FLAGS, "--transport", "tcp", "--max-prefills-per-client", "1", "--handshake-timeout", "20", "--drain-timeout", "1"],
        tmp_path,
    )
    try:
        address = prefill.address
        port = int(address.rpartition(":")[2])
        async with grpc.aio.insecure_channel(address) as ch:
            stub = pb_grpc.SglangSchedulerStub(ch)
            first = stub.Generate(leg(11, port), timeout=30)  # waits for a decode that never comes

            async def first_is_in() -> bool:  # its room waits up to --handshake-timeout
                reply = await prefill_pb2_grpc.PrefillServiceStub(ch).GetStats(prefill_pb2.GetStatsRequest(), timeout=10)
                return reply.stats.active_requests == 1

            await eventually_async(first_is_in, 20, 0.05, "the first leg is held by the prefill")
            assert not first.done()
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                async for _ in stub.Generate(leg(12, port), timeout=10):
                    pass
            assert ei.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-prefills-per-client" in (ei.value.details() or "")
            first.cancel()
    finally:
        prefill.stop()
