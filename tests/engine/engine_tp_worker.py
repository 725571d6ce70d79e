"""Entry point of one TP rank process for test_tp_processes.py (importable by spawn)."""

from __future__ import annotations

import multiprocessing.queues
from typing import Sequence


def run_rank(rank: int, size: int, init_file: str, prompts: Sequence[bytes], max_new: int, out: "multiprocessing.queues.Queue[object]") -> None:
    import torch.distributed as dist

    from engine_helpers import make_engine
    from pdgrpc.engine import EngineConfig, ReferenceEngine, SamplingParams, generate
    from pdgrpc.engine.tp import torch_distributed_all_reduce

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    try:
        base = make_engine().config
        cfg = EngineConfig(**{**base.__dict__, "tp_rank": rank, "tp_size": size})
        engine = ReferenceEngine(cfg, all_reduce=torch_distributed_all_reduce())
        gens = generate(engine, prompts, max_new, SamplingParams(temperature=1.0, seed=5))
        out.put((rank, [g.token_ids for g in gens], engine.num_free_pages == engine.num_pages))
    except BaseException as e:  # report instead of dying silently
        out.put((rank, repr(e), False))
    finally:
        dist.destroy_process_group()
