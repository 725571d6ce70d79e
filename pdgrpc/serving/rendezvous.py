"""Where the TP ranks of one instance meet to form their gloo group, and how a rank joins it."""

from __future__ import annotations

import datetime
import logging
import socket

from pdgrpc.serving.threads import abandonable

__all__ = ["check_dist_init", "dist_init_method", "join_tp_group"]

log = logging.getLogger("pdgrpc.serving.rendezvous")


def check_dist_init(init_method: str, tp_size: int) -> None:
    """Raise ValueError naming ``--dist-init`` for a TP rank given nowhere to meet its
    group: refused before the rank starts, it would otherwise fail in the join."""
    if tp_size > 1 and not init_method:
        raise ValueError("--dist-init is required with --tp-size > 1")


def dist_init_method(host: str = "127.0.0.1") -> str:
    """A ``tcp://HOST:PORT`` init method on a port free right now. Rank 0 binds it a moment
    later (its TCPStore); another program taking it in between fails the group's start."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


async def join_tp_group(rank: int, size: int, init_method: str, timeout_s: float, *, who: str) -> None:
    """Join the gloo group of ``size`` ranks at ``init_method`` as ``rank`` (the process's
    default ``torch.distributed`` group), once every rank has, or fail after ``timeout_s``.
    ``who`` names the joining process in the log lines before and after the join.

    Cancelled (a SIGTERM or Ctrl-C during start-up), this returns at once and leaves the
    join to end with the process, on a thread of its own: no signal interrupts a gloo
    rendezvous, so a join on the loop's thread would hold the stop until its timeout."""
    # Said before the wait: a rank whose peers never come waits here up to timeout_s.
    log.info("%s joining the TP group at %s as rank %d of %d", who, init_method, rank, size)
    await abandonable(_join, rank, size, init_method, timeout_s, name=f"{who} TP join")
    log.info("%s joined the TP group at %s (%d ranks)", who, init_method, size)


def _join(rank: int, size: int, init_method: str, timeout_s: float) -> None:
    import torch.distributed as dist  # here: the processes that only pick a rendezvous load no torch

    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=size, timeout=datetime.timedelta(seconds=timeout_s)
    )
