"""Local prefill through a real cluster (tcp; 1p1d, and a TP 2 decode): the router sends a prompt whose part
the decode lacks is short to the decode alone (``DecodeRequest.local_prefill``), and the
decode computes it from the end of its cached prefix, between its decode steps.

Every output equals colocated generation (greedy and seeded); a local request moves no
KV (``bytes_transferred`` 0) and the prefill is asked nothing; a prompt whose uncached
part is longer than ``--local-prefill-tokens``, or of which the decode holds nothing,
still goes through the prefill; prompts
computed locally while other streams run leave those streams' tokens exact; afterwards
nothing is held.
"""

from __future__ import annotations

import dataclasses
import random

import grpc
import pytest
import pytest_asyncio

from pdgrpc.cluster import Cluster, load_topology
from pdgrpc.v1 import generate_pb2_grpc
from tests.e2e.harness import (
    Case, Counters, generate_all, reference_outputs_for, skip_unless_transport, wait_nothing_held, wait_published,
)

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(300)]

PAGE = 16
LOCAL_TOKENS = 48


def _topology(name: str):
    t = load_topology(name)
    procs = []
    for p in t.processes:
        if p.role == "decode":
            p = dataclasses.replace(p, args={**p.args, "decode-prefix-cache": True, "local-prefill-chunk": 32})
        if p.role == "router":
            p = dataclasses.replace(p, args={**p.args, "local-prefill-tokens": LOCAL_TOKENS})
        procs.append(p)
    return dataclasses.replace(t, name=f"{name}-local-prefill", processes=tuple(procs))


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["1p1d", "tp1-to-tp2"])
async def cluster(request):
    skip_unless_transport("tcp")
    async with Cluster(_topology(request.param), transport="tcp", start_timeout=180, metrics=True) as c:
        yield c


async def test_a_short_uncached_part_is_computed_on_the_decode_with_exact_output(cluster):
    rng = random.Random(3)
    history = (256, *(rng.randrange(256) for _ in range(99)))  # 100 tokens: 6 full pages
    first = Case(history, 6)  # the decode holds nothing: longer than 48 tokens, so a prefill computes it
    follow = [
        Case(history + tuple(rng.randrange(256) for _ in range(20)), 8),  # lacks 4 + 20 tokens
        Case(history + tuple(rng.randrange(256) for _ in range(30)), 8, temperature=0.9, seed=11),
        Case(history[:64], 5, temperature=0.7, seed=2, top_k=20),  # held whole: computes its last token
    ]
    longer = Case(history[:32] + tuple(rng.randrange(256) for _ in range(60)), 6)  # lacks 60: a prefill
    cold = Case((256, *(rng.randrange(256) for _ in range(20))), 4)  # short, but the decode holds none of it: a prefill
    cases = [first, *follow, longer, cold]
    expected = dict(zip(cases, reference_outputs_for(cluster.topology, cases)))
    before = await Counters.read(cluster)
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        (got,), _ = await generate_all(stub, [first])
        assert (got.token_ids, got.finish_reason) == expected[first]
        assert got.bytes_transferred > 0
        await wait_nothing_held(cluster)
        await wait_published(cluster, "decode", len(history) // PAGE, decode=True)
        mid = await Counters.read(cluster)
        for case in follow:
            (got,), _ = await generate_all(stub, [case])
            assert (got.token_ids, got.finish_reason) == expected[case], case
            assert got.bytes_transferred == 0, case  # nothing moved
        after_local = await Counters.read(cluster)
        for case in (longer, cold):
            (got,), _ = await generate_all(stub, [case])
            assert (got.token_ids, got.finish_reason) == expected[case], case
            assert got.bytes_transferred > 0, case
    await wait_nothing_held(cluster)
    after = await Counters.read(cluster)
    assert after_local.delta(mid, "pdgrpc_local_prefill_requests_total", "decode") == len(follow)
    assert after_local.delta(mid, "pdgrpc_requests_total", "prefill", state="finished") == 0  # the prefill was asked nothing
    assert after.delta(after_local, "pdgrpc_local_prefill_requests_total", "decode") == 0
    assert after.delta(before, "pdgrpc_requests_total", "decode", state="finished") == len(cases)


async def test_local_prefills_beside_running_streams_keep_every_output_exact(cluster):
    """Short suffixes of a prefix the decode holds, computed in chunks between the steps
    of long-running streams."""
    rng = random.Random(9)
    warm = Case((256, *(rng.randrange(256) for _ in range(63))), 4)  # leaves 4 full pages on the decode
    running = [Case((256, *(rng.randrange(256) for _ in range(70))), 40, temperature=0.8 * (i % 2), seed=i) for i in range(3)]
    short = [Case(warm.input_ids + tuple(rng.randrange(256) for _ in range(rng.randint(5, 40))), 10,
                  temperature=0.6 * (i % 2), seed=20 + i) for i in range(6)]
    cases = running + short
    expected = dict(zip([warm, *cases], reference_outputs_for(cluster.topology, [warm, *cases])))
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        (got_warm,), _ = await generate_all(stub, [warm])
        assert (got_warm.token_ids, got_warm.finish_reason) == expected[warm]
        await wait_nothing_held(cluster)
        await wait_published(cluster, "decode", 4, decode=True)
        before = await Counters.read(cluster)
        got, _ = await generate_all(stub, cases)
    for c, g in zip(cases, got):
        assert (g.token_ids, g.finish_reason) == expected[c], c
    await wait_nothing_held(cluster)
    after = await Counters.read(cluster)
    assert after.delta(before, "pdgrpc_local_prefill_requests_total", "decode") >= len(short)


async def test_a_burst_past_the_prefills_queue_is_shared_with_the_decode_exactly(cluster):
    """The router's default ``--local-prefill-queue``: prompts the decode holds nothing of,
    sent at once. The first three find the prefill's queue short and go there; once it
    holds more than two calls, prompts go to the decode while its own queue is the
    shorter. Every output equals colocated generation."""
    rng = random.Random(17)
    cases = [
        Case((256, *(rng.randrange(256) for _ in range(rng.randint(250, 500)))), rng.randint(3, 12),
             temperature=0.8 * (i % 3 == 1), seed=40 + i, top_k=20 * (i % 3 == 2))
        for i in range(12)
    ]
    expected = reference_outputs_for(cluster.topology, cases)
    await wait_published(cluster, "decode", 0, decode=True)  # the router knows the decode computes locally
    before = await Counters.read(cluster)
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        got, peak = await generate_all(generate_pb2_grpc.GenerateServiceStub(channel), cases)
    assert peak == len(cases)
    for c, g, want in zip(cases, got, expected):
        assert (g.token_ids, g.finish_reason) == want, c
    here = sum(g.bytes_transferred == 0 for g in got)
    assert here >= 1  # the decode took part of the burst
    assert len(cases) - here >= 3  # and the prefill the first three at least
    await wait_nothing_held(cluster)
    after = await Counters.read(cluster)
    assert after.delta(before, "pdgrpc_local_prefill_requests_total", "decode") == here
    assert after.delta(before, "pdgrpc_requests_total", "prefill", state="finished") == len(cases) - here
