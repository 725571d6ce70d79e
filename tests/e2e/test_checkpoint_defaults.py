"""A checkpoint with ``max_position_embeddings = 2048`` starts with no size flags.

``[engine]`` names only the model: prefill and decode (real processes, 1p1d over tcp) take
``--max-seq-len`` from the checkpoint and size their KV pool from the model and the
memory available, log the sizing, and serve a request as long as the checkpoint allows.
"""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from pdgrpc.cluster import Cluster, load_topology
from pdgrpc.cluster.client import generate
from pdgrpc.v1 import generate_pb2_grpc

pytest.importorskip("transformers", reason="builds the checkpoint (test extra)")

pytestmark = [pytest.mark.timeout(300)]


async def test_a_2048_position_checkpoint_starts_with_no_flags(tmp_path):
    from pdgrpc.engine.hf.build import build_checkpoint

    model = build_checkpoint(tmp_path / "ctx2048", "llama", max_position_embeddings=2048)
    t = load_topology("1p1d")
    topology = dataclasses.replace(t, name="1p1d-defaults", engine={"model": str(model)})
    async with Cluster(topology, transport="tcp", start_timeout=180) as cluster:
        async with grpc.aio.insecure_channel(cluster.router_address) as channel:
            stub = generate_pb2_grpc.GenerateServiceStub(channel)
            done = await generate(stub, input_ids=[5] * 2000, max_new_tokens=40)  # up to 2040 of 2048 positions
            assert len(done.token_ids) == 40 or done.finish_reason == "stop"
            with pytest.raises(grpc.aio.AioRpcError) as err:  # past the checkpoint's positions
                await generate(stub, input_ids=[5] * 2000, max_new_tokens=60)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_seq_len=2048" in err.value.details()
        logs = "".join((cluster.log_dir / f"{name}.log").read_text() for name in ("prefill", "decode"))
    assert "sizing: weights" in logs and "max-seq-len 2048," in logs
