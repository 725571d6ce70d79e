"""pdgrpc's router with ``--policy cache_aware`` in front of 2 real prefills and 2 decodes
(both with ``--decode-prefix-cache``).

The router follows each prefill's and each decode's ``SubscribeKvEvents`` stream and sends
a prompt to the prefill, and to the decode, whose cache holds its prefix: requests sharing
a long prefix land on one prefill (its hit metric counts the shared pages; the other
prefill is asked nothing) and on one decode (it reuses the shared pages; the other decode
gets nothing), and when the holder is killed the next requests go to the other one
without an error. The tests run in order on one cluster: each kills what it tested last.
Over tcp only: the choices are the router's, the same whatever carries the KV.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal

import pytest
import pytest_asyncio

from pdgrpc.cluster import Cluster, load_topology
from pdgrpc.cluster.client import generate
from pdgrpc.cluster.topology import Topology
from pdgrpc.v1 import generate_pb2_grpc
from tests.e2e.harness import NO_LOCAL_PREFILL, skip_unless_transport, wait_published
from tests.scrape import scrape

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(300)]

PAGE = 16  # smg-2p2d's page size
PREFIX = [256, *(bytes(range(32, 127)) * 2 + b"! shared system prompt")]  # BOS + 212 bytes: 13 full pages
NAMES = ("prefill-a", "prefill-b")
DECODES = ("decode-a", "decode-b")


def topology() -> Topology:
    """smg-2p2d's prefills, its decodes with their prefix caches, and its router with
    cache_aware; no smg."""
    topo = load_topology("smg-2p2d")
    procs = []
    for p in topo.processes:
        if p.role == "router":
            # No local prefill: these tests count what the prefills compute.
            p = dataclasses.replace(p, args={**p.args, "policy": "cache_aware", **NO_LOCAL_PREFILL})
        if p.role == "decode":
            p = dataclasses.replace(p, args={**p.args, "decode-prefix-cache": True})
        if p.role != "smg":
            procs.append(p)
    return dataclasses.replace(topo, processes=tuple(procs))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster():
    skip_unless_transport("tcp")
    async with Cluster(topology(), transport="tcp", start_timeout=180, metrics=True) as c:
        yield c


def prefill_counter(cluster: Cluster, name: str, sample: str) -> float:
    """``sample`` of prefill ``name``'s one worker (dp 1), which counts what it computed."""
    return scrape(cluster.metrics_endpoints("prefill")[f"{name}/dp0"]).value(sample)


def decode_counter(cluster: Cluster, name: str, sample: str, **labels: str) -> float:
    try:
        return scrape(cluster.metrics_endpoints("decode")[name]).value(sample, **labels)
    except KeyError:  # a labelled counter never incremented
        return 0.0


async def test_a_shared_prefix_goes_to_its_holder_and_elsewhere_once_it_dies(cluster):
    async with cluster.client_channel() as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        await generate(stub, input_ids=[*PREFIX, *b" first question?"], max_new_tokens=2)
        holder = next(n for n in NAMES if prefill_counter(cluster, n, "pdgrpc_prefill_prompt_tokens_total") > 0)
        other = next(n for n in NAMES if n != holder)
        shared_pages = len(PREFIX) // PAGE
        await wait_published(cluster, holder, shared_pages, decode=holder in DECODES)

        for i in range(4):
            await generate(stub, input_ids=[*PREFIX, *f" question number {i}?".encode()], max_new_tokens=2)
        assert prefill_counter(cluster, holder, "pdgrpc_prefix_cache_hit_tokens_total") >= 4 * shared_pages * PAGE
        assert prefill_counter(cluster, other, "pdgrpc_prefill_prompt_tokens_total") == 0  # all went to the holder

        os.kill(cluster.procs[holder].pid, signal.SIGKILL)
        for i in range(3):  # the first may go to the dead one: the router retries it on the other
            c = await generate(stub, input_ids=[*PREFIX, *f" after the crash {i}?".encode()], max_new_tokens=2)
            assert len(c.token_ids) == 2
        assert prefill_counter(cluster, other, "pdgrpc_prefill_prompt_tokens_total") > 0


async def test_a_shared_prefix_goes_to_the_decode_holding_it_and_elsewhere_once_it_dies(cluster):
    prefix = [256, *(bytes(range(126, 31, -1)) + b" another system prompt")]  # 118 tokens: 7 full pages
    async with cluster.client_channel() as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        before = {n: decode_counter(cluster, n, "pdgrpc_requests_total", state="finished") for n in DECODES}
        await generate(stub, input_ids=[*prefix, *b" first question?"], max_new_tokens=2)
        finished = {n: decode_counter(cluster, n, "pdgrpc_requests_total", state="finished") for n in DECODES}
        holder = next(n for n in DECODES if finished[n] > before[n])
        other = next(n for n in DECODES if n != holder)
        shared_pages = len(prefix) // PAGE
        await wait_published(cluster, holder, shared_pages, decode=holder in DECODES)

        reused = decode_counter(cluster, holder, "pdgrpc_decode_reused_tokens_total")
        for i in range(4):
            await generate(stub, input_ids=[*prefix, *f" question number {i}?".encode()], max_new_tokens=2)
        assert decode_counter(cluster, holder, "pdgrpc_decode_reused_tokens_total") - reused >= 4 * shared_pages * PAGE
        # all went to the holder
        assert decode_counter(cluster, other, "pdgrpc_requests_total", state="finished") == finished[other]

        os.kill(cluster.procs[holder].pid, signal.SIGKILL)
        for i in range(3):  # the first may go to the dead one: the router retries it on the other
            c = await generate(stub, input_ids=[*prefix, *f" after the crash {i}?".encode()], max_new_tokens=2)
            assert len(c.token_ids) == 2
        assert decode_counter(cluster, other, "pdgrpc_requests_total", state="finished") >= finished[other] + 3


async def test_requests_sent_at_once_with_a_new_prefix_compute_it_once(cluster):
    """The first of them goes to a prefill; the others follow it and wait for its Prefill
    call to end, so they find the prefix cached instead of computing it beside it (here on
    the prefill the earlier tests left alive)."""
    prefix = [256, *(bytes(range(40, 120)) * 2 + b" a third system prompt")]  # 182 tokens: 11 full pages
    alive = [n for n in NAMES if cluster.procs[n].returncode is None]
    hits = sum(prefill_counter(cluster, n, "pdgrpc_prefix_cache_hit_tokens_total") for n in alive)
    async with cluster.client_channel() as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        done = await asyncio.gather(*(
            generate(stub, input_ids=[*prefix, *f" all at once {i}?".encode()], max_new_tokens=2) for i in range(3)
        ))
    assert all(len(c.token_ids) == 2 for c in done)
    shared = len(prefix) // PAGE * PAGE
    assert sum(prefill_counter(cluster, n, "pdgrpc_prefix_cache_hit_tokens_total") for n in alive) - hits >= 2 * shared
