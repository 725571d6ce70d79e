"""Self-healing after a prefill worker dies, with real processes: a prefill (controller +
one worker, tcp) and a decode. Audit (issue 16): after SIGKILL of a prefill worker the
decode held its pages in quarantine for the whole abort lease, although nothing of the
dead process could still land."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import grpc
import pytest

from pdgrpc.engine.base import SamplingParams
from pdgrpc.serving.room_proof import draw_secret
from pdgrpc.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2
from tests.eventually import eventually_async
from tests.prefill.harness import new_room, prompt, sampling_to_proto
from tests.prefill.procs import ENGINE_FLAGS, PrefillProc, Proc

pytestmark = pytest.mark.timeout(180)
LEASE_S = 600  # far longer than the test: a release can only come from the replaced worker


async def test_quarantine_ends_once_the_dead_prefill_worker_is_replaced(tmp_path: Path) -> None:
    prefill = PrefillProc([*ENGINE_FLAGS, "--transport", "tcp", "--dp-size", "1"], tmp_path, "prefill")
    decode = Proc(
        [sys.executable, "-m", "pdgrpc.decode", "--host", "127.0.0.1", "--port", "0", *ENGINE_FLAGS,
         "--transport", "tcp", "--num-slots", "4", "--abort-lease", str(LEASE_S)],
        tmp_path, "decode",
    )
    try:
        address = decode.wait_for(r"pdgrpc decode listening on (\S+:\d+)", source="log").group(1)
        async with grpc.aio.insecure_channel(address) as ch:
            stub = decode_pb2_grpc.DecodeServiceStub(ch)

            async def stats() -> prefill_pb2.GetStatsResponse:
                return await stub.GetStats(prefill_pb2.GetStatsRequest(), timeout=5)

            # A Decode whose Prefill never comes: the worker keeps the handshake, the decode
            # holds pages and a slot waiting for KV.
            ids = prompt(20, 3)
            call = stub.Decode(decode_pb2.DecodeRequest(
                bootstrap_room=new_room(), input_ids=ids, sampling=sampling_to_proto(SamplingParams(), 4),
                prefill_bootstrap_address=prefill.bootstrap, room_secret=draw_secret(),
            ), timeout=120)
            await eventually_async(lambda: _holding(stub), 30, what="the decode holds pages")
            os.kill(prefill.worker_pids[0], signal.SIGKILL)
            call.cancel()  # the decode aborts the room; AbortRoom cannot reach the dead worker

            async def released() -> bool:
                s = (await stats()).stats
                return s.pages_in_use == 0 and s.pages_quarantined == 0 and s.slots_in_use == 0

            await eventually_async(released, 90, what="the quarantine ends before the lease")
        assert "prefill worker replaced (new generation)" in decode.log()
    finally:
        assert decode.stop() == 0, decode.log()[-3000:]
        prefill.stop()


async def _holding(stub: decode_pb2_grpc.DecodeServiceStub) -> bool:
    s = (await stub.GetStats(prefill_pb2.GetStatsRequest(), timeout=5)).stats
    return s.active_requests == 1 and s.pages_in_use > 0 and s.transport_rooms == 1
