"""A decode TP rank says, before it joins its gloo group, where it joins and as which rank
of how many (a rank whose peers never come waits there up to ``--dist-timeout``), and
a stop while it waits ends it at once, as any start-up does
(:func:`pdgrpc.serving.launch.launch`): status 0 on SIGTERM, one line saying so."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pdgrpc.serving.rendezvous import dist_init_method
from tests.prefill.procs import STARTUP_S, DecodeProc, Proc

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a decode's TP ranks die with it through PR_SET_PDEATHSIG")

# A liveness bound, far below the join's own timeout: a rank that waits for the join
# instead of stopping is still running at the end of it.
_STOP_S = 20.0
_DECODE = ["--transport", "fake", "--model-size", "tiny", "--num-pages", "64"]


def test_a_rank_whose_peer_never_answers_says_what_it_waits_for_and_stops(tmp_path: Path) -> None:
    init = dist_init_method()
    host, port = init.removeprefix("tcp://").rsplit(":", 1)
    # Rank 1 dials rank 0's store: a listener that accepts and never answers is a
    # rendezvous that never completes.
    with socket.create_server((host, int(port))) as store:
        argv = [
            sys.executable, "-m", "pdgrpc.decode.follower", *_DECODE, "--tp-size", "2", "--tp-rank", "1",
            "--dist-init", init, "--dist-timeout", "600",
        ]
        rank = Proc(argv, tmp_path, "rank1", new_session=True)
        try:
            store.settimeout(STARTUP_S)
            conn, _ = store.accept()
            with conn:
                rank.wait_for(rf"joining the TP group at {init} as rank 1 of 2", source="log")
                rank.proc.send_signal(signal.SIGTERM)
                try:
                    code = rank.proc.wait(_STOP_S)
                except subprocess.TimeoutExpired:
                    pytest.fail(f"the rank did not stop within {_STOP_S} s of SIGTERM while it joined:\n{rank.tail()}")
        finally:
            rank.stop(timeout=1, signum=signal.SIGKILL)
    assert code == 0, rank.tail()
    log = rank.log()
    assert "stopped by SIGTERM while starting" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def test_every_rank_of_a_tp_decode_says_where_it_joins(tmp_path: Path) -> None:
    # Rank 1 writes to the stderr it inherits from rank 0.
    with DecodeProc([*_DECODE, "--tp-size", "2"], tmp_path) as decode:
        log = decode.log()
    for rank in (0, 1):
        assert f" as rank {rank} of 2" in log, log[-3000:]
    assert log.count("joining the TP group at tcp://") == 2, log[-3000:]


FOLLOWER_RANK_ERRORS = [
    (["--tp-size", "2", "--tp-rank", "0"], "--tp-rank must be in [1, --tp-size=2), got 0"),
    (["--tp-size", "2", "--tp-rank", "2"], "--tp-rank must be in [1, --tp-size=2), got 2"),
    (["--tp-size", "2", "--tp-rank", "-1"], "--tp-rank must be in [1, --tp-size=2), got -1"),
]


@pytest.mark.parametrize("flags, message", FOLLOWER_RANK_ERRORS, ids=[" ".join(f) for f, _ in FOLLOWER_RANK_ERRORS])
def test_a_follower_rank_outside_its_group_is_a_usage_error(flags: list[str], message: str) -> None:
    # Taken, rank 0 or a rank past the group waits out --dist-timeout on a group that
    # never forms, and a negative rank ends in a torch.distributed traceback. Rank 0 is
    # the decode itself, never a follower.
    cmd = [sys.executable, "-m", "pdgrpc.decode.follower", *_DECODE, "--dist-init", dist_init_method(), "--dist-timeout", "5", *flags]
    out = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"python -m pdgrpc.decode.follower: error: {message}" in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]


def test_a_follower_with_nowhere_to_meet_its_group_is_a_usage_error() -> None:
    # Without --dist-init (rank 0 always passes it) the rank had no group to join.
    cmd = [sys.executable, "-m", "pdgrpc.decode.follower", *_DECODE, "--tp-size", "2", "--tp-rank", "1"]
    out = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "python -m pdgrpc.decode.follower: error: --dist-init is required with --tp-size > 1" in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
