"""``python -m pdgrpc.cluster.demo`` -- what ``make demo`` runs -- exits 0 and shows, for each
prompt, the generated text, TTFT, KV bytes, the data plane's own time and GB/s (apart
from handshake-to-commit, which includes the prefill's compute), every output equal to
colocated: on the reference engine (``make demo MODEL=reference``, offline) and on
SmolLM2-135M-Instruct (``make demo``; fetched from PyPI once), which says " Paris."."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pdgrpc.cluster.demo import PROMPTS, SMOLLM2_CHATS, SMOLLM2_PROMPTS, main

pytestmark = pytest.mark.timeout(240)


def _demo(*args: str, timeout: float = 220) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdgrpc.cluster.demo", *args], cwd=Path(__file__).resolve().parents[2],
        capture_output=True, text=True, timeout=timeout,
    )


def test_demo_runs_end_to_end_and_exits_0():
    out = _demo("--model", "reference")
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
    assert f"done: {len(PROMPTS)} requests" in out.stdout
    assert f"({len(PROMPTS[0].encode()) + 1} tokens)" in out.stdout  # the byte tokenizer's count, BOS included


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_default_demo_serves_smollm2_and_knows_paris():
    from tests.real_model import smollm2_or_skip

    smollm2_or_skip()
    # 8 tokens: " Paris." and the chat's whole answer (7 tokens and its end) fit.
    out = _demo("--transport", "tcp", "--max-new-tokens", "8", timeout=400)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in out.stdout
    assert "[1] 'The capital of France is'  (5 tokens)\n    output: ' Paris." in out.stdout
    assert "output: 'The capital of Germany is Berlin.'" in out.stdout  # the chat, through the router's template
    n = len(SMOLLM2_PROMPTS) + len(SMOLLM2_CHATS)
    assert out.stdout.count("equals colocated: yes") == n and f"done: {n} requests" in out.stdout


def test_max_new_tokens_below_1_is_refused_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "reference", "--max-new-tokens", "0"])
    assert exit_info.value.code == 2
    assert "--max-new-tokens must be at least 1, not 0" in capsys.readouterr().err
