"""``python -m pdgrpc.bench NAME --plot PATH.png`` draws what the table says: a PNG whose
``Series`` text chunk names each line it holds, in legend order."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from pdgrpc.bench.plot import bootstrap_figure, e2e_figure, multiturn_figure, prefix_figure, transport_figure

pytestmark = pytest.mark.timeout(120)


def _series(path: Path) -> list[str]:
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] >= 300 and im.size[1] >= 200
        im.load()
        return im.text["Series"].splitlines()


def test_a_tiny_bootstrap_run_draws_latency_by_batch_beside_the_health_check_floor(tmp_path: Path) -> None:
    png = tmp_path / "pics" / "bootstrap.png"  # a missing folder is created
    out = subprocess.run(
        [sys.executable, "-m", "pdgrpc.bench", "bootstrap", "--iterations", "30", "--warmup", "5",
         "--throughput-rooms", "200", "--batch", "100", "--memory-rooms", "0", "--plot", str(png)],
        capture_output=True, text=True, timeout=110, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"wrote {png}" in out.stdout
    assert _series(png) == ["QueryDpRanks p50", "QueryDpRanks p99", "health Check p50 (floor)", "health Check p99"]


def test_transport_picture_has_each_case_beside_the_raw_baseline(tmp_path: Path) -> None:
    png = tmp_path / "transport.png"
    transport_figure(
        png, "rdma", "raw ucxx tag send/recv", [12 << 20, 96 << 20],
        {"contiguous": [7.3, 15.6], "scattered": [7.2, 8.0], "head-sliced": [None, 6.0]}, [22.0, 14.0],
    )
    assert _series(png) == ["rdma contiguous", "rdma scattered", "rdma head-sliced", "raw baseline (raw ucxx tag send/recv)"]


def test_e2e_picture_has_one_ttft_cdf_per_system(tmp_path: Path) -> None:
    png = tmp_path / "e2e.png"
    e2e_figure(png, {"colocated": [30.0, 29.0, 31.5, 33.0], "1p1d-rdma": [34.0, 35.5, 33.9]}, 512)
    # p50 by bench e2e's rule: the sorted sample at round(0.5 * (n - 1))
    assert _series(png) == ["colocated (p50 31.5 ms)", "1p1d-rdma (p50 34.0 ms)"]


def test_without_matplotlib_plot_says_how_to_get_it_before_running(tmp_path: Path) -> None:
    # matplotlib made unimportable in a child; the bench must refuse at once, not after its run
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from pdgrpc.bench.__main__ import main\n"
        "sys.exit(main(['transport', '--plot', 'x.png']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 2
    assert "--plot needs matplotlib: pip install 'pdgrpc[plot]'" in out.stderr
    assert "throughput" not in out.stdout and not (tmp_path / "x.png").exists()


def test_prefix_picture_has_first_and_later_ttft_bars_per_arm(tmp_path: Path) -> None:
    png = tmp_path / "prefix.png"
    arm = {"ttft_p50/first": 900.0, "ttft_p90/first": 1000.0, "ttft_p50/later": 150.0, "ttft_p90/later": 200.0}
    prefix_figure(png, {"arm a: cache off": {**arm, "ttft_p50/later": 900.0}, "arm c: cache_aware": arm})
    assert _series(png) == ["p50 first", "p90 first", "p50 later", "p90 later"]


def test_multiturn_picture_has_bytes_and_ttft_by_turn_per_arm(tmp_path: Path) -> None:
    png = tmp_path / "multiturn.png"
    multiturn_figure(png, {
        "arm off: no reuse": {"bytes/request": [131e3, 393e3, 655e3], "ttft_p50": [400.0, 900.0, 1300.0]},
        "arm delta: decode reuse": {"bytes/request": [131e3, 164e3, 164e3], "ttft_p50": [400.0, 300.0, 310.0]},
    })
    assert _series(png) == ["arm off bytes/request", "arm off TTFT p50", "arm delta bytes/request", "arm delta TTFT p50"]


def test_benches_that_do_not_draw_offer_no_plot_flag() -> None:
    out = subprocess.run([sys.executable, "-m", "pdgrpc.bench", "state", "--plot", "x.png"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "unrecognized arguments: --plot" in out.stderr
