"""``python -m pdgrpc.bench bootstrap --peer-python PATH`` refuses, with a message that
says why and what to do, a PATH that cannot run SGLang's bootstrap servers. (Without the
flag the bench runs as before: tests/bench/test_plot.py runs it. The SGLang side itself
needs sglang, which the test environment does not install: see docs/performance.md.)"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdgrpc.bench", "bootstrap", "--iterations", "10", "--warmup", "2", "--memory-rooms", "0", *args],
        capture_output=True, text=True, timeout=110,
    )


def test_a_python_without_sglang_is_refused_before_anything_runs() -> None:
    assert importlib.util.find_spec("sglang") is None, "this test needs a Python without sglang: pdgrpc's own"
    out = _bench("--peer-python", sys.executable)
    assert out.returncode != 0
    assert f"--peer-python {sys.executable}: it cannot import sglang" in out.stderr
    assert "pip install sglang==0.5.23 --no-deps" in out.stderr
    assert "p50" not in out.stdout  # no half-run table


def test_a_path_that_is_not_a_python_is_refused(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-python"
    out = _bench("--peer-python", str(missing))
    assert out.returncode != 0
    assert f"--peer-python {missing}: not an executable file" in out.stderr
