"""CPU time and run-queue wait of a whole process, from ``/proc`` (Linux)."""

from __future__ import annotations

import os


def schedstat(pid: int) -> tuple[int, int]:
    """CPU time used so far by every thread of process ``pid``, and the time they spent
    runnable but waiting for a core (ns each, from schedstat). CPU time does not grow when
    other processes load the machine; the wait is what that load costs the process."""
    cpu = wait = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                fields = f.read().split()
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that just ended
        cpu += int(fields[0])
        wait += int(fields[1])
    return cpu, wait


def cpu_ns(pid: int) -> int:
    """CPU time used so far by every thread of process ``pid`` (ns; :func:`schedstat`)."""
    return schedstat(pid)[0]
