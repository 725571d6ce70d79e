"""End to end: real processes from ``servers/*.toml`` on 127.0.0.1, requests through the router.

One cluster per (topology, transport) pair below, started once for this module and checked
several ways (1p1d over both transports, each dp 2 topology over one: every topology and
every transport runs, and a further pair would add no check): 54 prompts with all of them in flight at once must come back token for token equal
to colocated generation (same engine config, same seeds, run in this process), and
after every check GetStats on every prefill and decode must read zero held resources.
Failure propagation (a refused prompt, a dp-rank conflict, a client cancel before and
after the first token) must reach the client as a clear gRPC error with no token from
incomplete KV, and leave nothing allocated either.

The clusters serve metrics: after every check the live gauges scraped over HTTP from
each decode, prefill worker and router read 0, and the request counters moved exactly
as the check's requests ended (finished, refused, aborted and why) on each role.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from pdgrpc.cluster import Cluster
from pdgrpc.cluster.client import generate
from pdgrpc.engine.tokenizer import ByteTokenizer
from pdgrpc.v1 import common_pb2, generate_pb2, generate_pb2_grpc

from tests.e2e.harness import (
    TOPOLOGIES,
    TRANSPORTS,
    Counters,
    generate_all,
    may_prefill_locally,
    moving_kv,
    prompt_cases,
    reference_outputs,
    skip_unless_transport,
    wait_nothing_held,
)
from tests.prefill.procs import child_pids

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(300)]

PARAMS = [("1p1d", "tcp"), ("1p1d", "rdma"), ("prefill-dp2-round-robin", "rdma"), ("prefill-dp2-follow-room", "tcp")]
assert {t for t, _ in PARAMS} == set(TOPOLOGIES) and {x for _, x in PARAMS} == set(TRANSPORTS)
_REFERENCE: dict[tuple, list] = {}


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=PARAMS, ids=[f"{t}-{x}" for t, x in PARAMS])
async def cluster(request):
    topology, transport = request.param
    skip_unless_transport(transport)
    async with Cluster(moving_kv(topology), transport=transport, start_timeout=180, metrics=True) as c:
        yield c


@pytest_asyncio.fixture(loop_scope="module")
async def before(cluster):
    """The cluster's counters before the test (each test checks what it changed)."""
    return await Counters.read(cluster)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def router(cluster):
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        yield generate_pb2_grpc.GenerateServiceStub(channel)


def page_and_chunk(cluster: Cluster) -> tuple[int, int]:
    page = int(cluster.topology.engine.get("page-size", 16))
    chunk = int(cluster.topology.by_role("prefill")[0].args.get("chunk-size", 512))
    return page, chunk


def reference_for(cluster: Cluster, cases):
    key = (tuple(sorted(cluster.topology.engine.items())), tuple(cases))
    if key not in _REFERENCE:
        _REFERENCE[key] = reference_outputs(cluster.topology.name, cases)
    return _REFERENCE[key]


async def test_outputs_equal_colocated_generation(cluster, router, before):
    page, chunk = page_and_chunk(cluster)
    cases = prompt_cases(page, chunk)
    assert any(len(c.input_ids) < page for c in cases)
    assert any(len(c.input_ids) % page == 0 for c in cases)
    assert any(len(c.input_ids) > chunk for c in cases)
    expected = reference_for(cluster, cases)

    got, peak = await generate_all(router, cases)
    assert peak >= 16
    tok = ByteTokenizer()
    mismatches = [
        (i, len(c.input_ids), c.temperature, g.token_ids, e_ids)
        for i, (c, g, (e_ids, _)) in enumerate(zip(cases, got, expected))
        if g.token_ids != e_ids
    ]
    assert not mismatches, f"{len(mismatches)} of {len(cases)} outputs differ from colocated: {mismatches[:3]}"
    # A prompt that begins with a page the decode already holds (from a case that ended
    # first) may be prefilled on the decode: no KV moves for it. Every other case moves
    # real KV over the transport.
    local_ok = may_prefill_locally(cases, expected, page)
    for i, (c, g, (e_ids, e_reason)) in enumerate(zip(cases, got, expected)):
        assert g.finish_reason == e_reason
        assert g.text == tok.decode(e_ids)  # the streamed text deltas add up to the tokens' text
        assert g.bootstrap_room != 0
        assert g.bytes_transferred > 0 or i in local_ok, (i, len(c.input_ids))
    assert len({g.bootstrap_room for g in got}) == len(got)
    await wait_nothing_held(cluster)

    n = len(cases)
    after = await Counters.read(cluster)
    local = after.delta(before, "pdgrpc_local_prefill_requests_total", "decode")
    assert local == sum(g.bytes_transferred == 0 for g in got)
    for role in ("router", "decode"):
        assert after.requests(before, role) == {"finished": n, "aborted": 0, "refused": 0}, role
    assert after.requests(before, "prefill") == {"finished": n - local, "aborted": 0, "refused": 0}
    assert after.delta(before, "pdgrpc_time_to_first_token_seconds_count", "router") == n
    assert after.delta(before, "pdgrpc_output_tokens_total", "router") == sum(len(g.token_ids) for g in got)
    for role in ("prefill", "decode"):
        assert after.delta(before, "pdgrpc_transfer_seconds_count", role, transport=cluster.transport) == n - local, role
    # The decode counts what it committed, the prefill what it sent: the same bytes, and
    # what each request reported to the client.
    reported = sum(g.bytes_transferred for g in got)
    assert after.delta(before, "pdgrpc_transfer_bytes_total", "decode", transport=cluster.transport) == reported
    assert after.delta(before, "pdgrpc_transfer_bytes_total", "prefill", transport=cluster.transport) == reported
    prefill = cluster.topology.by_role("prefill")[0]
    registers = int(prefill.args.get("dp-size", 1)) > 1 and prefill.args.get("load-balance-method") != "follow_bootstrap_room"
    # Every room is registered once (in batches) when decode must query, never otherwise;
    # the embedded bootstrap (on the controller's endpoint) served exactly those calls.
    for role in ("prefill", "bootstrap"):
        assert after.delta(before, "pdgrpc_dp_rank_registration_batch_size_sum", role) == (n - local if registers else 0), role
        assert after.delta(before, "pdgrpc_dp_rank_registrations_total", role, outcome="error") == 0, role
    if registers:
        assert after.total("pdgrpc_dp_rank_queries_total", "decode", outcome="ok") > before.total("pdgrpc_dp_rank_queries_total", "decode", outcome="ok")


