"""End to end: SIGTERM drains a prefill or a decode of a 2p2d cluster under load, and a
rolling restart restarts the others and the router.

Real processes (``servers/2p2d.toml``, the launcher supervising): clients keep requests
running through the router while one prefill (with rooms in flight) and then one decode
(with streams running) get SIGTERM. The drained process finishes what it holds and exits
0, the launcher starts it again; new requests meanwhile go to the other instance. Then
``Cluster.restart`` restarts the other prefill and decode and the router one at a time
(the clients' channels retry what the draining router refuses). No request fails,
every output equals colocated generation, and nothing stays held.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import grpc
import pytest

from pdgrpc.cluster import Cluster, load_topology
from pdgrpc.cluster.client import generate
from pdgrpc.rpc.channels import ROUTER_CLIENT_OPTIONS
from pdgrpc.v1.generate_pb2_grpc import GenerateServiceStub
from tests.e2e.harness import HELD_FIELDS, Case, reference_outputs_for, skip_unless_transport
from tests.eventually import eventually_async

# Five drains and restarts of real processes: minutes on a loaded 2-core host.
pytestmark = pytest.mark.timeout(420)

TOPOLOGY = "2p2d"
CLIENTS = 16


def _cases(prompt_len: int, max_new_tokens: int) -> list[Case]:
    text = b"Drain me gently: every room commits before the server goes. "
    cases = []
    for i in range(CLIENTS):
        body = bytes((text * (prompt_len // len(text) + 2))[i : i + prompt_len - 1 - i % 5])
        sampled = i % 2 == 1
        cases.append(Case(
            input_ids=(256, *body), max_new_tokens=max_new_tokens, temperature=0.8 if sampled else 0.0,
            seed=1000 + i if sampled else 0,
        ))
    return cases


class Load:
    """``CLIENTS`` clients, each sending its case again and again until stopped."""

    def __init__(self, stub: GenerateServiceStub, cases: list[Case]) -> None:
        self.stub = stub
        self.cases = cases
        self.done: list[tuple[int, tuple[int, ...], str]] = []
        self.failed: list[str] = []
        self._stop = asyncio.Event()
        self._tasks = [asyncio.ensure_future(self._client(i)) for i in range(len(cases))]

    async def _client(self, i: int) -> None:
        c = self.cases[i]
        while not self._stop.is_set():
            try:
                out = await generate(
                    self.stub, input_ids=c.input_ids, max_new_tokens=c.max_new_tokens, temperature=c.temperature,
                    seed=c.seed, top_p=1.0, timeout=60,
                )
            except grpc.RpcError as exc:
                self.failed.append(f"case {i}: {exc.code().name}: {exc.details()}")
                continue
            self.done.append((i, out.token_ids, out.finish_reason))

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


async def _active(cluster: Cluster, name: str) -> int:
    return int((await cluster.stats(name)).active_requests)


async def _sigterm_when_busy(cluster: Cluster, name: str, at_least: int) -> int:
    """SIGTERM ``name`` once it holds ``at_least`` requests (or its busiest moment within
    15 s); returns how many it held then."""
    deadline = time.monotonic() + 15
    while True:
        held = await _active(cluster, name)
        if held >= at_least or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.005)
    proc = cluster.procs[name].process
    assert proc is not None
    proc.send_signal(signal.SIGTERM)
    return held


async def _nothing_held(cluster: Cluster, names: list[str]) -> None:
    held: dict[str, Any] = {}

    async def empty() -> bool:
        held.clear()
        for n in names:
            s = await cluster.stats(n)
            if h := {f: getattr(s, f) for f in HELD_FIELDS if getattr(s, f)}:
                held[n] = h
        return not held

    await eventually_async(empty, 20.0, 0.1, lambda: f"still held after the drain: {held}")


async def _drained_and_back(cluster: Cluster, name: str, at_least: int) -> int:
    """SIGTERM ``name`` once busy; it drains and exits 0, the launcher starts it again and
    it serves. Returns how many requests it held at the signal."""
    proc = cluster.procs[name]
    process = proc.process
    assert process is not None
    restarts = proc.restarts
    held = await _sigterm_when_busy(cluster, name, at_least)
    assert await asyncio.wait_for(process.wait(), 45) == 0, proc.log_tail()
    log = proc.log_path.read_text()
    assert "draining" in log and "drain_timeout" not in log

    await eventually_async(lambda: proc.restarts > restarts, 30.0, 0.1, f"{name} was not started again after its drain")
    await cluster.wait_serving(name)
    return held


async def test_drains_and_a_rolling_restart_under_load_fail_no_request(tmp_path):
    """SIGTERM on a prefill with rooms in flight (long prompts, computed chunk by chunk)
    and on a decode with streams running (long outputs), then a rolling restart of the
    other prefill and decode and the router, all under load: no request fails, every output equals
    colocated generation, nothing stays held."""
    skip_unless_transport("tcp")
    topology = load_topology(TOPOLOGY)
    cases = _cases(prompt_len=700, max_new_tokens=4)[: CLIENTS // 2] + _cases(prompt_len=40, max_new_tokens=64)[CLIENTS // 2 :]
    expected = reference_outputs_for(topology, cases)
    async with Cluster(topology, transport="tcp", log_dir=tmp_path / "logs", supervise=True) as cluster:
        async with cluster.client_channel(options=ROUTER_CLIENT_OPTIONS) as channel:
            load = Load(GenerateServiceStub(channel), cases)
            try:
                held_prefill = await _drained_and_back(cluster, "prefill-a", at_least=4)
                held_decode = await _drained_and_back(cluster, "decode-a", at_least=8)
                served = len(load.done)
                # The rolling restart of the rest, each as soon as the one before serves: the
                # router reaches a restarted instance at once (pdgrpc.rpc.channels). The
                # router goes last; its clients ride through (ROUTER_CLIENT_OPTIONS).
                for name in ("prefill-b", "decode-b", "router"):
                    await cluster.restart(name)
                await asyncio.sleep(0.5)  # the restarted ones serve too
            finally:
                await load.stop()
            assert held_prefill >= 1 and held_decode >= 1, (held_prefill, held_decode)
            assert load.failed == [], load.failed[:5]
            assert len(load.done) > served, "nothing was served during the rolling restart"
            for i, ids, finish in load.done:
                assert (ids, finish) == expected[i], f"case {i} differs from colocated generation"
            for name in ("prefill-b", "decode-b", "router"):
                assert "draining" in cluster.procs[name].log_path.read_text()
            await _nothing_held(cluster, [p.name for p in topology.processes if p.role in ("prefill", "decode")])
