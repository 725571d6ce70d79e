"""End to end: SIGTERM drains a prefill holding 8 rooms and a decode running 8 streams of a
2p2d cluster, then a rolling restart under load restarts the others and the router.

Real processes (``servers/2p2d.toml`` under ``round_robin``, the launcher supervising).
The 8 are held by a gate: the other role's processes are stopped (SIGSTOP) while requests
go in one at a time, each counted by the GetStats of the process it reached, until the one
to drain counts 8. It gets SIGTERM; once its log says it drains those 8, the gate opens
(SIGCONT). The drained process finishes them and exits 0, and the launcher starts it
again. Then ``Cluster.restart`` restarts the other prefill and decode and the router one
at a time under load (the clients' channels retry what the draining router refuses). No
request fails, every output equals colocated generation, and nothing stays held: no
room, slot or page, by GetStats and by the metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import signal

import grpc
import pytest

from pdgrpc.cluster import Cluster, load_topology
from pdgrpc.cluster.client import generate
from pdgrpc.rpc.channels import ROUTER_CLIENT_OPTIONS
from pdgrpc.v1.generate_pb2_grpc import GenerateServiceStub
from tests.e2e.harness import Case, reference_outputs_for, skip_unless_transport, wait_nothing_held
from tests.eventually import eventually_async
from tests.scrape import scrape

# Five drains and restarts of real processes: minutes on a loaded 2-core host.
pytestmark = pytest.mark.timeout(600)

TOPOLOGY = "2p2d"
CLIENTS = 16
HELD = 8  # rooms (streams) the drained prefill (decode) holds at SIGTERM


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


async def _request(stub: GenerateServiceStub, c: Case) -> tuple[tuple[int, ...], str]:
    out = await generate(
        stub, input_ids=c.input_ids, max_new_tokens=c.max_new_tokens, temperature=c.temperature, seed=c.seed, top_p=1.0, timeout=60,
    )
    return out.token_ids, out.finish_reason


def _signal(cluster: Cluster, names: tuple[str, ...], signum: int) -> None:
    for name in names:
        process = cluster.procs[name].process
        assert process is not None and process.returncode is None, name
        process.send_signal(signum)


async def _held(cluster: Cluster, names: tuple[str, ...]) -> dict[str, int]:
    stats = await asyncio.gather(*(cluster.stats(n) for n in names))
    return {n: int(s.active_requests) for n, s in zip(names, stats)}


async def _drain_holding(
    cluster: Cluster, stub: GenerateServiceStub, cases: list[Case], expected: list[tuple[tuple[int, ...], str]],
    target: str, gate: tuple[str, ...],
) -> None:
    """Stop ``gate``; send ``cases`` (in turn) one at a time, each counted in flight by the
    process of ``target``'s role it reached, until ``target`` holds :data:`HELD`; SIGTERM
    ``target``, open the gate once it drains those (``pdgrpc_draining`` reads 1), and
    check that every request succeeds with the colocated output, ``target`` exits 0, comes
    back and serves, and nothing is held anywhere."""
    role = cluster.procs[target].spec.role
    counted = tuple(p.name for p in cluster.topology.processes if p.role == role)
    proc = cluster.procs[target]
    process = proc.process
    assert process is not None
    restarts, log_from = proc.restarts, proc.log_path.stat().st_size
    sent: list[tuple[int, asyncio.Future[tuple[tuple[int, ...], str]]]] = []
    _signal(cluster, gate, signal.SIGSTOP)
    try:
        for i in itertools.cycle(range(len(cases))):
            sent.append((i, asyncio.ensure_future(_request(stub, cases[i]))))

            async def all_counted() -> dict[str, int] | None:
                held = await _held(cluster, counted)
                return held if sum(held.values()) == len(sent) else None

            held = await eventually_async(all_counted, 20.0, 0.02, lambda: f"{len(sent)} requests sent, not all held in {counted}")
            if held[target] == HELD:
                break
            assert held[target] < HELD and len(sent) < 4 * HELD, held
        process.send_signal(signal.SIGTERM)
        await eventually_async(
            lambda: f"draining: {HELD} call(s) in flight" in proc.log_path.read_text()[log_from:], 20.0, 0.02,
            f"{target} did not log draining {HELD} calls",
        )
        metrics = await asyncio.to_thread(scrape, cluster.metrics_endpoints()[target])
        assert metrics.value("pdgrpc_draining", role=role) == 1
    finally:
        _signal(cluster, gate, signal.SIGCONT)
    outcomes = await asyncio.gather(*(f for _, f in sent), return_exceptions=True)
    failed = [f"case {i}: {o}" for (i, _), o in zip(sent, outcomes) if isinstance(o, BaseException)]
    assert failed == [], failed
    for (i, _), o in zip(sent, outcomes):
        assert o == expected[i], f"case {i} differs from colocated generation"
    assert await asyncio.wait_for(process.wait(), 45) == 0, proc.log_tail()
    assert "drain_timeout" not in proc.log_path.read_text()[log_from:]
    await eventually_async(lambda: proc.restarts > restarts, 30.0, 0.1, f"{target} was not started again after its drain")
    await cluster.wait_serving(target)
    await wait_nothing_held(cluster)


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
        while not self._stop.is_set():
            try:
                ids, finish = await _request(self.stub, self.cases[i])
            except grpc.RpcError as exc:
                self.failed.append(f"case {i}: {exc.code().name}: {exc.details()}")
                continue
            self.done.append((i, ids, finish))

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


async def test_drains_and_a_rolling_restart_under_load_fail_no_request(tmp_path):
    """SIGTERM on a prefill with 8 rooms in flight and on a decode with 8 streams running,
    then a rolling restart of the other prefill and decode and the router under load: no
    request fails, every output equals colocated generation, every page is freed."""
    skip_unless_transport("tcp")
    topology = load_topology(TOPOLOGY)
    # round_robin: each request goes to the next prefill and decode (no local prefill).
    topology = dataclasses.replace(topology, processes=tuple(
        dataclasses.replace(p, args={**p.args, "policy": "round_robin"}) if p.role == "router" else p for p in topology.processes
    ))
    long_prompts = _cases(prompt_len=300, max_new_tokens=4)[: CLIENTS // 2]
    long_outputs = _cases(prompt_len=40, max_new_tokens=32)[CLIENTS // 2 :]
    cases = long_prompts + long_outputs
    expected = reference_outputs_for(topology, cases)
    async with Cluster(topology, transport="tcp", log_dir=tmp_path / "logs", supervise=True, metrics=True) as cluster:
        async with cluster.client_channel(options=ROUTER_CLIENT_OPTIONS) as channel:
            stub = GenerateServiceStub(channel)
            # Every channel connected before a gate stops the processes it reaches.
            for c in cases[:4]:
                await _request(stub, c)
            await _drain_holding(cluster, stub, long_prompts, expected[: CLIENTS // 2], "prefill-a", gate=("decode-a", "decode-b"))
            for c in cases[:4]:
                await _request(stub, c)
            await _drain_holding(cluster, stub, long_outputs, expected[CLIENTS // 2 :], "decode-a", gate=("prefill-a", "prefill-b"))

            load = Load(stub, cases)
            try:
                # Each as soon as the one before serves: the router reaches a restarted
                # instance at once (pdgrpc.rpc.channels). The router goes last; its
                # clients ride through (ROUTER_CLIENT_OPTIONS).
                served = len(load.done)
                for name in ("prefill-b", "decode-b", "router"):
                    await cluster.restart(name)
                await eventually_async(lambda: len(load.done) > served + CLIENTS, 30.0, 0.1, "the restarted cluster serves no load")
            finally:
                await load.stop()
            assert load.failed == [], load.failed[:5]
            for i, ids, finish in load.done:
                assert (ids, finish) == expected[i], f"case {i} differs from colocated generation"
            for name in ("prefill-b", "decode-b", "router"):
                assert "draining" in cluster.procs[name].log_path.read_text()
            await wait_nothing_held(cluster)
