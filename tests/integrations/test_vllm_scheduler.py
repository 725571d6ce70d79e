"""The connector's scheduler role inside vLLM's real scheduler (no model, no server):
a prefill request keeps its blocks for a decode and hands out the params; a decode
request with those params waits for its KV in exactly the blocks the load job names."""

from __future__ import annotations

import pytest

from pdgrpc.integrations.vllm.launch import hf_checkpoint
from tests.integrations.vllm_support import needs_vllm

pytestmark = needs_vllm

BLOCK = 32


def _scheduler(num_blocks: int = 64):
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.structured_output import StructuredOutputManager

    config = VllmConfig(
        model_config=ModelConfig(model=str(hf_checkpoint()), dtype="float32", max_model_len=1024),
        cache_config=CacheConfig(block_size=BLOCK),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=1024, is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(kv_connector="PdgrpcConnector", kv_connector_module_path="pdgrpc.integrations.vllm",
                                            kv_role="kv_both"),
    )
    config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=config.model_config.dtype)
    page = spec.page_size_bytes
    tensor = KVCacheTensor(size=page * num_blocks, layers=["l0"], layer_stride=page * num_blocks, block_stride=page)
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[tensor], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    sched = Scheduler(config, kv, StructuredOutputManager(config), block_size=BLOCK)
    from pdgrpc.integrations.vllm.connector import PdgrpcHandshake

    sched.get_kv_connector().set_xfer_handshake_metadata({0: PdgrpcHandshake("127.0.0.1:1", "writer-1")})
    return sched


def _request(rid: str, n: int, params, max_tokens: int):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args={"kv_transfer_params": params})
    return Request(rid, list(range(1, n + 1)), sp, None, block_hasher=get_request_block_hasher(BLOCK, hash_fn))


def _step(sched, sampled: dict[str, int] | None = None, finished_sending=(), finished_recving=(), failed=()):
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                            sampled_token_ids=[[(sampled or {}).get(r, 7)] for r in ids],
                            kv_connector_output=KVConnectorOutput(finished_sending=set(finished_sending),
                                                                  finished_recving=set(finished_recving),
                                                                  failed_recving=set(failed)))
    results = sched.update_from_output(out, mro)
    return out, results


def test_a_finished_prefill_keeps_its_blocks_until_the_worker_reports_them_sent():
    from vllm.v1.core.sched.output import SchedulerOutput  # noqa: F401 (vLLM imported once here)

    from pdgrpc.integrations.vllm.params import TransferParams

    sched = _scheduler()
    free0 = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    sched.add_request(_request("p", 100, {"do_remote_decode": True}, 1))
    out, results = _step(sched)
    outputs = [o for eco in results.values() for o in eco.outputs]
    params = TransferParams.from_json(outputs[0].kv_transfer_params)
    assert len(params.block_ids) == 4 and params.num_tokens == 100 and params.writer_id == "writer-1"
    assert sched.get_kv_connector().has_pending_push_work()
    held = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    assert held == free0 - 4, "the prefill's blocks were freed before the decode fetched them"
    out, _ = _step(sched)  # the next step carries the send job to the worker side
    jobs = out.kv_connector_metadata.jobs
    assert [(j.req_id, j.room, j.block_ids) for j in jobs.sends] == [("p", params.room, params.block_ids)]
    _step(sched, finished_sending=["p"])
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == free0
    assert not sched.get_kv_connector().has_pending_push_work()


def _decode_params():
    from pdgrpc.integrations.vllm.params import TransferParams
    from pdgrpc.serving.room_proof import draw_secret
    from pdgrpc.state.room import Room

    return TransferParams(Room(5), draw_secret(), "127.0.0.1:1", "w", (9, 8, 7, 6), 100).to_json()


def test_a_decode_request_waits_for_its_kv_in_the_blocks_its_load_names():
    from vllm.v1.request import RequestStatus

    sched = _scheduler()
    req = _request("d", 100, _decode_params(), 4)
    sched.add_request(req)
    out, _ = _step(sched)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (load,) = out.kv_connector_metadata.jobs.loads
    blocks = sched.kv_cache_manager.get_block_ids("d")[0]
    assert load.req_id == "d" and list(load.block_ids) == blocks and load.cached_blocks == 0
    assert load.params.block_ids == (9, 8, 7, 6)
    out, _ = _step(sched, finished_recving=["d"])  # the KV landed
    out, _ = _step(sched)
    assert req.status == RequestStatus.RUNNING
    assert out.num_scheduled_tokens == {"d": 1}, "the decode recomputes only the prompt's last position"


def test_an_aborted_decode_request_keeps_its_blocks_until_the_abort_is_acknowledged():
    from vllm.v1.request import RequestStatus

    sched = _scheduler()
    free0 = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    sched.add_request(_request("d", 100, _decode_params(), 4))
    _step(sched)
    sched.finish_requests(["d"], RequestStatus.FINISHED_ABORTED)
    out, _ = _step(sched)
    (release,) = out.kv_connector_metadata.jobs.releases
    assert release.req_id == "d"
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() < free0, "blocks reused before the abort was acknowledged"
    _step(sched, finished_recving=["d"], failed=["d"])
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == free0
