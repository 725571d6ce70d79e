"""The prefill's prefix cache through a real 1p1d cluster: reuse is exact and visible.

Groups of prompts share a prefix several pages long. The first prompt of each group runs
alone (its full pages become cached), the rest run at once; with prefill TP 1 and TP 2
(every rank keeps a cache of its own). The prefill's pool is small,
so later groups evict earlier ones while requests hold pages. Every output must equal
colocated generation of the same prompt without any cache (greedy and seeded sampling),
the prefill's metrics must show hits (prompt tokens = hits + computed), evictions must
have happened, and afterwards nothing is held.
"""

from __future__ import annotations

import dataclasses
import random

import grpc
import pytest
import pytest_asyncio

from pdgrpc.cluster import Cluster, load_topology
from pdgrpc.state.prefix_cache import block_hashes
from pdgrpc.v1 import generate_pb2_grpc
from tests.e2e.harness import Case, Counters, generate_all, reference_outputs_for, skip_unless_transport, wait_nothing_held

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(300)]

PAGE = 16
POOL_PAGES = 28  # the prefill's pool: fewer pages than the prompts' distinct full pages
TP_SCRATCH = 1024 // PAGE  # a TP rank's scratch pages: one prompt of max-prompt-tokens
# (chunk size, where the compute runs, prefill TP size): mid-page and page-aligned chunks,
# both TP 1 compute modes, and a TP 2 group whose ranks agree on each prompt's cached prefix.
PARAMS = [(24, "process", 1), (64, "thread", 1), (40, "thread", 2)]


def _topology(chunk: int, compute_in: str, tp: int):
    t = load_topology("1p1d")
    pool = POOL_PAGES + (TP_SCRATCH if tp > 1 else 0)  # every rank: the same pages for requests
    # The decode's prefix cache off: these tests count what the prefill computes and sends,
    # which a decode holding the prefix would take over (local prefill, delta transfer).
    procs = tuple(
        dataclasses.replace(p, args={**p.args, "chunk-size": chunk, "num-pages": pool, "compute-in": compute_in, "tp-size": tp})
        if p.role == "prefill" else dataclasses.replace(p, args={**p.args, "no-decode-prefix-cache": True}) if p.role == "decode" else p
        for p in t.processes
    )
    return dataclasses.replace(t, name=f"1p1d-prefix-{chunk}-{compute_in}-tp{tp}", processes=procs)


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=PARAMS, ids=[f"chunk{c}-{m}-tp{tp}" for c, m, tp in PARAMS])
async def cluster(request):
    skip_unless_transport("tcp")
    async with Cluster(_topology(*request.param), transport="tcp", start_timeout=180, metrics=True) as c:
        yield c


def _groups(n_groups: int = 4, per_group: int = 5) -> list[list[Case]]:
    """Each group: a prefix of 5-7 pages (not page-aligned in one group) and questions of
    1-40 tokens; one question equal to the prefix alone, so its whole prompt is cached."""
    rng = random.Random(11)
    groups = []
    for g in range(n_groups):
        prefix = (256, *(rng.randrange(256) for _ in range(rng.randint(5, 7) * PAGE - 1 + (g == 1) * 5)))
        cases = []
        for q in range(per_group):
            tail = () if q == per_group - 1 else tuple(rng.randrange(256) for _ in range(rng.randint(1, 40)))
            sampled = q % 2 == 1
            cases.append(Case(prefix + tail, rng.randint(4, 12), temperature=0.9 if sampled else 0.0,
                              seed=rng.getrandbits(64) if sampled else 0, top_k=20 if q == 3 else 0))
        groups.append(cases)
    return groups


async def test_shared_prefixes_hit_the_cache_and_outputs_equal_a_cold_run(cluster):
    groups = _groups()
    flat = [c for g in groups for c in g]
    # More distinct full pages than the pool holds: later groups must evict earlier ones.
    assert len({h for c in flat for h in block_hashes(c.input_ids, PAGE)}) > POOL_PAGES
    expected = dict(zip(flat, reference_outputs_for(cluster.topology, flat)))
    before = await Counters.read(cluster)
    reported = 0
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        for cases in groups:
            first, _ = await generate_all(stub, cases[:1])  # computes the group's prefix cold
            await wait_nothing_held(cluster)  # its prefill room ended: its pages are cached
            rest, _ = await generate_all(stub, cases[1:])  # all at once: they share the cached pages
            for c, got in zip(cases, first + rest):
                assert (got.token_ids, got.finish_reason) == expected[c], c
            # GenerateResponse.cached_tokens: none for the cold prompt; for the others the
            # full pages they share with it, all but the page of their last token.
            assert first[0].cached_tokens == 0
            for c, got in zip(cases[1:], rest):
                shared = next((i for i, (a, b) in enumerate(zip(c.input_ids, cases[0].input_ids)) if a != b), len(c.input_ids))
                assert got.cached_tokens == min(shared, len(c.input_ids) - 1) // PAGE * PAGE, c
            reported += sum(g.cached_tokens for g in first + rest)
    await wait_nothing_held(cluster)
    after = await Counters.read(cluster)
    prompt = after.delta(before, "pdgrpc_prefill_prompt_tokens_total", "prefill")
    hits = after.delta(before, "pdgrpc_prefix_cache_hit_tokens_total", "prefill")
    computed = after.delta(before, "pdgrpc_prefill_computed_tokens_total", "prefill")
    tp = int(cluster.topology.by_role("prefill")[0].args.get("tp-size", 1))  # every rank counts what it computed
    assert prompt == tp * sum(len(c.input_ids) for c in flat)
    assert prompt == hits + computed and hits == tp * reported
    assert after.total("pdgrpc_prefix_cache_evictions_total", "prefill") > 0  # the pool ran short
