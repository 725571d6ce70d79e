"""``python -m pdgrpc.bench vllm`` compares arms order-fairly: no arm always runs first
or right after the same other arm, and an arm's CPU counts every process it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from pdgrpc.bench.vllm import arm_order, group_cpu_ms


def test_each_arm_runs_first_and_last_once_per_two_prompts():
    arms = ["colocated", "first token", "recompute"]
    orders = [arm_order(arms, i) for i in range(4)]
    assert all(sorted(o) == sorted(arms) for o in orders)  # every prompt visits every arm
    for i in range(0, 4, 2):
        pair = orders[i:i + 2]
        assert {o[0] for o in pair} == {"colocated", "recompute"}
        assert {o[-1] for o in pair} == {"colocated", "recompute"}
        followers = {(o[j], o[j + 1]) for o in pair for j in range(len(o) - 1)}
        assert ("first token", "recompute") in followers and ("recompute", "first token") in followers


def _cpu_ms(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1e3 / os.sysconf("SC_CLK_TCK")


def test_group_cpu_counts_a_busy_child_of_the_group():
    # The leader waits; its child (same process group) spins until killed.
    spin = "while True: pass"
    code = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {spin!r}])"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        children: list[str] = []
        while not children and time.monotonic() < deadline:
            time.sleep(0.1)
            with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                children = f.read().split()
        while _cpu_ms(int(children[0])) < 50 and time.monotonic() < deadline:
            time.sleep(0.1)
        child = _cpu_ms(int(children[0]))
        assert child >= 50
        assert group_cpu_ms([proc.pid]) >= child + _cpu_ms(proc.pid)
        assert group_cpu_ms([proc.pid + 10**7]) == 0  # no such group
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
