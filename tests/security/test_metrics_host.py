"""The Prometheus endpoint is plain HTTP without authentication: a server asked to serve
it on anything but loopback refuses to start unless told ``--insecure`` (a real
``python -m pdgrpc.bootstrap`` process)."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.prefill.procs import Proc


def _bootstrap(log_dir: Path, name: str, *flags: str) -> Proc:
    return Proc([sys.executable, "-m", "pdgrpc.bootstrap", "--port", "0", "--metrics-port", "0", *flags], log_dir, name)


def test_a_non_loopback_metrics_host_needs_insecure(tmp_path: Path) -> None:
    with _bootstrap(tmp_path, "refused", "--metrics-host", "0.0.0.0") as refused:
        assert refused.proc.wait(60) == 2, refused.tail()
        err = refused.log()
        assert "--metrics-host '0.0.0.0'" in err and "--insecure" in err, err
    with _bootstrap(tmp_path, "allowed", "--metrics-host", "0.0.0.0", "--insecure") as allowed:
        allowed.wait_for(r"metrics on http://0\.0\.0\.0:\d+", source="log")
        assert allowed.proc.poll() is None, allowed.tail()  # it serves
