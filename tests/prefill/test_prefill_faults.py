"""A prefill worker process that dies, over the ``fake`` transport (no bytes move, the
control path is the same): the request it held fails with UNAVAILABLE naming it, the
controller logs it, round_robin routes around it, and the instance keeps serving. And a
controller that is killed outright takes its workers with it."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from pdgrpc.engine.base import SamplingParams
from pdgrpc.v1 import prefill_pb2
from tests.eventually import eventually_async
from tests.prefill.fake_decode import FakeDecode
from tests.prefill.procs import ENGINE_FLAGS, PrefillProc, pid_alive
from tests.prefill.harness import CONFIG, hold_on_dp1, new_room, prefill_stub, prompt, request, run_one

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def fake_rr(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefillProc]:
    p = PrefillProc(
        [*ENGINE_FLAGS, "--transport", "fake", "--dp-size", "2", "--load-balance-method", "round_robin",
         "--handshake-timeout", "30", "--worker-respawn-max-backoff", "0"],  # stays dead: routing around it
        tmp_path_factory.mktemp("faults"), "fake_rr",
    )
    try:
        yield p
    finally:
        p.stop()


async def test_worker_death_fails_its_requests_and_the_rest_keeps_serving(fake_rr: PrefillProc) -> None:
    d = FakeDecode(CONFIG, transport="fake")
    await d.start()
    ch, stub = await prefill_stub(fake_rr)
    try:
        # Over fake, a full request still goes through handshake and metadata "write".
        resp, r = await run_one(fake_rr, d, prompt(9, 1), SamplingParams(), query=True)
        assert resp.prompt_tokens == 9
        d.free(r)
        room, held = await hold_on_dp1(stub, prompt(12, 2))
        os.kill(fake_rr.worker_pids[1], signal.SIGKILL)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await asyncio.wait_for(held, 15)
        assert ei.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "prefill worker dp1 died (exit code -9)" in ei.value.details()
        log = fake_rr.log()
        assert re.search(r"prefill worker dp1 \(pid \d+\) exited with code -9; failing its 1 in-flight request", log)
        assert f"room={room} admitted" in log  # the worker logged the request it then lost
        # Pinned to the dead rank: a clear error. Unpinned: round_robin uses dp0 only.
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.Prefill(request(new_room(), prompt(3, 3), routed=1), timeout=30)
        assert ei.value.code() is grpc.StatusCode.UNAVAILABLE and "dp1 is dead" in ei.value.details()
        for i in range(3):
            resp, r = await run_one(fake_rr, d, prompt(4, 10 + i), SamplingParams(), query=True)
            assert resp.dp_rank == 0
            d.free(r)
        s = (await stub.GetStats(prefill_pb2.GetStatsRequest(), timeout=5)).stats
        assert (s.active_requests, s.pages_in_use, s.transport_rooms, s.pages_total) == (0, 0, 0, CONFIG.num_pages)
    finally:
        await ch.close()
        await d.close()


async def test_workers_exit_when_the_controller_is_killed(fake_rr: PrefillProc) -> None:
    survivor = fake_rr.worker_pids[0]
    assert pid_alive(survivor)
    fake_rr.proc.kill()  # no SIGTERM, no chance to stop its workers
    fake_rr.proc.wait(10)
    await eventually_async(lambda: not pid_alive(survivor), 15, what="the worker exits with its controller", interval=0.1)


def test_controller_exits_nonzero_when_no_worker_is_left(tmp_path: Path) -> None:
    p = PrefillProc([*ENGINE_FLAGS, "--transport", "fake", "--dp-size", "1", "--worker-respawn-max-backoff", "0"], tmp_path, "solo")
    try:
        os.kill(p.worker_pids[0], signal.SIGKILL)
        assert p.proc.wait(30) == 1
        assert "every prefill worker is gone; stopping the controller" in p.log()
    finally:
        p.stop()


async def test_a_killed_worker_is_started_again_and_the_instance_serves(tmp_path: Path) -> None:
    """Audit (issue 16): a dp-1 prefill controller exited when its worker died, and the
    instance stayed down until a person restarted it. Now the controller starts the
    worker again (capped backoff) and the instance serves again, over real tcp."""
    p = PrefillProc([*ENGINE_FLAGS, "--transport", "tcp", "--dp-size", "1"], tmp_path, "respawn")
    d = FakeDecode(CONFIG)
    await d.start()
    try:
        resp, r = await run_one(p, d, prompt(9, 1), SamplingParams(), query=False, dp_size=1)
        d.free(r)
        os.kill(p.worker_pids[0], signal.SIGKILL)
        await eventually_async(
            lambda: "prefill worker dp0 serves again" in p.log() or None, 60, what="the worker started again", interval=0.1
        )
        assert p.proc.poll() is None  # the controller never exited
        resp, r = await run_one(p, d, prompt(7, 2), SamplingParams(), query=False, dp_size=1)
        assert resp.prompt_tokens == 7 and resp.dp_rank == 0
        d.free(r)
    finally:
        await d.close()
        assert p.stop() == 0, p.log()[-3000:]
    assert re.search(r"prefill worker dp0 \(pid \d+\) exited with code -9", p.log())
