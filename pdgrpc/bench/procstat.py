"""CPU time of a whole process, from ``/proc`` (Linux)."""

from __future__ import annotations

import os


def cpu_ns(pid: int) -> int:
    """CPU time used so far by every thread of process ``pid`` (ns, from schedstat):
    unlike wall time, it does not grow when other processes load the machine."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that just ended
    return total
