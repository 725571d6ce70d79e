"""bench e2e's --baseline-tree: the older build's routers use local sockets where it has them."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdgrpc.bench import e2e
from pdgrpc.cluster.client import Completion


def test_a_tree_with_local_sockets_is_compared_over_them(tmp_path: Path) -> None:
    (tmp_path / "pdgrpc" / "rpc").mkdir(parents=True)
    assert not e2e.has_local_sockets(str(tmp_path))  # a tree from before them: its servers lack --local-socket
    (tmp_path / "pdgrpc" / "rpc" / "local.py").write_text("")
    assert e2e.has_local_sockets(str(tmp_path))
    assert e2e.has_local_sockets(str(Path(e2e.__file__).parents[2]))  # this checkout


def _done(ttfts_ms: list[float]) -> list[Completion]:
    return [Completion(token_ids=(1,), text="", finish_reason="length", ttft_seconds=t / 1e3, client_ttft_seconds=t / 1e3,
                       bytes_transferred=0, transfer_seconds=0.0, bootstrap_room=1, messages=1) for t in ttfts_ms]


def test_a_cluster_is_reported_against_its_baseline_tree_twin_prompt_by_prompt() -> None:
    """The rows of a change: per prompt (measured requests alternate untraced, traced; the
    TTFT rows read the untraced ones) this build's TTFT minus the baseline tree's, and the
    tokens/s of the two builds' clusters in the same rounds."""
    p = argparse.ArgumentParser()
    e2e.add_arguments(p)
    args = p.parse_args([])
    # The host drifts from prompt to prompt by far more than the change; the baseline
    # tree is 0.5 ms slower on most prompts and far off on one.
    ours = [t for d in (30.0, 40.0, 50.0, 60.0, 70.0) for t in (d, 99.0)]
    off = [0.5, 0.5, 0.5, 0.5, -25.0]
    older = [t + off[i // 2] if i % 2 == 0 else 99.0 for i, t in enumerate(ours)]
    measured = {"colocated": _done([t - 3 for t in ours]), "1p1d-tcp": _done(ours), "1p1d-tcp@baseline": _done(older)}
    tput = {"colocated": e2e.Load(1.0, 2000, 64), "1p1d-tcp": e2e.Load(1.0, 1800, 64, 16), "1p1d-tcp@baseline": e2e.Load(1.0, 1500, 64)}
    empty: dict = {name: {} for name in measured}
    rows = {(r.case, r.metric): r for r in e2e.report(args, list(measured), measured, tput, empty, empty, {n: [] for n in measured})}
    paired = rows[("ttft/512tok/1p1d-tcp", "ttft_baseline_tree_paired_p50")]
    assert paired.value == pytest.approx(-0.5)
    against = rows[("ttft/512tok/1p1d-tcp", "ttft_p50_vs_baseline_tree")]
    assert (against.value, against.baseline_value) == (pytest.approx(50.0), pytest.approx(45.0))  # p50s: the outlier moves it
    rate = rows[("throughput/1p1d-tcp", "tokens_per_s_vs_baseline_tree")]
    assert (rate.value, rate.baseline_value, rate.ratio) == (1800, 1500, pytest.approx(1.2))
    assert not any(case.endswith("@baseline") and "baseline_tree" in metric for case, metric in rows)
    # A quarter of this build's prompts were computed on its decode: it moved no KV for them.
    assert rows[("throughput/1p1d-tcp", "no_kv_moved_share")].value == pytest.approx(0.25)
    assert rows[("throughput/1p1d-tcp@baseline", "no_kv_moved_share")].value == 0
    assert ("throughput/colocated", "no_kv_moved_share") not in rows  # it moves none, ever
