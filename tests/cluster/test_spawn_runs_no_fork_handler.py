"""The launcher starts its processes without running this process's fork handlers in the
child. gRPC, with its fork support on (its default), installs handlers that start threads
in a forked child; the child then closes its inherited fds before exec and those threads
abort it (SIGABRT) or crash it (SIGSEGV), now and then. uvloop's subprocess_exec forks, so
a program that runs the launcher on uvloop lost a server at start-up about once in 20 runs.

Each case runs in a fresh interpreter whose fork handler in the child is libc's ``abort``:
a start that runs fork handlers kills every child before exec, every time."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

_PRELUDE = textwrap.dedent(
    """
    import asyncio, ctypes, sys
    libc = ctypes.CDLL("libc.so.6")
    # Every fork handler in a child now aborts it, as gRPC's do now and then.
    # (pthread_atfork is __register_atfork with no DSO handle; libc.so.6 exports only the latter.)
    assert libc.__register_atfork(None, None, ctypes.cast(libc.abort, ctypes.c_void_p), None) == 0
    import uvloop
    """
)

_SPAWN = _PRELUDE + textwrap.dedent(
    """
    from pdgrpc.serving.children import spawn

    async def main():
        child = await spawn([sys.executable, "-c", "print('child ran')"], stdout=None, stderr=None)
        assert await child.wait() == 0, child.returncode
        assert child.returncode == 0

    uvloop.run(main())
    """
)

_CLUSTER = _PRELUDE + textwrap.dedent(
    """
    from pdgrpc.cluster import Cluster

    async def main():
        async with Cluster("colocated", start_timeout=120) as c:
            print("serving", c.procs["colocated"].returncode)

    uvloop.run(main())
    """
)


@pytest.mark.parametrize("script, says", [(_SPAWN, "child ran"), (_CLUSTER, "serving None")], ids=["spawn", "cluster"])
def test_a_child_starts_on_uvloop_whatever_fork_handlers_this_process_has(script: str, says: str) -> None:
    pytest.importorskip("uvloop", reason="the loop whose subprocess_exec forks (a pdgrpc dependency)")
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert says in out.stdout


_PREFILL = _PRELUDE + textwrap.dedent(
    """
    from pdgrpc.prefill.__main__ import main

    sys.exit(main(["--host", "127.0.0.1", "--port", "0", "--transport", "tcp", "--model-size", "tiny"]))
    """
)


def test_a_prefill_controller_starts_its_workers_whatever_fork_handlers_it_has() -> None:
    """The controller starts (and restarts) its workers while it serves on uvloop."""
    pytest.importorskip("uvloop", reason="the loop whose subprocess_exec forks (a pdgrpc dependency)")
    from pdgrpc.prefill.controller_main import READY_LINE

    proc = subprocess.Popen([sys.executable, "-c", _PREFILL], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready = next((line for line in proc.stdout if line.startswith(READY_LINE)), None)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert ready is not None, err[-3000:]
    assert proc.returncode == 0, err[-3000:]
