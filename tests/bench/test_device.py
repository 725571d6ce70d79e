"""``bench transport --device`` and ``bench e2e --device``: a clear refusal without CUDA,
and a real (small) GPU run where there is one."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.e2e.harness import skip_unless_transport


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("bench", [["transport", "--backend", "rdma"], ["transport", "--backend", "tcp"], ["e2e"]])
def test_device_cuda_without_cuda_is_one_clear_line(bench: list[str]) -> None:
    out = subprocess.run([sys.executable, "-m", "pdgrpc.bench", *bench, "--device", "cuda"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    [line] = out.stderr.strip().splitlines()  # one line, no traceback
    assert line.startswith(f"python -m pdgrpc.bench {bench[0]}: --device 'cuda': torch.cuda is not available ("), line


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["tcp", "rdma"])
def test_bench_transport_on_the_gpu_reports_against_the_ipc_baseline(backend: str) -> None:
    skip_unless_transport(backend)
    out = subprocess.run(
        [sys.executable, "-m", "pdgrpc.bench", "transport", "--backend", backend, "--device", "cuda", "--tokens", "1024",
         "--layers", "4", "--iterations", "2", "--warmup", "1", "--cases", "contiguous", "scattered"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "raw torch CUDA IPC copy_" in out.stdout
