"""smg 1.13's cache_aware policy fed by pdgrpc's KV events, in front of 2 prefills.

smg subscribes to each prefill's ``SubscribeKvEvents`` and routes a prompt to the prefill
whose cache holds its prefix: requests sharing a long prefix land on one prefill (its hit
metric counts the shared pages, the other prefill computes nothing of them), smg's own
KV index holds the blocks it was sent, and killing that prefill sends the next requests
to the other one without an error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest
import pytest_asyncio

pytest.importorskip("smg_grpc_proto", reason="the gateway extra (pdgrpc[gateway]) is not installed")

from pdgrpc.cluster import Cluster, load_topology  # noqa: E402
from pdgrpc.cluster.smg import smg_executable  # noqa: E402
from pdgrpc.cluster.topology import Topology  # noqa: E402
from pdgrpc.gateway import DEFAULT_SERVED_MODEL_NAME  # noqa: E402
from tests.e2e.harness import skip_unless_transport  # noqa: E402
from tests.eventually import eventually_async  # noqa: E402
from tests.gateway import smg_http  # noqa: E402
from tests.scrape import scrape  # noqa: E402

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
PAGE = 16  # smg-2p2d's page size
PREFIX = bytes(range(32, 127)) * 2 + b"! shared system prompt"  # 212 bytes: 13 full pages with BOS


def topology() -> Topology:
    topo = load_topology("smg-2p2d")
    procs = []
    for p in topo.processes:
        if p.role == "smg":
            p = dataclasses.replace(p, args={**p.args, "prefill-policy": "cache_aware", "decode-policy": "round_robin"})
        procs.append(p)
    return dataclasses.replace(topo, processes=tuple(procs))


# One transport: the KV events and smg's routing on them are the same over either.
@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["tcp"])
async def cluster(request):
    skip_unless_transport(request.param)
    try:
        smg_executable()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}
    async with Cluster(topology(), transport=request.param, start_timeout=180, metrics=True, extra_env=env) as c:
        yield c


async def generate(cluster: Cluster, ids: list[int]) -> tuple[int, object]:
    body = {"model": DEFAULT_SERVED_MODEL_NAME, "input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    base = cluster.openai_base_url.removesuffix("/v1")
    return await asyncio.to_thread(smg_http.post, base, "/generate", body)


def prefill_counter(cluster: Cluster, name: str, sample: str) -> float:
    """``sample`` of prefill ``name``'s one worker (dp 1), which counts what it computed."""
    return scrape(cluster.metrics_endpoints("prefill")[f"{name}/dp0"]).value(sample)


def _smg_lines(cluster: Cluster) -> list[str]:
    address = next(iter(cluster.metrics_endpoints("smg").values()))
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
        return resp.read().decode().splitlines()


def smg_total(cluster: Cluster, sample: str) -> float:
    """``sample`` summed over smg's series of it (one per worker)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in _smg_lines(cluster) if line.split("{")[0].split(" ")[0] == sample)


def smg_worker_health(cluster: Cluster, name: str) -> float:
    """smg's ``smg_worker_health`` of process ``name`` (1 healthy, 0 not)."""
    series = f'smg_worker_health{{worker="grpc://{cluster.address(name)}"}} '
    (value,) = [float(line[len(series):]) for line in _smg_lines(cluster) if line.startswith(series)]
    return value


async def test_cache_aware_sends_a_shared_prefix_to_its_holder_and_reroutes_when_it_dies(cluster):
    names = ["prefill-a", "prefill-b"]
    first = [256, *PREFIX, *b" first question?"]
    # smg admits a worker once its health probe answered; on a loaded machine the cluster's
    # readiness can come first
    deadline = time.monotonic() + 30
    while (r := await generate(cluster, first))[0] == 503 and "no_available_workers" in str(r[1]) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    status, body = r
    assert status == 200, body
    # smg's index learned the prefix's pages from the events of the prefill that ran it
    await eventually_async(lambda: smg_total(cluster, "smg_kv_index_blocks") >= len(first) // PAGE, 10,
                           what="smg's KV index holds the first prompt's pages")
    holder = next(n for n in names if prefill_counter(cluster, n, "pdgrpc_prefill_prompt_tokens_total") > 0)
    other = next(n for n in names if n != holder)

    for i in range(4):
        status, body = await generate(cluster, [256, *PREFIX, *f" question number {i}?".encode()])
        assert status == 200, body
    shared_pages = (1 + len(PREFIX)) // PAGE
    assert prefill_counter(cluster, holder, "pdgrpc_prefix_cache_hit_tokens_total") >= 4 * shared_pages * PAGE
    assert prefill_counter(cluster, other, "pdgrpc_prefill_prompt_tokens_total") == 0  # all went to the holder

    os.kill(cluster.procs[holder].pid, signal.SIGKILL)
    await eventually_async(lambda: smg_worker_health(cluster, holder) == 0, 30, 0.1,
                           what="smg's health checks mark the killed prefill down")
    for i in range(3):
        status, body = await generate(cluster, [256, *PREFIX, *f" after the crash {i}?".encode()])
        assert status == 200, body
    assert prefill_counter(cluster, other, "pdgrpc_prefill_prompt_tokens_total") > 0
