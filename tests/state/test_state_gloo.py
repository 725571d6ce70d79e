"""The transfer poll in 2 and 4 real OS processes over a torch.distributed gloo group on
127.0.0.1: metadata and KV completions arrive at random times on each rank, each rank has
its own clock, and yet every rank pops the same requests in the same order, and nobody
hangs (the test kills the group and fails after a bounded wait)."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest

import gloo_worker

JOIN_TIMEOUT_S = 150.0


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_transfer_poll_lock_step_over_gloo(world: int, tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    n = 150
    procs = [
        ctx.Process(target=gloo_worker.run_rank, args=(r, world, str(tmp_path / "store"), 1234 + world, n, str(tmp_path / f"rank{r}.json")))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(JOIN_TIMEOUT_S)
        hung = [i for i, p in enumerate(procs) if p.is_alive()]
        assert not hung, f"ranks {hung} did not finish within {JOIN_TIMEOUT_S} s (hang)"
        assert [p.exitcode for p in procs] == [0] * world
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    pops = [r["pops"] for r in results]
    assert all(p == pops[0] for p in pops), "ranks popped different sequences"
    assert len({r["collectives"] for r in results}) == 1  # same number of collectives on every rank
    kinds = {p[0] for p in pops[0]}
    assert len(pops[0]) == n and len({p[1] for p in pops[0]}) == n
    assert kinds == {"commit", "abort"}  # both paths were exercised
    reasons = {p[2] for p in pops[0] if p[0] == "abort"}
    assert reasons <= {"TRANSFER_FAILED", "TRANSFER_TIMEOUT"}
