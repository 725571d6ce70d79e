"""CPU time and run-queue wait of a whole process, and the process tree, from ``/proc`` (Linux)."""

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


def children() -> dict[int, list[int]]:
    """Each process's child pids, from one pass over ``/proc``."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # a process that just ended
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        kids.setdefault(ppid, []).append(int(d))
    return kids


def process_tree(pid: int, kids: dict[int, list[int]]) -> list[int]:
    """``pid`` and every process below it in ``kids`` (:func:`children`)."""
    return [pid] + [q for k in kids.get(pid, []) for q in process_tree(k, kids)]


def module_of(pid: int) -> str:
    """The ``pdgrpc`` module process ``pid`` runs (``python -m MODULE``), else its argv[0]."""
    with open(f"/proc/{pid}/cmdline") as f:
        argv = f.read().split("\0")
    return next((a for a in argv if a.startswith("pdgrpc")), argv[0])
