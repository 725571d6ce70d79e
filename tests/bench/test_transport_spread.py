"""``python -m pdgrpc.bench transport`` shows a case's spread in one run: min and max
beside the median (table and JSON), over the iterations or, with ``--repeat N``, over N
whole repeats of the case and its raw baseline, plus each repeat's ratio against the raw
baseline of the same repeat (issue 19)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pdgrpc.bench import transport as bench
from pdgrpc.bench.report import Result
from pdgrpc.transport.testing.peer import PeerProcess

pytestmark = pytest.mark.timeout(180)


def test_repeat_reports_each_repeat_and_the_slowest_ratio_in_table_and_json(tmp_path: Path) -> None:
    out_json = tmp_path / "t.json"
    out = subprocess.run(
        [sys.executable, "-m", "pdgrpc.bench", "transport", "--backend", "tcp", "--tokens", "256", "--layers", "2",
         "--iterations", "2", "--warmup", "0", "--repeat", "3", "--cases", "contiguous", "--json", str(out_json)],
        capture_output=True, text=True, timeout=170, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    header = out.stdout.splitlines()[0].split()
    assert header[:5] == ["case", "metric", "value", "min", "max"]
    rows = {r["metric"]: r for r in json.loads(out_json.read_text())["results"]}
    thr = rows["throughput vs raw tcp socket recv_into"]
    assert len(thr["samples"]) == 3 and thr["min"] == min(thr["samples"]) and thr["max"] == max(thr["samples"])
    assert thr["min"] <= thr["value"] <= thr["max"] and thr["baseline_value"] > 0
    slowest = rows["throughput vs raw tcp socket recv_into, slowest repeat"]
    assert slowest["unit"] == "x" and len(slowest["samples"]) == 3 and slowest["value"] == min(slowest["samples"]) > 0


def _run(*argv: str) -> list[Result]:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return bench.run(parser.parse_args(["--tokens", "256", "--layers", "2", "--warmup", "0", "--cases", "contiguous",
                                        *argv]))


def test_without_repeat_the_spread_is_over_the_iterations() -> None:
    results = _run("--backend", "tcp", "--iterations", "3")
    [thr] = [r for r in results if r.metric == "throughput vs raw tcp socket recv_into"]
    assert thr.samples is not None and len(thr.samples) == 3  # one per iteration
    assert thr.min_value is not None and thr.max_value is not None and thr.min_value <= thr.value <= thr.max_value
    assert not any(r.metric.endswith("slowest repeat") for r in results)  # no repeats asked for


def test_rdma_repeats_compare_each_repeat_with_its_own_raw_ucxx_iterations() -> None:
    pytest.importorskip("ucxx", reason="the rdma bench and its raw baseline need the ucx extra: pip install 'pdgrpc[ucx]'")
    results = _run("--backend", "rdma", "--iterations", "2", "--repeat", "2")
    [thr] = [r for r in results if r.metric == "throughput vs raw ucxx tag send/recv"]
    assert thr.samples is not None and len(thr.samples) == 2 and thr.baseline_value
    [slowest] = [r for r in results if r.metric == "throughput vs raw ucxx tag send/recv, slowest repeat"]
    assert slowest.samples is not None and len(slowest.samples) == 2 and slowest.value == min(slowest.samples) > 0


def test_control_times_a_second_raw_pair_like_a_backend() -> None:
    """``--control``: a second raw pair, alternating with the first, gets the same rows a
    backend gets (its throughput against the first pair, and its slowest repeat), so a run
    shows what spread a backend exactly as fast as raw would have shown in it."""
    results = _run("--backend", "tcp", "--iterations", "2", "--repeat", "2", "--control")
    control = [r for r in results if r.case.startswith("control: 2nd raw pair 256 tok")]
    by_metric = {r.metric: r for r in control}
    thr = by_metric["throughput vs raw tcp socket recv_into"]
    assert thr.unit == "GB/s" and thr.value > 0 and thr.baseline_value and thr.ratio == pytest.approx(
        thr.value / thr.baseline_value, rel=1e-6)
    assert thr.samples is not None and len(thr.samples) == 2  # one per repeat
    slowest = by_metric["throughput vs raw tcp socket recv_into, slowest repeat"]
    assert slowest.samples is not None and len(slowest.samples) == 2 and slowest.value == min(slowest.samples) > 0
    assert not any(r.case.startswith("control") for r in _run("--backend", "tcp", "--iterations", "1"))


def test_control_is_refused_where_the_baseline_has_no_pair() -> None:
    with pytest.raises(SystemExit, match="--control repeats the raw pair of a CPU run"):
        _run("--backend", "tcp", "--iterations", "1", "--control", "--device", "cuda")


def test_a_direct_write_run_says_so_in_its_rows() -> None:
    direct = [r.case for r in _run("--backend", "tcp", "--iterations", "1", "--write", "direct")]
    assert direct and all("direct write" in case for case in direct if case.startswith("tcp "))
    assert not any("direct write" in r.case for r in _run("--backend", "tcp", "--iterations", "1"))


def test_prepared_rdma_writes_are_timed_once_the_receiver_posted_its_receives(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default (``--write prepared``): over rdma the WRITE goes out at prepare time and
    the timer starts only once the receiver process has the room's receives up."""
    pytest.importorskip("ucxx", reason="the rdma bench and its raw baseline need the ucx extra: pip install 'pdgrpc[ucx]'")
    posted: dict[int, int] = {}  # room -> the receiver's last answer when asked
    call = PeerProcess.call

    async def spy(peer: PeerProcess, name: str, *args: Any, **kwargs: Any) -> Any:
        answer = await call(peer, name, *args, **kwargs)
        if name == "receives_posted":
            posted[args[0]] = answer
        return answer

    monkeypatch.setattr(PeerProcess, "call", spy)
    _run("--backend", "rdma", "--iterations", "3")
    assert len(posted) == 3 and all(n > 0 for n in posted.values()), posted  # each timed room waited for its receives
