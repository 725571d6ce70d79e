"""A decode's TP ranks do not outlive rank 0, however it ends during start-up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _rank_1_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except FileNotFoundError:
        return None
    for child in children:
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"pdgrpc.decode.follower" in f.read():
                    return child
        except FileNotFoundError:
            continue
    return None


def test_a_tp_rank_dies_with_a_decode_stopped_while_it_starts() -> None:
    # SIGTERM before the decode serves ends it at once (nothing to drain); rank 1, still
    # importing, would otherwise wait for a group that is gone.
    cmd = [sys.executable, "-m", "pdgrpc.decode", "--transport", "fake", "--model-size", "tiny", "--tp-size", "2", "--port", "0"]
    decode = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rank_1 = None
    try:
        deadline = time.monotonic() + 120
        while rank_1 is None and decode.poll() is None and time.monotonic() < deadline:
            rank_1 = _rank_1_of(decode.pid)
            time.sleep(0.02)
        assert rank_1 is not None, "the decode started no TP rank"
        decode.send_signal(signal.SIGTERM)
        decode.wait(timeout=60)
        deadline = time.monotonic() + 30
        while _alive(rank_1) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(rank_1), f"TP rank 1 (pid {rank_1}) outlived its decode"
    finally:
        decode.kill()
        if rank_1 is not None and _alive(rank_1):
            os.kill(rank_1, signal.SIGKILL)
