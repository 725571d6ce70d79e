"""The connector's worker role starts a step's jobs when vLLM binds the step's metadata,
before the forward pass: vLLM calls ``start_load_kv`` for asynchronous loads only after
the forward, so a prefill whose next step is a long batch of prompts would otherwise
keep a finished request's decode waiting that whole step."""

from __future__ import annotations

import pytest
import torch

from pdgrpc.integrations.vllm.jobs import Jobs, LoadJob, SendJob
from pdgrpc.integrations.vllm.worker import Finished, WorkerOptions, WorkerSide, compat_hash
from pdgrpc.serving.room_proof import draw_secret
from pdgrpc.state.room import Room
from tests.integrations.test_vllm_worker import collect, kv_caches, params_for
from tests.integrations.vllm_support import needs_vllm

pytestmark = needs_vllm

BLOCK = 32


def _prefill_connector(handshake_wait_s: float):
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    from pdgrpc.integrations.vllm.connector import PdgrpcConnector
    from pdgrpc.integrations.vllm.launch import hf_checkpoint

    config = VllmConfig(
        model_config=ModelConfig(model=str(hf_checkpoint()), dtype="float32", max_model_len=1024),
        cache_config=CacheConfig(block_size=BLOCK),
        kv_transfer_config=KVTransferConfig(kv_connector="PdgrpcConnector", kv_connector_module_path="pdgrpc.integrations.vllm",
                                            kv_role="kv_both",
                                            kv_connector_extra_config={"handshake_wait_s": handshake_wait_s}),
    )
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float32)
    tensor = KVCacheTensor(size=spec.page_size_bytes * 16, layers=["l0"], layer_stride=0, block_stride=spec.page_size_bytes)
    kv = KVCacheConfig(num_blocks=16, kv_cache_tensors=[tensor], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    return PdgrpcConnector(config, KVConnectorRole.WORKER, kv)


def test_a_send_starts_when_its_metadata_is_bound_before_the_forward():
    from pdgrpc.integrations.vllm.connector import PdgrpcMetadata
    from pdgrpc.integrations.vllm.version import VLLM_VERSION

    p_caches, d_caches = kv_caches(16, random=True), kv_caches(16, random=False)
    prefill = _prefill_connector(handshake_wait_s=5.0)
    decode = WorkerSide(WorkerOptions())
    try:
        prefill.register_kv_caches(p_caches)
        decode.register(d_caches, compat_hash(d_caches, BLOCK, VLLM_VERSION))
        info = prefill.get_handshake_metadata()
        assert info is not None
        secret, src, dst = draw_secret(), (1, 4), (7, 8)
        # vLLM binds the step's metadata, then runs the forward: start_load_kv comes after it.
        prefill.bind_connector_metadata(PdgrpcMetadata(Jobs(sends=[SendJob("p1", Room(21), secret, src, 30.0)])))
        params = params_for(info, 21, secret, src)  # the address and instance vLLM hands the scheduler
        decode.submit(Jobs(loads=[LoadJob("d1", params, dst, 0)]))
        got = collect(decode, Finished(), lambda f: "d1" in f.recving, timeout=10.0)
        assert not got.failed_recving, "the handshake waited for a start_load_kv that comes after the forward"
        for name in d_caches:
            for s, t in zip(src, dst):
                assert torch.equal(d_caches[name][t], p_caches[name][s])
    finally:
        decode.close()
        prefill.shutdown()
