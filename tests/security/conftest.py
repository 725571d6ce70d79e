"""The decode process the security tests attack: the decode server tests' own, but giving
up on an unreachable prefill bootstrap after 2 s (tests/decode/test_decode_server.py's
other fixtures, ``stub`` and ``metrics_address``, use it by name)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Iterator

import pytest

from tests.decode.test_decode_server import DECODE_FLAGS, STARTUP_S
from tests.eventually import eventually

FLAGS = [*DECODE_FLAGS, "--resolve-timeout", "2"]  # the last one given wins


@pytest.fixture(scope="module")
def decode_proc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """The decode server process; yields (address, log path)."""
    log_path = tmp_path_factory.mktemp("decode") / "decode.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdgrpc.decode", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", *FLAGS],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        def listening() -> str | None:
            m = re.search(r"pdgrpc decode listening on (\S+:\d+)", log_path.read_text(errors="replace"))
            assert proc.poll() is None, log_path.read_text(errors="replace")
            return m.group(1) if m else None

        yield eventually(listening, STARTUP_S, 0.1, "the decode server did not start"), str(log_path)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
