"""The decode process the security tests attack: the decode server tests' own, but giving
up on an unreachable prefill bootstrap after 2 s (tests/decode/test_decode_server.py's
other fixtures, ``stub`` and ``metrics_address``, use it by name). One for the package:
its tests read counters as changes, so they share it."""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.decode.test_decode_server import DECODE_FLAGS
from tests.prefill.procs import DecodeProc

FLAGS = [*DECODE_FLAGS, "--resolve-timeout", "2"]  # the last one given wins


@pytest.fixture(scope="package")
def decode_proc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """The decode server process; yields (address, log path)."""
    with DecodeProc(["--metrics-port", "0", *FLAGS], tmp_path_factory.mktemp("decode")) as decode:
        yield decode.address, str(decode.log_path)
