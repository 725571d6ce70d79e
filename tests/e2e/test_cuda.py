"""KV pools in GPU memory, end to end (issue 20): ``1p1d`` over tcp and over rdma with
every engine on the GPU (``[engine] device = "cuda"``), outputs equal to colocated
generation on the same GPU -- for the reference engine (token for token against a
colocated engine in this process: its fixed-point arithmetic is exact on any device) and
for a tiny random Hugging Face checkpoint (against the colocated server on the same GPU,
one request at a time, so both see the same batch shapes and chunks).

Skipped, saying so, where torch sees no CUDA device; ``scripts/gpu_check.sh`` runs them on
a GPU machine.
"""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import torch

from pdgrpc.cluster import Cluster, load_topology
from pdgrpc.cluster.client import generate
from pdgrpc.cluster.topology import Topology
from pdgrpc.v1 import generate_pb2_grpc
from tests.e2e.harness import Case, generate_all, prompt_cases, reference_outputs_for, skip_unless_transport, wait_nothing_held

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(600),
]

TRANSPORTS = ["tcp", "rdma"]


def _on_gpu(topology: Topology, **engine: object) -> Topology:
    return dataclasses.replace(topology, name=f"{topology.name}-cuda", engine={**topology.engine, "device": "cuda", **engine})


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_reference_engine_1p1d_on_gpu_equals_colocated(transport: str) -> None:
    skip_unless_transport(transport)
    topology = _on_gpu(load_topology("1p1d"))
    cases = prompt_cases(16, 64, n=24)
    expected = reference_outputs_for(topology, cases)  # a colocated engine on the same GPU, in this process
    async with Cluster(topology, transport=transport, start_timeout=300) as c:
        async with grpc.aio.insecure_channel(c.router_address) as channel:
            got, _ = await generate_all(generate_pb2_grpc.GenerateServiceStub(channel), cases)
        assert [(tuple(g.token_ids), g.finish_reason) for g in got] == expected
        await wait_nothing_held(c)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_hf_checkpoint_1p1d_on_gpu_equals_colocated(transport: str, hf_checkpoint) -> None:
    skip_unless_transport(transport)
    model = str(hf_checkpoint("llama"))
    disagg = _on_gpu(load_topology("1p1d"), model=model)
    colocated = _on_gpu(load_topology("colocated"), model=model)
    g = torch.Generator().manual_seed(5)
    cases = [Case(tuple(torch.randint(3, 200, (n,), generator=g).tolist()), 8) for n in (1, 15, 16, 17, 65, 130, 300)]
    outputs = {}
    for name, topology in (("colocated", colocated), ("1p1d", disagg)):
        async with Cluster(topology, transport=transport, start_timeout=300) as c:
            async with grpc.aio.insecure_channel(c.router_address) as channel:
                stub = generate_pb2_grpc.GenerateServiceStub(channel)
                outputs[name] = [
                    tuple((await generate(stub, input_ids=case.input_ids, max_new_tokens=case.max_new_tokens, ignore_eos=True,
                                           timeout=120)).token_ids)
                    for case in cases  # one at a time: the same batch shapes on both
                ]
            if name == "1p1d":
                await wait_nothing_held(c)
    assert outputs["1p1d"] == outputs["colocated"]
    assert all(len(o) == 8 for o in outputs["1p1d"])
