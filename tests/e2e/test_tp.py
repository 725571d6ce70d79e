"""Tensor parallelism end to end: ``servers/tp2``, ``tp2-to-tp1`` and ``tp1-to-tp2``.

Real processes (every TP rank its own process, joined over gloo), requests through the
router over tcp and rdma (tp2 over both, each TP-changing topology over one: every
topology and every transport runs, and a further pair would add no check): 54 prompts with at least 16 in flight come back token for token
equal to colocated TP 1 generation, and afterwards every rank's metrics endpoint, scraped
over HTTP, reads zero slots, pages and transport rooms in use.

The fault test runs a TP 2 decode whose rank 1 transport delays every metadata row and
corrupts the room of the third one (``tests.e2e.faulty``, loaded by ``--transport``):
the ranks must still commit the same rooms in the same order, never hang, and the
corrupted request -- only that one -- must fail on every rank; then rank 1 is SIGKILLed
and takes its instance down loudly.
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
import pytest_asyncio

from pdgrpc.cluster import Cluster
from pdgrpc.cluster.client import generate
from pdgrpc.v1 import generate_pb2_grpc

from tests.e2e.harness import TRANSPORTS, generate_all, may_prefill_locally, moving_kv, prompt_cases, read_metrics, reference_outputs, skip_unless_transport, wait_nothing_held

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(300)]

TP_TOPOLOGIES = ("tp2", "tp2-to-tp1", "tp1-to-tp2")
PARAMS = [("tp2", "tcp"), ("tp2", "rdma"), ("tp2-to-tp1", "rdma"), ("tp1-to-tp2", "tcp")]
assert {t for t, _ in PARAMS} == set(TP_TOPOLOGIES) and {x for _, x in PARAMS} == set(TRANSPORTS)
_REFERENCE: dict[tuple, list] = {}


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=PARAMS, ids=[f"{t}-{x}" for t, x in PARAMS])
async def cluster(request):
    topology, transport = request.param
    skip_unless_transport(transport)
    async with Cluster(moving_kv(topology), transport=transport, start_timeout=180, metrics=True) as c:
        yield c


def _tp(cluster: Cluster, role: str) -> int:
    return int(cluster.topology.by_role(role)[0].args.get("tp-size", 1))


async def test_tp_outputs_equal_colocated_tp1_and_every_rank_ends_idle(cluster):
    page = int(cluster.topology.engine.get("page-size", 16))
    chunk = int(cluster.topology.by_role("prefill")[0].args.get("chunk-size", 512))
    cases = prompt_cases(page, chunk)
    assert len(cases) >= 50
    key = tuple(cases)
    if key not in _REFERENCE:  # colocated generation with a TP 1 engine, in this process
        _REFERENCE[key] = reference_outputs(cluster.topology.name, cases)
    expected = _REFERENCE[key]

    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        got, peak = await generate_all(generate_pb2_grpc.GenerateServiceStub(channel), cases)
    assert peak >= 16
    mismatches = [(i, g.token_ids, e) for i, (g, (e, _)) in enumerate(zip(got, expected)) if g.token_ids != e]
    assert not mismatches, f"{len(mismatches)} of {len(cases)} outputs differ from colocated TP1: {mismatches[:3]}"
    assert all(g.finish_reason == r for g, (_, r) in zip(got, expected))
    local_ok = may_prefill_locally(cases, expected, page)  # the decode may prefill these itself
    assert all(g.bytes_transferred > 0 for i, g in enumerate(got) if i not in local_ok)

    # Every rank has its own endpoint, and every one of them is idle at the end.
    endpoints = cluster.metrics_endpoints()
    tp_d, tp_p = _tp(cluster, "decode"), _tp(cluster, "prefill")
    assert {e for e in endpoints if e.startswith("decode")} == {"decode", *(f"decode/tp{r}" for r in range(1, tp_d))}
    prefill_workers = {e for e in endpoints if e.startswith("prefill/")}
    assert len(prefill_workers) == tp_p
    await wait_nothing_held(cluster)
    scrapes = await read_metrics(cluster)
    for name in ["decode", *(f"decode/tp{r}" for r in range(1, tp_d))]:
        s = scrapes[name]
        for gauge in ("pdgrpc_metadata_slots_in_use", "pdgrpc_kv_pages_in_use", "pdgrpc_kv_pages_quarantined", "pdgrpc_transport_rooms"):
            assert s.value(gauge, role="decode") == 0, (name, gauge)
    for name in prefill_workers:
        for gauge in ("pdgrpc_kv_pages_in_use", "pdgrpc_transport_rooms"):
            assert scrapes[name].value(gauge, role="prefill") == 0, (name, gauge)


def _commit_sequences(log_text: str) -> dict[str, list[int]]:
    """Rooms each decode rank committed, in order, from the decode's log (rank 0 logs as
    ``[decode pid=..]``, rank r as ``[decode.tp<r> pid=..]``)."""
    out: dict[str, list[int]] = {}
    for m in re.finditer(r"\[(decode(?:\.tp\d+)?) pid=\d+\] pdgrpc\.decode: room=(\d+) committed\b", log_text):
        out.setdefault(m.group(1), []).append(int(m.group(2)))
    return out


async def test_tp2_decode_with_a_slow_and_a_corrupting_rank_stays_in_lock_step_and_dies_loudly(tmp_path):
    """The ranks commit the same rooms in order and fail only the corrupted one; then rank 1
    dies (SIGKILL) and takes its instance down loudly."""
    # The decode (both ranks) loads the fault-injecting wrapper by name; the prefill is plain tcp.
    # Every room's KV comes over the transport, where the faults are.
    topology = moving_kv("tp2")
    procs = tuple(
        dataclasses.replace(p, args={**p.args, "transport": "tests.e2e.faulty:SlowCorruptingRank1"}) if p.role == "decode" else p
        for p in topology.processes
    )
    topology = dataclasses.replace(topology, processes=procs)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))}
    async with Cluster(topology, transport="tcp", log_dir=tmp_path, start_timeout=180, metrics=True, extra_env=env) as cluster:
        async with grpc.aio.insecure_channel(cluster.router_address) as channel:
            router = generate_pb2_grpc.GenerateServiceStub(channel)

            async def one(i: int):
                # One at a time for the first few, so "the third room" is well defined.
                return await generate(router, prompt=f"lock step {i} " * (i + 1), max_new_tokens=4, ignore_eos=True, timeout=60)

            results = []
            for i in range(5):
                results.append(await asyncio.wait_for(asyncio.gather(one(i), return_exceptions=True), 90))
            results = [r[0] for r in results]
            results += await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(5, 13)), return_exceptions=True), 120)
        failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        assert len(failed) == 1, failed
        i, err = failed[0]
        assert i == 2  # the third request that reached rank 1's transport
        assert isinstance(err, grpc.aio.AioRpcError) and err.code() == grpc.StatusCode.ABORTED
        assert "bootstrap_room mismatch" in err.details()
        assert all(len(r.token_ids) == 4 for r in results if not isinstance(r, BaseException))
        await wait_nothing_held(cluster)
        scrapes = await read_metrics(cluster)
        for name in ("decode", "decode/tp1"):  # the corruption aborted the request on both ranks
            assert scrapes[name].value("pdgrpc_aborts_total", role="decode", reason="metadata_corruption") == 1, name
        text = (tmp_path / "decode.log").read_text()
        assert "transport test faults active" in text

        m = re.search(r"\[decode\.tp1 pid=(\d+)\].*TP rank 1/2 ready", text)
        assert m, "rank 1 never said it was ready"
        os.kill(int(m.group(1)), signal.SIGKILL)
        err = await asyncio.wait_for(cluster.wait_failure(), 60)
        assert err.proc.spec.name == "decode" and err.proc.returncode == 1
        assert "decode TP rank 1" in err.args[0] and "cannot continue" in err.args[0]
    seqs = _commit_sequences(text)
    assert set(seqs) == {"decode", "decode.tp1"}
    assert seqs["decode"] == seqs["decode.tp1"]
    assert len(seqs["decode"]) == 12


async def test_dp2_times_tp2_prefill_to_tp2_decode(tmp_path):
    """Two prefill dp ranks, each a TP 2 group (4 worker processes, rooms registered with
    bootstrap for decode to query), into a TP 2 decode: outputs equal colocated TP 1."""
    from pdgrpc.cluster.topology import load_topology, parse_topology

    base = load_topology("tp2")
    topology = parse_topology(
        {
            "transport": "tcp",
            "engine": dict(base.engine),
            "process": [
                {"name": "prefill", "role": "prefill", "args": {"dp-size": 2, "tp-size": 2, "chunk-size": 64, "load-balance-method": "round_robin"}},
                {"name": "decode", "role": "decode", "args": {"num-slots": 32, "tp-size": 2}},
                {"name": "router", "role": "router", "prefill": ["prefill"], "decode": ["decode"]},
            ],
        },
        "dp2-tp2",
    )
    page = int(base.engine.get("page-size", 16))
    cases = prompt_cases(page, 64)[:20]
    expected = reference_outputs("tp2", cases)
    async with Cluster(topology, log_dir=tmp_path, start_timeout=180, metrics=True) as cluster:
        assert len(cluster.metrics_endpoints("prefill")) == 1 + 4  # controller + dp0.tp0 .. dp1.tp1
        async with grpc.aio.insecure_channel(cluster.router_address) as channel:
            got, _ = await generate_all(generate_pb2_grpc.GenerateServiceStub(channel), cases)
        assert [g.token_ids for g in got] == [e for e, _ in expected]
        await wait_nothing_held(cluster)
