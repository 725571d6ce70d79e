"""The whole pdgrpc package type-checks under mypy's default mode, with the config in
pyproject.toml (``files = ["pdgrpc"]``), which holds pdgrpc.state and pdgrpc.metrics to
``--strict``'s flags (tests/state/test_state_purity.py checks that it does)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_mypy_passes_on_the_whole_package() -> None:
    env = dict(os.environ, MYPY_CACHE_DIR=str(REPO / ".mypy_cache"))
    proc = subprocess.run(
        [sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True, text=True, timeout=400, env=env
    )
    assert proc.returncode == 0, f"mypy failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}"
