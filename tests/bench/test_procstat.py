"""``pdgrpc.bench.procstat.schedstat`` tells a process's CPU time from the time its threads
waited for a core: of two spinning processes that share one core, the one at nice 19 runs
little and waits for most of the time. The process tree finds a grandchild and names what
each process runs."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import time

import pytest

from pdgrpc.bench.procstat import children, cpu_ns, module_of, process_tree, schedstat

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="schedstat is Linux's /proc"),
]

SPIN_S = 0.6


def _spin(core: int, nice: int, go: "mp.synchronize.Event") -> None:
    os.sched_setaffinity(0, {core})
    os.nice(nice)
    go.wait()
    end = time.monotonic() + SPIN_S
    while time.monotonic() < end:
        pass


def test_the_lower_priority_of_two_processes_on_one_core_waits_for_it() -> None:
    core = min(os.sched_getaffinity(0))
    go = mp.get_context("fork").Event()
    procs = [mp.get_context("fork").Process(target=_spin, args=(core, nice, go)) for nice in (0, 19)]
    for p in procs:
        p.start()
    try:
        time.sleep(0.2)  # both are blocked on the event, pinned
        before = {p.pid: schedstat(p.pid) for p in procs if p.pid is not None}
        go.set()
        time.sleep(SPIN_S * 0.8)  # both still spin: neither has reached its end
        after = {pid: schedstat(pid) for pid in before}
    finally:
        for p in procs:
            p.join(30)
    window_ns = SPIN_S * 0.8 * 1e9
    (cpu_a, wait_a), (cpu_b, wait_b) = ((after[pid][0] - c, after[pid][1] - w) for pid, (c, w) in before.items())
    assert cpu_a + cpu_b < 1.1 * window_ns  # one core between them
    assert cpu_a > 2 * cpu_b, (cpu_a, cpu_b)
    # Nice 19 weighs 15 against nice 0's 1024: it waits through nearly all of the window.
    assert cpu_b < 0.25 * window_ns, (cpu_b, wait_b)
    assert wait_b > 0.5 * window_ns, (cpu_b, wait_b)
    assert wait_b > 2 * wait_a, (wait_a, wait_b)

def test_cpu_ns_is_the_cpu_time_of_schedstat() -> None:
    cpu, _ = schedstat(os.getpid())
    assert 0 < cpu <= cpu_ns(os.getpid())


def test_the_process_tree_holds_a_grandchild_and_names_each_module() -> None:
    code = "import subprocess, sys; subprocess.run(['sleep', '30'])"
    child = subprocess.Popen([sys.executable, "-c", code, "pdgrpc.probe"])
    tree: list[int] = []
    try:
        deadline = time.monotonic() + 20
        while len(tree := process_tree(child.pid, children())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.pid in process_tree(os.getpid(), children())
        child_pid, grandchild = tree
        assert child_pid == child.pid
        assert module_of(child.pid) == "pdgrpc.probe"  # the first pdgrpc word of its command line
        assert module_of(grandchild) == "sleep"  # no pdgrpc word: its argv[0]
    finally:
        for pid in reversed(tree or [child.pid]):
            os.kill(pid, 9)
        child.wait()
