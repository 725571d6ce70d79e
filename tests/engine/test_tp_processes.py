"""Tensor parallelism across real processes: two ranks joined by a gloo all-reduce
generate exactly what one process does (the setup the TP servers of issue 6 use)."""

from __future__ import annotations

import multiprocessing as mp
import queue
from pathlib import Path

import pytest

from engine_helpers import PROMPTS, make_engine
from engine_tp_worker import run_rank
from pdgrpc.engine import SamplingParams, generate

MAX_NEW = 8


@pytest.mark.slow
def test_two_gloo_ranks_generate_exactly_the_tp1_tokens(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init_file = str(tmp_path / "gloo-init")  # file rendezvous: no ports to pick
    procs = [ctx.Process(target=run_rank, args=(r, 2, init_file, PROMPTS, MAX_NEW, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in procs:
            rank, tokens, pages_all_free = out.get(timeout=180)
            assert isinstance(tokens, list), f"rank {rank} failed: {tokens}"
            assert pages_all_free, f"rank {rank} leaked pages"
            results[rank] = tokens
    except queue.Empty:
        pytest.fail("a TP rank process produced nothing within 180 s")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    want = [g.token_ids for g in generate(make_engine(), PROMPTS, MAX_NEW, SamplingParams(temperature=1.0, seed=5))]
    assert results[0] == results[1] == want
