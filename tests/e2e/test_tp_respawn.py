"""Issue 16, self-healing with tensor parallelism: "the prefill controller respawns a dead
worker with capped backoff, and the instance serves again without a person".

A real cluster from ``servers/tp2-to-tp1`` over tcp (prefill TP 2: a controller and two
worker processes joined over gloo; a TP 1 decode; the router). The prefill loads the
test-only slow sender (``tests.e2e.faulty:SlowSenderTcp``) that holds each room's
metadata row back 1.5 s, so a request is in flight when one rank's worker is SIGKILLed.
A gloo group cannot take one rank back: the controller must restart the whole group,
and nobody touches the cluster afterwards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import signal
from pathlib import Path

import grpc
import pytest

from pdgrpc.cluster import Cluster, load_topology
from pdgrpc.cluster.client import generate
from tests.scrape import scrape
from pdgrpc.v1 import generate_pb2_grpc
from tests.e2e.harness import Case, reference_outputs_for, wait_nothing_held
from tests.eventually import eventually_async
from tests.prefill.procs import child_pids

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
CASE = Case(input_ids=(256, *b"tensor parallel groups restart as a whole"), max_new_tokens=4)


def _pages_sent(cluster: Cluster) -> int:
    return len(re.findall(r"slow sender: room=\d+ pages sent", cluster.procs["prefill"].log_path.read_text(errors="replace")))


async def test_a_killed_tp_rank_restarts_its_whole_group_and_the_instance_serves_again(tmp_path: Path) -> None:
    topology = load_topology("tp2-to-tp1")
    procs = tuple(
        dataclasses.replace(p, args={**p.args, "transport": "tests.e2e.faulty:SlowSenderTcp", "worker-respawn-max-backoff": 1})
        if p.role == "prefill"
        # The decode's prefix cache off: every repeat of CASE goes through the prefill (a
        # decode holding it would compute it itself, with no transfer in flight to catch).
        else dataclasses.replace(p, args={**p.args, "transport": "tests.e2e.faulty:ShortLeaseTcp", "no-decode-prefix-cache": True})
        if p.role == "decode" else p
        for p in topology.processes
    )
    topology = dataclasses.replace(topology, processes=procs)
    ((expected, _),) = reference_outputs_for(topology, [CASE])  # colocated generation
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}
    async with Cluster(topology, transport="tcp", log_dir=tmp_path, start_timeout=180, metrics=True, extra_env=env) as cluster:
        controller = cluster.procs["prefill"].pid
        assert controller is not None
        async with grpc.aio.insecure_channel(cluster.router_address) as ch:
            router = generate_pb2_grpc.GenerateServiceStub(ch)

            async def ask() -> tuple[int, ...]:
                return tuple((await generate(router, input_ids=CASE.input_ids, max_new_tokens=CASE.max_new_tokens, timeout=30)).token_ids)

            assert await ask() == expected
            old = sorted(child_pids(controller))
            assert len(old) == 2, old  # one worker process per tp rank

            # A request whose pages reached the decode and whose row is held back: in flight.
            sent = _pages_sent(cluster)
            task = asyncio.ensure_future(ask())
            await eventually_async(lambda: _pages_sent(cluster) > sent or task.done(), 60, 0.02, "a room is in flight")
            assert not task.done(), task.result()
            os.kill(old[-1], signal.SIGKILL)  # one rank of the group
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await asyncio.wait_for(task, 30)
            # Whoever notices first (the controller, the surviving rank whose gloo group
            # broke, the decode whose connection closed), the request fails naming the death.
            assert ei.value.code() is grpc.StatusCode.UNAVAILABLE, ei.value
            assert re.search(r"prefill worker dp0\.tp\d died \(exit code -9\)", ei.value.details()), ei.value.details()
            for name, role in (("prefill", "prefill"), ("router", "router")):  # the controller counts it
                counters = await asyncio.to_thread(scrape, cluster.metrics_endpoints()[name])
                assert counters.value("pdgrpc_aborts_total", role=role, reason="peer_failure") == 1, name

            async def serves() -> bool:
                try:
                    got = await ask()
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() is grpc.StatusCode.UNAVAILABLE, exc  # the group is restarting
                    return False
                assert got == expected
                return True

            await eventually_async(serves, 90, 0.5, "the prefill serves again after one tp rank was killed")
        new = child_pids(controller)
        assert len(new) == 2 and not set(new) & set(old), (old, new)  # both ranks are new processes
        log = cluster.procs["prefill"].log_path.read_text(errors="replace")
        assert "its tp group starts again as a whole" in log
        cluster.check()  # no process of the cluster exited
        await wait_nothing_held(cluster)  # GetStats, and every endpoint's gauges, at 0
