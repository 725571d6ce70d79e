"""A child started through :func:`pdgrpc.serving.children.guarded_argv` (how the cluster
launcher starts every process) is the process it names, and dies with its parent."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pdgrpc.serving.children import guarded_argv

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def test_the_child_keeps_the_pid_it_was_started_with() -> None:
    # The shim execs the child: the pid the launcher holds (and signals) is the child's.
    child = subprocess.Popen(guarded_argv([sys.executable, "-c", "import os; print(os.getpid())"]), stdout=subprocess.PIPE, text=True)
    assert child.communicate(timeout=30)[0].strip() == str(child.pid)
    assert child.returncode == 0


def _cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode().split("\0")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_child_dies_when_its_parent_is_killed() -> None:
    parent_code = (
        "import subprocess, sys, time\n"
        "from pdgrpc.serving.children import guarded_argv\n"
        "p = subprocess.Popen(guarded_argv([sys.executable, '-c', 'import time; time.sleep(60)']), start_new_session=True)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    deadline = time.monotonic() + 10
    while _cmdline(child)[1:2] != ["-c"]:  # the shim's is "-I": wait until it exec'd the child
        assert time.monotonic() < deadline, "the child never became the process it names"
        time.sleep(0.05)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while _alive(child):
        assert time.monotonic() < deadline, "the child outlived its parent"
        time.sleep(0.05)
