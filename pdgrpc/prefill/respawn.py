"""Starting a dead prefill worker's dp rank again, so the instance heals without a person.

A dp rank is a group of ``--tp-size`` worker processes joined over gloo. A gloo group
cannot take one rank back, so when any worker of a group exits the whole group starts
again: :func:`restart_group` kills the group's survivors (their rooms already failed
with UNAVAILABLE, counted as ``peer_failure``: the controller failed the dead worker's
calls, the survivors' collectives broke), waits until the controller handled every exit,
then starts all ranks again with a fresh rendezvous and waits until each one is ready.
Each new worker registers with bootstrap (a new generation), so decodes notice the
restart. A try that fails is retried; the delay before each try doubles from
:data:`FIRST_DELAY_S` up to ``--worker-respawn-max-backoff``. Until the group serves
again, requests for its rank fail with UNAVAILABLE naming a dead worker.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Protocol, TypeVar

from pdgrpc.serving.children import Spawned
from pdgrpc.serving.rendezvous import dist_init_method

__all__ = ["FIRST_DELAY_S", "Worker", "WorkerGroups", "restart_group"]

log = logging.getLogger("pdgrpc.prefill")

FIRST_DELAY_S = 0.5
_EXIT_HANDLED_S = 10.0  # bound on waiting for the controller to handle a killed worker's exit


class _Link(Protocol):
    def close_socket(self) -> None: ...


class Worker(Protocol):
    """One worker process as the controller tracks it."""

    @property
    def proc(self) -> Spawned: ...
    @property
    def gone(self) -> asyncio.Event: ...  # set once the controller handled its exit
    @property
    def name(self) -> str: ...
    @property
    def link(self) -> _Link | None: ...


W = TypeVar("W", bound=Worker)


class WorkerGroups(Protocol[W]):
    """What :func:`restart_group` needs from the controller: its workers, dp-major and by
    group, and how to start, await and watch one."""

    ns: argparse.Namespace  # --worker-respawn-max-backoff, --worker-start-timeout
    workers: list[W]
    groups: list[list[W]]

    @property
    def stopping(self) -> bool: ...
    async def spawn(self, rank: int, tp: int, dist: list[str]) -> W: ...
    async def await_ready(self, w: W) -> None: ...
    def watch(self, workers: list[W]) -> None: ...


async def restart_group(ctl: WorkerGroups[W], rank: int) -> None:
    """Start dp rank ``rank``'s workers again (see the module doc); returns once they serve,
    or when the controller stops."""
    old = list(ctl.groups[rank])
    tp_size = len(old)
    for w in old:
        if w.proc.returncode is None:
            log.warning("prefill worker %s: stopping it, its tp group starts again as a whole (a gloo group cannot take a rank back)", w.name)
            w.proc.kill()
    for w in old:
        try:
            await asyncio.wait_for(w.gone.wait(), _EXIT_HANDLED_S)
        except asyncio.TimeoutError:
            log.error("prefill worker %s: its exit was not handled within %.0f s", w.name, _EXIT_HANDLED_S)
    delay, cap = FIRST_DELAY_S, float(ctl.ns.worker_respawn_max_backoff)
    attempt = 0
    while not ctl.stopping:
        await asyncio.sleep(delay)
        attempt += 1
        if ctl.stopping:
            return
        what = f"dp rank {rank}" + (f" ({tp_size} tp ranks)" if tp_size > 1 else "")
        log.warning("prefill %s: starting it again (attempt %d)", what, attempt)
        new: list[W] = []
        try:
            dist = ["--dist-init", dist_init_method()] if tp_size > 1 else []
            for tp in range(tp_size):
                new.append(await ctl.spawn(rank, tp, dist))
            await asyncio.wait_for(asyncio.gather(*(ctl.await_ready(w) for w in new)), ctl.ns.worker_start_timeout)
        except (Exception, asyncio.TimeoutError) as exc:
            log.error("prefill %s did not start again: %s; next try in %.1f s", what, str(exc) or type(exc).__name__, min(delay * 2, cap))
            await _discard(new)
            delay = min(delay * 2, cap)
            continue
        except BaseException:  # cancelled: the controller stops
            await _discard(new)
            raise
        if ctl.stopping:  # stop_workers already ran: these are ours to stop
            await _discard(new)
            return
        for dead, w in zip(old, new):
            ctl.workers[ctl.workers.index(dead)] = w
            log.info("prefill worker %s serves again (pid %d)", w.name, w.proc.pid)
        ctl.groups[rank] = new
        ctl.watch(new)
        return


async def _discard(workers: list[W]) -> None:
    """Kill and reap workers that never joined the instance."""
    for w in workers:
        if w.proc.returncode is None:
            w.proc.kill()
    for w in workers:
        await w.proc.wait()
        if w.link is not None:
            w.link.close_socket()
