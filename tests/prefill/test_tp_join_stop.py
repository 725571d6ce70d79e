"""A TP prefill worker stopped while it joins its dp group's gloo world stops at once, as
any start-up does (:func:`pdgrpc.serving.launch.launch`): status 0 on SIGTERM, 130 on
Ctrl-C, one line saying so, and nothing it started left running. Its peer rank never
comes here, so a join that held the worker would hold it for ``--dist-timeout``."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from pdgrpc.serving.rendezvous import dist_init_method
from tests.eventually import eventually
from tests.prefill.procs import ENGINE_FLAGS, STARTUP_S, Proc, accepts, session_pids

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the processes of a session from /proc")

# A liveness bound, far below the join's own timeout: a worker that waits for the join
# instead of stopping is still running at the end of it.
_STOP_S = 20.0
_DIST_TIMEOUT_S = 600


def _worker(tp_rank: int, init: str, logs: Path) -> Proc:
    """Rank ``tp_rank`` of a TP 2 worker whose other rank never starts, in a session of
    its own (so what it started can be found, and killed, after it)."""
    argv = [
        sys.executable, "-m", "pdgrpc.prefill.worker_main", "--dp-rank", "0", "--dp-size", "1",
        "--tp-rank", str(tp_rank), "--tp-size", "2", "--dist-init", init, "--dist-timeout", str(_DIST_TIMEOUT_S),
        "--bootstrap", "127.0.0.1:1", "--load-balance-method", "round_robin", "--transport", "fake", *ENGINE_FLAGS,
    ]
    return Proc(argv, logs, f"rank{tp_rank}", new_session=True)


def _host_port(init: str) -> tuple[str, int]:
    host, port = init.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


def _rank_0_listens(worker: Proc, init: str) -> bool:
    """Rank 0 hosts the group's store: once it accepts, the rank is inside the join."""
    if worker.proc.poll() is not None:
        raise AssertionError(f"the worker exited before it joined (status {worker.proc.returncode}):\n{worker.tail()}")
    return accepts(init)


@contextlib.contextmanager
def _joining(tp_rank: int, logs: Path) -> Iterator[Proc]:
    """A worker of rank ``tp_rank``, inside its join once this yields."""
    init = dist_init_method()
    if tp_rank == 0:  # its peer, rank 1, is absent
        worker = _worker(0, init, logs)
        try:
            eventually(lambda: _rank_0_listens(worker, init), STARTUP_S, interval=0.1, what=lambda: f"rank 0 hosts the store\n{worker.tail()}")
            yield worker
        finally:
            worker.stop(timeout=1, signum=signal.SIGKILL)
        return
    # Rank 1 dials rank 0's store: a listener that accepts and never answers is a rendezvous
    # that never completes.
    with socket.create_server(_host_port(init)) as store:
        worker = _worker(tp_rank, init, logs)
        try:
            store.settimeout(STARTUP_S)
            conn, _ = store.accept()
            with conn:
                yield worker
        finally:
            worker.stop(timeout=1, signum=signal.SIGKILL)


@pytest.mark.parametrize(
    ("tp_rank", "signum", "status", "line"),
    [
        (0, signal.SIGTERM, 0, "stopped by SIGTERM while starting"),
        (1, signal.SIGINT, 128 + signal.SIGINT, "stopped by Ctrl-C (SIGINT)"),
    ],
    ids=["rank0-sigterm", "rank1-ctrl-c"],
)
def test_a_tp_worker_stops_while_it_joins_its_group(tmp_path: Path, tp_rank: int, signum: int, status: int, line: str) -> None:
    with _joining(tp_rank, tmp_path) as worker:
        worker.proc.send_signal(signum)
        try:
            code = worker.proc.wait(_STOP_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the worker did not stop within {_STOP_S} s of {signal.Signals(signum).name} while it joined:\n{worker.tail()}")
        assert code == status, worker.tail()
        log = worker.log()
        assert line in log, log[-3000:]
        assert "Traceback" not in log, log[-3000:]
        left = session_pids(worker.pid)  # killed on the way out, with the session's group
        assert not left, f"the worker left {left} running"
