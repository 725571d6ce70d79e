"""Shared by the process-fault tests (``test_process_faults``, ``test_tp_process_faults``):
a cluster whose prefill holds each room's metadata row back after sending its pages, so a
kill lands mid-transfer, and the steps those tests take against it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import signal
from pathlib import Path
from typing import AsyncIterator

import grpc
import pytest

from pdgrpc.cluster import Cluster, load_topology
from pdgrpc.cluster.client import generate
from pdgrpc.v1 import generate_pb2_grpc
from tests.e2e.harness import HELD_FIELDS, NO_LOCAL_PREFILL
from tests.eventually import eventually_async
from tests.prefill.procs import child_pids

REPO = Path(__file__).resolve().parents[2]
# The functional bound: what a dead peer held is free again this soon.
FREE_WITHIN_S = 2.0
# The prefill's and the decode's transports, by the cluster's transport.
WRAPPERS = {"tcp": "tests.e2e.faulty:SlowSenderTcp", "rdma": "tests.e2e.faulty:SlowSenderRdma"}
DECODE_WRAPPERS = {"tcp": "tests.e2e.faulty:ShortLeaseTcp", "rdma": "tests.e2e.faulty:ShortLeaseRdma"}
PROMPT = (256, *b"disaggregated serving moves KV pages")


@contextlib.asynccontextmanager
async def faulty_cluster(transport: str, topology_name: str, log_dir: Path) -> AsyncIterator[Cluster]:
    """``topology_name`` over ``transport`` with the test-only slow sender on the prefill
    (respawning its worker after 1 s at most) and the short-lease receiver on the decode;
    the router never has a decode prefill a prompt itself, so every request is a transfer."""
    topology = load_topology(topology_name)
    procs = tuple(
        dataclasses.replace(p, args={**p.args, "transport": WRAPPERS[transport], "worker-respawn-max-backoff": 1})
        if p.role == "prefill"
        else dataclasses.replace(p, args={**p.args, "transport": DECODE_WRAPPERS[transport], "decode-prefix-cache": True})
        if p.role == "decode"
        else dataclasses.replace(p, args={**p.args, **NO_LOCAL_PREFILL}) if p.role == "router" else p
        for p in topology.processes
    )
    topology = dataclasses.replace(topology, processes=procs)
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])),
        "PDGRPC_TEST_MARKER_DIR": str(log_dir),
    }
    async with Cluster(topology, transport=transport, log_dir=log_dir, start_timeout=180, metrics=True, extra_env=env) as c:
        yield c


def log_of(cluster: Cluster, name: str) -> str:
    """The text of process ``name``'s log so far."""
    return cluster.procs[name].log_path.read_text(errors="replace")


async def mid_transfer(cluster: Cluster, router: generate_pb2_grpc.GenerateServiceStub) -> asyncio.Task:
    """Start a request; return once its pages are sent and its row is held back."""
    before = len(re.findall(r"slow sender: room=\d+ pages sent", log_of(cluster, "prefill")))
    task = asyncio.ensure_future(generate(router, input_ids=PROMPT, max_new_tokens=4, timeout=60))

    def writing() -> bool:
        return len(re.findall(r"slow sender: room=\d+ pages sent", log_of(cluster, "prefill"))) > before or task.done()

    await eventually_async(writing, 60, 0.02, "the prefill sent the pages and holds the row")
    assert not task.done(), task.result()
    return task


async def held(cluster: Cluster, name: str, seen: dict) -> bool:
    """Whether ``name`` holds nothing now; ``seen`` is refilled with what it does hold."""
    stats = await cluster.stats(name)
    seen.clear()
    seen.update({f: getattr(stats, f) for f in HELD_FIELDS if getattr(stats, f)})
    return not seen


async def kill_prefill_worker_mid_transfer(cluster: Cluster, router: generate_pb2_grpc.GenerateServiceStub) -> int:
    """SIGKILL the prefill's worker while a request's row is held back; the request ends
    UNAVAILABLE. Returns the killed worker's pid."""
    task = await mid_transfer(cluster, router)
    (worker,) = child_pids(cluster.procs["prefill"].pid)
    os.kill(worker, signal.SIGKILL)
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await asyncio.wait_for(task, 30)
    assert ei.value.code() is grpc.StatusCode.UNAVAILABLE, ei.value
    return worker


async def serves_again(cluster: Cluster, router: generate_pb2_grpc.GenerateServiceStub, expected: tuple[int, ...]) -> None:
    """Without intervention the controller starts the worker again, and it serves."""
    async def serves() -> bool:
        try:
            again = await generate(router, input_ids=PROMPT, max_new_tokens=4, timeout=30)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() is grpc.StatusCode.UNAVAILABLE, exc
            return False
        assert again.token_ids == expected
        return True

    await eventually_async(serves, 60, 0.5, "the prefill serves again after its worker was killed")
