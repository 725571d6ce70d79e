"""``python -m pdgrpc.cluster.demo`` -- what ``make demo`` runs -- exits 0 and shows, for each
prompt, the generated text, TTFT, KV bytes, the data plane's own time and GB/s (apart
from handshake-to-commit, which includes the prefill's compute), every output equal to
colocated."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pdgrpc.cluster.demo import PROMPTS

pytestmark = pytest.mark.timeout(240)


def test_demo_runs_end_to_end_and_exits_0():
    out = subprocess.run(
        [sys.executable, "-m", "pdgrpc.cluster.demo"], cwd=Path(__file__).resolve().parents[2],
        capture_output=True, text=True, timeout=220,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    stats = re.findall(
        r"TTFT ([\d.]+) ms \| KV ([\d,]+) bytes \| data plane ([\d.]+) ms = ([\d.]+) GB/s"
        r" \| handshake to commit \(incl\. prefill compute\) ([\d.]+) ms .*equals colocated: (\w+)",
        out.stdout,
    )
    assert len(stats) == len(PROMPTS), out.stdout
    for ttft, kv, data_ms, gbps, handshake_ms, same in stats:
        assert float(ttft) > 0 and int(kv.replace(",", "")) > 0 and same == "yes"
        # The rate is bytes over the data plane's time, a part of handshake -> commit.
        assert 0 < float(data_ms) < float(handshake_ms)
        assert float(gbps) == pytest.approx(int(kv.replace(",", "")) / float(data_ms) / 1e6, rel=0.05, abs=0.002)
    assert out.stdout.count("output: ") == len(PROMPTS)
    assert "with transport rdma" in out.stdout or "cannot load here" in out.stdout
    assert f"done: {len(PROMPTS)} prompts" in out.stdout
