"""The decode's prefix cache through a real cluster: a prompt whose leading pages the
decode holds from an earlier request is sent only the rest (a delta transfer).

``GenerateResponse.bytes_transferred`` is (prompt pages - k) x page bytes + one metadata
row for k = 0, a partial hit and a full hit (the row alone); every output equals
colocated generation (greedy and seeded); the decode counts the reused tokens and
publishes what its cache stores (SubscribeKvEvents); a small decode pool makes later
prompts evict cached pages; afterwards nothing is held.
"""

from __future__ import annotations

import dataclasses
import random

import grpc
import pytest
import pytest_asyncio

from pdgrpc.cluster import Cluster, load_topology
from pdgrpc.cluster.reference import reference_engine
from pdgrpc.serving.metadata import metadata_layout
from pdgrpc.state.prefix_cache import block_hashes
from pdgrpc.v1 import decode_pb2_grpc, generate_pb2_grpc, prefill_pb2
from tests.e2e.harness import NO_LOCAL_PREFILL, Case, Counters, generate_all, reference_outputs_for, skip_unless_transport, wait_nothing_held

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(300)]

PAGE = 16
DECODE_PAGES = 24  # fewer than the last burst needs with the cache full: it must evict
# Each topology once, each transport at least once: 1p1d over tcp would add no check.
PARAMS = [("1p1d", "rdma"), ("tp2-to-tp1", "tcp"), ("tp1-to-tp2", "tcp")]


def _topology(name: str):
    """Decodes with a small prefix cache; the router never prefills locally (these tests
    count what the transfers move)."""
    t = load_topology(name)
    procs = tuple(
        dataclasses.replace(p, args={**p.args, "decode-prefix-cache": True, "num-pages": DECODE_PAGES}) if p.role == "decode"
        else dataclasses.replace(p, args={**p.args, **NO_LOCAL_PREFILL}) if p.role == "router" else p
        for p in t.processes
    )
    return dataclasses.replace(t, name=f"{name}-decode-prefix", processes=procs)


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=PARAMS, ids=[f"{n}-{t}" for n, t in PARAMS])
async def cluster(request):
    name, transport = request.param
    skip_unless_transport(transport)
    async with Cluster(_topology(name), transport=transport, start_timeout=180, metrics=True) as c:
        yield c


async def _wait_published(cluster: Cluster, hashes: set[int]) -> None:
    """Until the decode's SubscribeKvEvents reports ``hashes`` stored (bounded)."""
    stub = decode_pb2_grpc.DecodeServiceStub(cluster.channel("decode"))
    stored: set[int] = set()
    for _ in range(20):
        call = stub.SubscribeKvEvents(prefill_pb2.SubscribeKvEventsRequest(), timeout=1.0)
        try:
            async for batch in call:
                for e in batch.events:
                    if e.WhichOneof("event") == "stored":
                        stored.update(b.block_hash for b in e.stored.blocks)
                if hashes <= stored:
                    call.cancel()
                    return
        except grpc.aio.AioRpcError as exc:
            assert exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED, exc  # the deadline ends the stream
    raise AssertionError(f"the decode published {len(hashes & stored)} of the {len(hashes)} pages it holds")


def _page_bytes(cluster: Cluster) -> int:
    bufs = reference_engine(cluster.topology).kv_buffers()
    return sum(t[0].numel() * t.element_size() for t in (*bufs.k, *bufs.v))


async def test_a_prompt_the_decode_holds_in_part_moves_only_the_rest(cluster):
    rng = random.Random(5)
    a = (256, *(rng.randrange(256) for _ in range(82)))  # 83 tokens: 5 full pages and 3 tokens
    tail = tuple(rng.randrange(256) for _ in range(30))
    # (case, pages the decode holds when it arrives), one after the other.
    steps = [
        (Case(a, 8), 0),  # cold
        (Case(a[:64] + tail, 8, temperature=0.9, seed=17), 4),  # shares 4 full pages
        (Case(a[:80], 6), 5),  # page-aligned and all cached: the row alone
        (Case(a, 7, temperature=0.8, seed=3, top_k=20), 5),  # all but its partial last page
    ]
    # Then at once: prompts sharing the prefix (locked by all of them), and distinct ones
    # that need more pages than the pool has free while cached pages sit unused.
    burst = [Case(a[:48] + tuple(rng.randrange(256) for _ in range(rng.randint(1, 40))), 5, temperature=0.7 * (i % 2), seed=i)
             for i in range(4)]
    burst += [Case((256, *(rng.randrange(256) for _ in range(95))), 6) for _ in range(3)]
    cases = [c for c, _ in steps] + burst
    expected = dict(zip(cases, reference_outputs_for(cluster.topology, cases)))
    page_bytes, row_bytes = _page_bytes(cluster), metadata_layout().row_bytes
    before = await Counters.read(cluster)
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        for case, held in steps:
            (got,), _ = await generate_all(stub, [case])
            assert (got.token_ids, got.finish_reason) == expected[case], case
            pages = -(-len(case.input_ids) // PAGE)
            assert got.bytes_transferred == (pages - held) * page_bytes + row_bytes, (case, held)
            await wait_nothing_held(cluster)  # cached pages no request holds count as free
        # What the decode holds, it publishes: every full page of the prompts so far.
        await _wait_published(cluster, set(block_hashes(a, PAGE)) | set(block_hashes(steps[1][0].input_ids, PAGE)))
        got_burst, _ = await generate_all(stub, burst)
    for c, got in zip(burst, got_burst):
        assert (got.token_ids, got.finish_reason) == expected[c], c
    await wait_nothing_held(cluster)
    after = await Counters.read(cluster)
    reused = after.delta(before, "pdgrpc_decode_reused_tokens_total", "decode")
    assert reused >= sum(held for _, held in steps) * PAGE  # the burst's shared prefix may add more
    assert after.delta(before, "pdgrpc_requests_total", "decode", state="finished") == len(cases)


async def test_the_next_turn_of_a_chat_finds_the_answer_on_the_decode(cluster):
    """Turn n+1 is turn n's prompt, its answer and a new message: the decode holds every
    full page of turn n's prompt and answer (but the last token's), and is sent the rest."""
    rng = random.Random(11)
    prompt = (256, *(rng.randrange(256) for _ in range(40)))
    page_bytes, row_bytes = _page_bytes(cluster), metadata_layout().row_bytes
    held = 0  # full pages of the previous turn's prompt and fed-back answer
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        for n in range(3):
            case = Case(prompt, 20, temperature=0.8 * (n % 2), seed=n)
            (expected,) = reference_outputs_for(cluster.topology, [case])
            (got,), _ = await generate_all(stub, [case])
            assert (got.token_ids, got.finish_reason) == expected, n
            assert got.bytes_transferred == (-(-len(prompt) // PAGE) - held) * page_bytes + row_bytes, (n, held)
            await wait_nothing_held(cluster)
            held = (len(prompt) + len(got.token_ids) - 1) // PAGE
            prompt = prompt + tuple(got.token_ids) + tuple(rng.randrange(256) for _ in range(30))
