"""A prefill worker whose controller dies while the worker still starts stops too, and
releases what it started: a worker never outlives its controller. The start-up steps
that wait -- a TP rank's join of its gloo group, the compute process's start, the worker's
own imports -- are each caught with the controller SIGKILLed (no goodbye: its pid and
its end of the worker's pipes just go away)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Callable

import pytest

from pdgrpc.serving.rendezvous import dist_init_method
from tests.eventually import eventually
from tests.prefill.procs import ENGINE_FLAGS, STARTUP_S, Proc, accepts, pid_alive, session_pids

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads a worker's fds and session from /proc")

# A liveness bound, far below the waits the worker is caught in (--dist-timeout, the
# compute process's start timeout): a worker that waits them out is still running here.
_GONE_S = 20.0

# Starts the worker as the controller does (a session of its own, so a Ctrl-C at the
# terminal reaches the controller alone), prints its pid, and waits for it.
_CONTROLLER = """
import subprocess, sys
with open(sys.argv[1], "wb") as out, open(sys.argv[2], "wb") as err:
    worker = subprocess.Popen(sys.argv[3:], stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
print(worker.pid, flush=True)
worker.wait()
"""

# On the path of the worker's processes: a compute process says it started, then never
# reads its config, so the worker waits in ComputeProcess.start.
_STALLED_COMPUTE = """
import os, sys, time
if "pdgrpc.prefill.compute_process" in sys.orig_argv:
    open(os.environ["PDGRPC_TEST_COMPUTE_STARTED"], "w").close()
    time.sleep(3600)
"""

_WORKER = [
    sys.executable, "-m", "pdgrpc.prefill.worker_main", "--dp-rank", "0", "--dp-size", "1",
    "--bootstrap", "127.0.0.1:1", "--load-balance-method", "round_robin", "--transport", "fake", *ENGINE_FLAGS,
]


def _in_compute_start(worker: int) -> bool:
    """The worker holds the compute process's KV memfd only inside ComputeProcess.start."""
    for fd in Path(f"/proc/{worker}/fd").iterdir():
        try:
            if "memfd:pdgrpc-kv" in os.readlink(fd):
                return True
        except OSError:
            continue  # closed meanwhile
    return False


def _case(name: str, tmp_path: Path) -> tuple[list[str], dict[str, str], Callable[[int], bool]]:
    """The worker's flags, its environment, and when (given its pid) it waits in the step."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_STALLED_COMPUTE)
    started = tmp_path / "compute-started"
    repo = str(Path(__file__).resolve().parents[2])
    env = {
        "PYTHONPATH": os.pathsep.join([str(site), repo, os.environ.get("PYTHONPATH", "")]),
        "PDGRPC_TEST_COMPUTE_STARTED": str(started),
    }
    if name == "tp-join":  # rank 0 of 2; rank 1 never comes
        init = dist_init_method()
        flags = ["--tp-rank", "0", "--tp-size", "2", "--dist-init", init, "--dist-timeout", "600"]
        return flags, env, lambda pid: accepts(init)
    if name == "compute-start":
        return ["--compute-in", "process"], env, _in_compute_start
    # Caught as soon as its compute process runs: the worker is still loading torch then,
    # or just past it, with no event loop yet to watch anything.
    return ["--compute-in", "process"], env, lambda pid: started.exists()


@pytest.mark.parametrize("step", ["tp-join", "compute-start", "imports"])
def test_a_worker_whose_controller_dies_while_it_starts_stops(tmp_path: Path, step: str) -> None:
    flags, env, in_step = _case(step, tmp_path)
    out, err = tmp_path / "worker.out", tmp_path / "worker.log"
    controller = Proc([sys.executable, "-c", _CONTROLLER, str(out), str(err), *_WORKER, *flags], tmp_path, "controller", env=env)
    worker = 0
    try:
        worker = int(eventually(lambda: controller.out().strip(), STARTUP_S, what=lambda: controller.tail()))

        def waiting() -> bool:
            if controller.proc.poll() is not None:
                raise AssertionError(f"the worker exited before {step}:\n{err.read_text(errors='replace')[-4000:]}")
            return in_step(worker)

        eventually(waiting, STARTUP_S, interval=0.05, what=lambda: f"the worker reaches {step}\n{err.read_text(errors='replace')[-4000:]}")
        controller.proc.kill()
        controller.proc.wait(5)
        try:
            eventually(lambda: not pid_alive(worker), _GONE_S, interval=0.1)
        except AssertionError:
            pytest.fail(f"the worker still runs {_GONE_S} s after its controller died in {step}:\n{err.read_text(errors='replace')[-4000:]}")
        eventually(lambda: not session_pids(worker), 5.0, what=lambda: f"the worker left {session_pids(worker)} running")
        log = err.read_text(errors="replace")
        assert log.count(f"controller (pid {controller.pid}) is gone") == 1, log[-4000:]
        assert "Traceback" not in log, log[-4000:]
    finally:
        controller.stop(timeout=1, signum=signal.SIGKILL)
        if worker:
            try:
                os.killpg(worker, signal.SIGKILL)
            except ProcessLookupError:
                pass
