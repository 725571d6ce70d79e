"""smg's prefill legs count against ``--max-prefills-per-client``, as smg's.

A real ``python -m pdgrpc.prefill`` with ``--max-prefills-per-client 1``: smg's prefill
leg (``SglangScheduler.Generate`` with a bootstrap room) holds its room until a decode
asks for it; a second leg from the same caller while the first is open is refused
RESOURCE_EXHAUSTED naming the flag, like a second direct ``Prefill``. Before, smg's legs
went past the count, so one caller could hold every prefill room.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

pytest.importorskip("smg_grpc_proto", reason="smg's worker protocol needs the pdgrpc[gateway] extra")
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb  # noqa: E402
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc  # noqa: E402

from tests.decode.test_decode_server import ENGINE_FLAGS  # noqa: E402
from tests.eventually import eventually  # noqa: E402

pytestmark = pytest.mark.timeout(90)


def leg(room: int, port: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=f"cmpl-{room}", tokenized=pb.TokenizedInput(input_ids=[256, 65, 66, 67]),
        sampling_params=pb.SamplingParams(max_new_tokens=4),
        disaggregated_params=pb.DisaggregatedParams(bootstrap_host="127.0.0.1", bootstrap_port=port, bootstrap_room=room),
    )


async def test_a_second_smg_prefill_leg_over_the_cap_is_refused(tmp_path: Path) -> None:
    log_path = tmp_path / "prefill.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdgrpc.prefill", "--port", "0", *ENGINE_FLAGS, "--transport", "tcp",
             "--max-prefills-per-client", "1", "--handshake-timeout", "20", "--drain-timeout", "1"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        def ready() -> str | None:
            text = log_path.read_text(errors="replace")
            assert proc.poll() is None, text
            m = re.search(r"listening on (\S+:\d+)", text)
            return m.group(1) if m and "prefill ready" in text else None

        address = eventually(ready, 60.0, 0.1, "the prefill never got ready")
        port = int(address.rpartition(":")[2])
        async with grpc.aio.insecure_channel(address) as ch:
            stub = pb_grpc.SglangSchedulerStub(ch)
            first = stub.Generate(leg(11, port), timeout=30)  # waits for a decode that never comes
            await asyncio.sleep(3)  # the first leg is in (its room waits up to --handshake-timeout)
            assert not first.done()
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                async for _ in stub.Generate(leg(12, port), timeout=10):
                    pass
            assert ei.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-prefills-per-client" in (ei.value.details() or "")
            first.cancel()
    finally:
        proc.terminate()
        proc.wait(15)
