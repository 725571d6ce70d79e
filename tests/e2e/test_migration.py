"""End to end: a decode SIGKILLed mid-stream, and every client's output still equals
colocated generation token for token.

Real processes (``servers/2p2d.toml`` on tcp, and a 1p2d made from it on rdma: each topology and
each transport once, four cluster starts would add no check): greedy and seeded temperature-0.8
requests of 1024 tokens stream through the router; once a client holds 5 tokens, one
decode is SIGKILLed. The router migrates its streams to the other decode with prompt +
relayed tokens and the same seed; sampling is keyed by (seed, absolute position), so
the migrated output is bit-exact. Nothing stays held on the servers left.
"""

from __future__ import annotations

import asyncio
import tomllib

import pytest

from pdgrpc.cluster import Cluster, load_topology
from pdgrpc.cluster.topology import Topology, parse_topology, servers_dir
from pdgrpc.v1 import common_pb2, generate_pb2
from pdgrpc.v1.generate_pb2_grpc import GenerateServiceStub
from tests.e2e.harness import Case, reference_outputs_for, skip_unless_transport, wait_nothing_held
from tests.scrape import scrape

pytestmark = pytest.mark.timeout(240)

KILL_AT = 5
# Long enough that the kill lands mid-stream on a fast, idle host, and while the decode
# still generates when the client, reading 8 streams on a loaded host, lags behind it.
NEW_TOKENS = 1024


def _cases() -> list[Case]:
    text = b"Migrate me: the same seed draws the same tokens at the same positions. "
    return [
        Case(
            input_ids=(256, *text[i : i + 30]), max_new_tokens=NEW_TOKENS,
            temperature=0.8 if i % 2 else 0.0, seed=4242 + i if i % 2 else 0,
        )
        for i in range(8)
    ]


class _Started:
    """Set once every stream holds ``KILL_AT`` tokens, so the victim's streams are past
    their first token (a stream before it is retried, not migrated)."""

    def __init__(self, streams: int) -> None:
        self.kill = asyncio.Event()
        self._left = streams

    def reached(self) -> None:
        self._left -= 1
        if self._left == 0:
            self.kill.set()


async def _client(stub: GenerateServiceStub, c: Case, started: _Started) -> tuple[tuple[int, ...], str]:
    request = generate_pb2.GenerateRequest(
        input_ids=list(c.input_ids),
        sampling=common_pb2.SamplingParams(temperature=c.temperature, seed=c.seed, top_p=1.0, max_new_tokens=c.max_new_tokens),
    )
    ids: list[int] = []
    finish = ""
    async for m in stub.Generate(request, timeout=60):
        before = len(ids)
        ids += m.token_ids
        finish = m.finish_reason or finish
        if before < KILL_AT <= len(ids):
            started.reached()
    if len(ids) < KILL_AT:  # ended early: it holds no stream to wait for
        started.reached()
    return tuple(ids), finish


def _topology(name: str) -> Topology:
    """``2p2d``, or ``1p2d``: 2p2d without prefill-b, so a migrated stream goes back to the
    prefill that computed its prompt (and finds it in its prefix cache)."""
    if name == "2p2d":
        return load_topology(name)
    data = tomllib.loads((servers_dir() / "2p2d.toml").read_text())
    data["process"] = [p for p in data["process"] if p["name"] != "prefill-b"]
    (router,) = [p for p in data["process"] if p["role"] == "router"]
    router["prefill"] = ["prefill-a"]
    return parse_topology(data, name)


async def _busiest_decode(cluster: Cluster, topology: Topology, clients: list[asyncio.Future]) -> str:
    """The decode with the most active requests, polled until one has any."""
    names = [p.name for p in topology.processes if p.role == "decode"]
    while True:
        active = {name: (await cluster.stats(name)).active_requests for name in names}
        busiest = max(names, key=lambda n: active[n])
        if active[busiest] > 0 or all(t.done() for t in clients):
            return busiest
        await asyncio.sleep(0.002)


@pytest.mark.parametrize("transport, topology_name", [("tcp", "2p2d"), ("rdma", "1p2d")])
async def test_sigkill_of_a_decode_at_token_5_of_1024_migrates_every_stream_exactly(transport, topology_name, tmp_path):
    skip_unless_transport(transport)
    topology = _topology(topology_name)
    cases = _cases()
    expected = reference_outputs_for(topology, cases)
    async with Cluster(topology, transport=transport, log_dir=tmp_path / "logs", metrics=True) as cluster:
        async with cluster.client_channel() as channel:
            stub = GenerateServiceStub(channel)
            started = _Started(len(cases))
            clients = [asyncio.ensure_future(_client(stub, c, started)) for c in cases]
            await started.kill.wait()
            # The victim is the decode that streams most: prefix-affine routing may put every
            # stream on one decode, and which one is the router's choice.
            victim_name = await _busiest_decode(cluster, topology, clients)
            victim = cluster.procs[victim_name].process
            assert victim is not None
            victim.kill()
            outputs = await asyncio.gather(*clients)
            for i, (got, want) in enumerate(zip(outputs, expected)):
                assert got == want, f"case {i} ({'seeded 0.8' if i % 2 else 'greedy'}) differs from colocated generation"
            (endpoint,) = cluster.metrics_endpoints("router").values()
            router = await asyncio.to_thread(scrape, endpoint)
            migrated = router.value("pdgrpc_router_migrations_total", role="router", reason="peer_failure")
            assert migrated >= 1, "no stream was running on the killed decode"
            assert router.value("pdgrpc_requests_total", role="router", state="aborted") == 0
            await wait_nothing_held(cluster, names=[p.name for p in topology.processes if p.role in ("prefill", "decode") and p.name != victim_name])
