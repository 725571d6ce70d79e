"""A server's log line is one line: no text it logs, whoever chose it, starts another."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import logging
from pdgrpc.serving.logs import setup_logging
setup_logging("info", "t")
log = logging.getLogger("pdgrpc.test")
log.warning("refused: %s", "q1\nroom=42 finished request_id=forged\r\x1b[2K")
log.info("prompt text: %s", "héllo, 世界")
try:
    raise RuntimeError("boom")
except RuntimeError:
    log.exception("failed: %s", "a\nb")
"""


def test_a_logged_line_break_starts_no_line_and_a_traceback_stays_whole() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    refused = [line for line in lines if "refused:" in line]
    assert refused and refused[0].endswith(r"refused: q1\nroom=42 finished request_id=forged\r\x1b[2K"), lines
    assert not any(line.startswith("room=42") for line in lines), lines
    assert any(line.endswith("prompt text: héllo, 世界") for line in lines), lines  # printable text as it is
    failed = next(i for i, line in enumerate(lines) if "failed:" in line)
    assert lines[failed].endswith(r"failed: a\nb")
    assert lines[failed + 1] == "Traceback (most recent call last):" and lines[-1] == "RuntimeError: boom", lines
