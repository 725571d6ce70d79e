"""Compute threads that yield the CPU to the serving path: ``--compute-nice``.

An engine's forward pass runs on a thread of the server process, beside the asyncio loop
and gRPC's threads, and on a small host it shares its core with the other servers of the
request's path. When both want a core at once, Linux's scheduler picks by nice value:
with the compute at +10, the short serving work (an RPC, a KV transfer, the first
token's send) runs first and the compute takes the rest, instead of the serving work
queueing behind a time slice of compute. The total CPU stays the same, and colocated
serving, which has no such serving work beside its compute, is unchanged.

Linux only (a thread's nice value is per thread there); elsewhere it is a no-op, logged.
Raising a nice value needs no privilege; lowering it back would, so it is set once per
thread, when the thread starts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import sys
import threading
from typing import Any, Callable, TypeVar

__all__ = ["abandonable", "compute_executor", "lower_process_priority", "lower_thread_priority"]

log = logging.getLogger("pdgrpc.serving")

T = TypeVar("T")


def compute_executor(name: str, nice: int) -> concurrent.futures.ThreadPoolExecutor:
    """One thread for an engine's calls (engines are not thread-safe), ``nice`` levels
    below the serving threads once it starts (on its first submit)."""
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name, initializer=lower_thread_priority, initargs=(nice,))


def lower_thread_priority(nice: int) -> None:
    """Add ``nice`` to the calling thread's nice value (0: leave it). Never raises: a
    thread that cannot be reniced runs at its process's priority, and says so."""
    if nice <= 0:
        return
    if not sys.platform.startswith("linux"):
        log.info("--compute-nice %d: per-thread nice values are Linux only; the compute runs at the process's priority", nice)
        return
    tid = threading.get_native_id()
    try:
        _renice(tid, nice)
    except OSError as exc:
        log.warning("--compute-nice %d: cannot renice compute thread %d: %s", nice, tid, exc)


def _renice(tid: int, nice: int) -> None:
    os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))


def lower_process_priority(nice: int) -> None:
    """Add ``nice`` to every thread of this process (a process that only computes, such
    as a prefill worker's compute process; threads it starts later inherit the value
    from their creator). Never raises."""
    if nice <= 0:
        return
    lower_thread_priority(nice)
    if not sys.platform.startswith("linux"):
        return
    me = threading.get_native_id()
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        if tid == me:
            continue
        try:
            _renice(tid, nice)
        except OSError as exc:  # a thread that ended meanwhile, or not ours to renice
            log.debug("--compute-nice %d: cannot renice thread %d: %s", nice, tid, exc)


async def abandonable(fn: Callable[..., T], *args: Any, name: str) -> T:
    """``fn(*args)``, a blocking call, on a daemon thread of its own. Cancelled, this returns
    at once and leaves the thread behind, to end with the process: a call that no signal
    interrupts (a gloo rendezvous) would otherwise hold the exit until it times out, since
    ``asyncio.run`` joins the threads of its executor (``asyncio.to_thread``)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if done.done():  # cancelled: nobody waits for it any more
            return
        if exc is None:
            done.set_result(result)
        else:
            done.set_exception(exc)

    def call() -> None:
        try:
            outcome: tuple[Any, BaseException | None] = (fn(*args), None)
        except BaseException as exc:  # noqa: BLE001 - raised where it is awaited
            outcome = (None, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop closed: the process is ending
            pass

    threading.Thread(target=call, name=name, daemon=True).start()
    return await done