def _thread_nices(pid: int) -> list[int]:
    """The nice value of every thread of ``pid`` (field 19 of /proc/<pid>/task/<tid>/stat)."""
    out = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            out.append(int(stat.read_text().rsplit(")", 1)[1].split()[16]))
        except (OSError, IndexError, ValueError):
            pass  # a thread that ended meanwhile
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="--compute-nice sets per-thread nice values on Linux only")
async def test_engine_compute_threads_yield_to_the_serving_threads(cluster, router):
    # The decode has its compute thread at the default --compute-nice (10) and everything
    # else (loop, gRPC) at the process's own 0. A prefill worker computes in a child
    # process of its own (--compute-in process): the child runs at 10 throughout, the
    # worker (loop, gRPC, transport) at 0. Before and after requests.
    await generate(router, input_ids=[256, 72, 105], max_new_tokens=2, timeout=60)
    # The servers inherit this test process's nice value (pytest may itself run niced),
    # and --compute-nice is an increment on top of it, capped at 19.
    base = os.getpriority(os.PRIO_PROCESS, 0)
    compute = min(19, base + 10)
    decodes = [p.pid for p in cluster.procs.values() if p.spec.role == "decode"]
    workers = [w for p in cluster.procs.values() if p.spec.role == "prefill" for w in child_pids(p.pid)]
    assert decodes and workers
    for pid in decodes:
        nices = _thread_nices(pid)
        assert compute in nices and nices.count(base) >= 1 and set(nices) <= {base, compute}, (pid, nices)
    for pid in workers:
        assert set(_thread_nices(pid)) == {base}, (pid, _thread_nices(pid))
        computes = child_pids(pid)
        assert len(computes) == 1, (pid, computes)  # one compute process per worker
        assert set(_thread_nices(computes[0])) == {compute}, (computes[0], _thread_nices(computes[0]))


