"""The Prometheus endpoint is plain HTTP without authentication: a server asked to serve
it on anything but loopback refuses to start unless told ``--insecure`` (a real
``python -m pdgrpc.bootstrap`` process)."""

from __future__ import annotations

import os
import subprocess
import sys


def _bootstrap(*flags: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "pdgrpc.bootstrap", "--port", "0", "--metrics-port", "0", *flags]
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired as exc:  # it started and serves: what --insecure allows
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        return subprocess.CompletedProcess(argv, -1, out, err)


def test_a_non_loopback_metrics_host_needs_insecure() -> None:
    refused = _bootstrap("--metrics-host", "0.0.0.0")
    assert refused.returncode == 2, refused
    assert "--metrics-host '0.0.0.0'" in refused.stderr and "--insecure" in refused.stderr, refused.stderr
    allowed = _bootstrap("--metrics-host", "0.0.0.0", "--insecure", timeout=15.0)
    assert allowed.returncode == -1 and "metrics on http://0.0.0.0:" in allowed.stdout + allowed.stderr, allowed
