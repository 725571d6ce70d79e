"""Injected transfer faults under load (issue 16), as SGLang tests its PD with
``DISAGGREGATION_TEST_FAILURE_PROB``.

A real 1p1d cluster (tcp, and rdma) whose prefill loads ``tests.e2e.faulty:FailsFivePercent``
by name (the servers know nothing about faults): about 5% of the rooms it sends fail, at
seeded random points -- before the first page, mid-pages, before the metadata row, after
it. 400 requests, 64 in flight, go through the router. Every request that was not hit
must come back token for token equal to colocated generation; every request hit before
its row landed must end with a clear gRPC error naming the fault (ABORTED: not a hang,
not UNKNOWN); a request hit after its row may also finish (the decode has every byte),
and then with the right tokens. Afterwards GetStats on the prefill and the decode must
read nothing held within 3 s.

Which room is hit, and where, is a function of the seed (in the test id) and the room
alone (``transfer_faults.fault_point``); the rooms are the router's random draw, so the
requests hit differ between runs while the rate and the points do not. The prefill's log
lists every hit (room, point, seed), and a failure message repeats them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import re
from pathlib import Path

import grpc
import pytest

from pdgrpc.cluster import Cluster, load_topology
from pdgrpc.cluster.client import generate
from pdgrpc.v1 import generate_pb2_grpc
from tests.e2e.faulty import FailsFivePercent
from tests.e2e.harness import Case, Counters, reference_outputs_for, skip_unless_transport, wait_nothing_held

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]

REPO_ROOT = Path(__file__).resolve().parents[2]
REQUESTS, IN_FLIGHT = 400, 64
# Every prompt length class: below a page, several pages (so "mid-pages" sends some), and
# over the prefill's 64-token chunk (several writes per room).
LENGTHS = (1, 5, 15, 16, 33, 50, 70)
ROOM = re.compile(r"room (\d+): transfer failed")
HIT = re.compile(r"pdgrpc transport test faults: room (\d+) hit at (\w+) \(seed (\d+)\)")


def _cases(n_distinct: int = 24, rng_seed: int = 16) -> list[Case]:
    rng = random.Random(rng_seed)
    text = b"Faults under load: pages, rows and rooms. "
    out = []
    for i in range(n_distinct):
        length = LENGTHS[i % len(LENGTHS)]
        start = rng.randrange(len(text))
        body = (text * 4)[start : start + length - 1]
        sampled = i % 2 == 1
        out.append(Case(input_ids=(256, *body), max_new_tokens=rng.randint(1, 4),
                        temperature=0.8 if sampled else 0.0, seed=rng.getrandbits(32) if sampled else 0))
    return out


WRAPPERS = {"tcp": "tests.e2e.faulty:FailsFivePercent", "rdma": "tests.e2e.faulty:FailsFivePercentRdma"}


@pytest.mark.parametrize("transport", list(WRAPPERS), ids=[f"{t}-seed{FailsFivePercent.SEED}" for t in WRAPPERS])
async def test_five_percent_of_transfers_fail_the_rest_equal_colocated(transport, tmp_path):
    skip_unless_transport(transport)
    seed = FailsFivePercent.SEED
    topology = load_topology("1p1d")
    procs = tuple(
        dataclasses.replace(p, args={**p.args, "transport": WRAPPERS[transport]}) if p.role == "prefill" else p
        for p in topology.processes
    )
    topology = dataclasses.replace(topology, processes=procs)
    cases = _cases()
    reference = reference_outputs_for(topology, cases)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))}
    async with Cluster(topology, transport=transport, log_dir=tmp_path, start_timeout=120, metrics=True, extra_env=env) as cluster:
        async with grpc.aio.insecure_channel(cluster.router_address) as channel:
            router = generate_pb2_grpc.GenerateServiceStub(channel)
            gate = asyncio.Semaphore(IN_FLIGHT)

            async def one(i: int):
                c = cases[i % len(cases)]
                async with gate:
                    return await generate(router, input_ids=c.input_ids, max_new_tokens=c.max_new_tokens,
                                          temperature=c.temperature, seed=c.seed, top_k=c.top_k, top_p=c.top_p, timeout=60)

            results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(REQUESTS)), return_exceptions=True), 150)
        # Nothing held on the prefill or the decode within a short bound of the last request.
        await wait_nothing_held(cluster, timeout=3.0)
        counters = await Counters.read(cluster)
        log_text = (tmp_path / "prefill.log").read_text()
    hits = {int(m.group(1)): m.group(2) for m in HIT.finditer(log_text)}
    assert {int(m.group(3)) for m in HIT.finditer(log_text)} <= {seed}
    failed = {i: r for i, r in enumerate(results) if isinstance(r, BaseException)}
    failed_rooms = {}
    for i, err in failed.items():
        # A clear gRPC error naming the injected fault: not a hang (wait_for), not UNKNOWN.
        assert isinstance(err, grpc.aio.AioRpcError), (i, repr(err))
        assert err.code() == grpc.StatusCode.ABORTED, (i, err.code(), err.details())
        m = ROOM.search(err.details() or "")
        assert m and "injected transfer fault" in err.details(), (i, err.details())
        failed_rooms[int(m.group(1))] = i
    why = f"seed {seed}: hits {hits}; failed rooms {failed_rooms}"
    assert 0 < len(hits) < REQUESTS * 0.12, why
    # Only hit rooms fail; every hit before the row lands fails its request. A hit after
    # the row may still finish: the decode has every byte and the row (it must then be right).
    assert set(failed_rooms) <= set(hits), why
    assert {r for r, point in hits.items() if point != "after_row"} <= set(failed_rooms), why
    # The prefill counts each hit room once as a transfer failure, whatever the decode did.
    assert counters.total("pdgrpc_aborts_total", "prefill", reason="transfer_failed") == len(hits), why
    for i, r in enumerate(results):
        if i not in failed:
            assert hits.get(r.bootstrap_room, "after_row") == "after_row", (i, why)
            assert (tuple(r.token_ids), r.finish_reason) == reference[i % len(cases)], f"seed {seed}: request {i}"