async def expect_error(router, **kwargs) -> grpc.aio.AioRpcError:
    """Run a request that must fail; asserts no token reached the client first."""
    received = []
    req = generate_pb2.GenerateRequest(
        input_ids=kwargs.pop("input_ids"),
        sampling=common_pb2.SamplingParams(max_new_tokens=kwargs.pop("max_new_tokens", 8)),
        **kwargs,
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for msg in router.Generate(req, timeout=60):
            received.append(msg)
    assert received == [], "a failed request must not stream tokens generated from incomplete KV"
    return err.value


async def test_prompt_over_the_engine_limit_is_refused_by_the_router(cluster, router, before):
    limit = int(cluster.topology.engine.get("max-prompt-tokens", 2048))
    err = await expect_error(router, input_ids=[256] + [97] * limit)  # limit + 1 tokens
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"max_prompt_tokens={limit} (the router's --max-prompt-tokens)" in err.details()
    await wait_nothing_held(cluster)
    after = await Counters.read(cluster)
    # The router refused it before forwarding (the launcher gave it the engine's limit):
    # neither the prefill nor the decode saw it.
    assert after.requests(before, "router") == {"finished": 0, "aborted": 0, "refused": 1}
    assert after.requests(before, "prefill") == {"finished": 0, "aborted": 0, "refused": 0}
    assert after.delta(before, "pdgrpc_requests_total", "decode", state="refused") == 0


async def test_client_cancel_mid_stream_releases_both_sides(cluster, router, before):
    req = generate_pb2.GenerateRequest(
        prompt="cancel me after the first token " * 4,
        sampling=common_pb2.SamplingParams(max_new_tokens=1000, ignore_eos=True),
    )
    call = router.Generate(req, timeout=120)
    first = await call.read()
    assert len(first.token_ids) >= 1 and first.bootstrap_room != 0
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call.read()
    await wait_nothing_held(cluster)
    # The cluster is still healthy and exact afterwards.
    ids = tuple(ByteTokenizer().encode("after the cancel"))
    got = await generate(router, input_ids=ids, max_new_tokens=12)
    assert (got.token_ids, got.finish_reason) == reference_outputs(
        cluster.topology.name, [_case(ids, 12)]
    )[0]
    await wait_nothing_held(cluster)
    after = await Counters.read(cluster)
    # The cancelled request was generating on the decode: both count it as cancelled.
    for role in ("router", "decode"):
        assert after.requests(before, role) == {"finished": 1, "aborted": 1, "refused": 0, "aborted:cancelled": 1}, role
    # Its prefill normally finished before the first token; both requests ended there.
    p = after.requests(before, "prefill")
    assert p["finished"] + p["aborted"] == 2 and p["refused"] == 0, p


async def test_client_cancel_before_the_first_token_releases_both_sides(cluster, router, before):
    limit = int(cluster.topology.engine.get("max-prompt-tokens", 2048))
    # The longest prompt allowed: the cancel lands while it is computed and transferred.
    req = generate_pb2.GenerateRequest(input_ids=[256] + [98] * (limit - 1), sampling=common_pb2.SamplingParams(max_new_tokens=4))
    for delay in (0.0, 0.05, 0.2):
        call = router.Generate(req, timeout=120)
        await asyncio.sleep(delay)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            async for _ in call:
                pass
    await wait_nothing_held(cluster)
    after = await Counters.read(cluster)
    # A request cancelled that early may never reach a server (nothing is counted there),
    # and one may even finish before the cancel lands (4 tokens); but each ends once per
    # server, and the router counts each one it saw end early as cancelled by the client.
    ended = {role: after.requests(before, role) for role in ("router", "prefill", "decode")}
    for role, r in ended.items():
        assert r["finished"] + r["aborted"] + r["refused"] <= 3, (role, r)
    assert ended["router"]["aborted"] == ended["router"].get("aborted:cancelled", 0), ended["router"]
    assert ended["router"]["finished"] <= ended["decode"]["finished"], ended  # it relays the decode's end


async def test_routed_dp_rank(cluster, router, before):
    prefill = cluster.topology.by_role("prefill")[0]
    dp_size = int(prefill.args.get("dp-size", 1))
    method = prefill.args.get("load-balance-method", "round_robin")
    ids = tuple(ByteTokenizer().encode("pinned to a dp rank"))
    (expected,) = reference_outputs(cluster.topology.name, [_case(ids, 8)])
    rank = dp_size - 1
    conflicts = 0
    if method != "follow_bootstrap_room" or prefill.args.get("force-dp-rank-query"):
        for _ in range(4):
            got = await generate(router, input_ids=ids, max_new_tokens=8, routed_dp_rank=rank)
            assert (got.token_ids, got.finish_reason) == expected
    else:
        # Strict follow_bootstrap_room: the rank is room % dp_size, and the router draws
        # the room at random, so a pinned rank conflicts for about half of the rooms.
        # Each conflict must be refused clearly; each agreeing room must be served exactly.
        conflicts = served = 0
        for _ in range(40):
            if conflicts >= 3 and served >= 3:
                break
            try:
                got = await generate(router, input_ids=ids, max_new_tokens=8, routed_dp_rank=rank)
            except grpc.aio.AioRpcError as err:
                assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
                assert "prefill" in err.details() and "follow_bootstrap_room" in err.details()
                conflicts += 1
                continue
            assert got.bootstrap_room % dp_size == rank
            assert (got.token_ids, got.finish_reason) == expected
            served += 1
        assert conflicts >= 3 and served >= 3, (conflicts, served)
    # A rank outside the instance is refused, not silently remapped.
    err = await expect_error(router, input_ids=list(ids), routed_dp_rank=dp_size)
    assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
    assert "dp" in err.details()
    await wait_nothing_held(cluster)
    after = await Counters.read(cluster)
    # Each conflict was decided by the prefill controller, and only there.
    assert after.delta(before, "pdgrpc_aborts_total", "prefill", reason="dp_rank_conflict") == conflicts
    served_n = after.delta(before, "pdgrpc_requests_total", "router", state="finished")
    assert after.delta(before, "pdgrpc_requests_total", "prefill", state="finished") == served_n
    assert after.delta(before, "pdgrpc_requests_total", "decode", state="finished") == served_n


def _case(ids, max_new_tokens):
    from tests.e2e.harness import Case

    return Case(input_ids=tuple(ids), max_new_tokens=max_new_tokens)
