"""A prefill worker stops once its controller is gone, woken by the controller's pidfd:
an idle worker never polls for it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# The worker's watch, in a grandchild of this test: its parent (the "controller") exits
# once the watch runs. asyncio.sleep is recorded: polling would call it.
_WORKER = """
import asyncio, os, sys
from pdgrpc.prefill.worker_server import watch_parent
slept = []
real_sleep = asyncio.sleep
async def sleep(delay, *args):
    slept.append(delay)
    return await real_sleep(delay, *args)
asyncio.sleep = sleep
async def main():
    stop = asyncio.Event()
    watch = asyncio.ensure_future(watch_parent(os.getppid(), stop))
    await real_sleep(0.05)
    open(sys.argv[1], "w").close()  # tells the parent to exit
    await asyncio.wait_for(stop.wait(), 30)
    await watch
    print("stopped, slept", slept, flush=True)
asyncio.run(main())
"""

_CONTROLLER = """
import os, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
while not os.path.exists(sys.argv[2]) and worker.poll() is None:
    time.sleep(0.01)
"""


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="os.pidfd_open is Linux-only (the worker polls elsewhere)")
def test_a_worker_whose_controller_exits_stops_without_polling(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _CONTROLLER, _WORKER, str(ready)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # The grandchild writes to the same pipe; run() returns once every writer closed it.
    assert "stopped, slept []" in out.stdout, out.stdout + out.stderr
