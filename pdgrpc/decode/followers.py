"""Starting a TP decode's other ranks (``python -m pdgrpc.decode.follower``, ranks
1..N-1) as rank 0's first act, before rank 0 imports torch: the ranks then import torch
and build their engine shards while rank 0 does the same, not after it.

This module imports no torch, and neither does anything it imports. Rank 0 meets its
ranks later, in the gloo group at :attr:`Followers.init` (:mod:`pdgrpc.decode.tp`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import subprocess
import sys

from pdgrpc.metrics import derived_metrics_port
from pdgrpc.serving.children import guarded_argv
from pdgrpc.serving.engines import engine_limits_argv
from pdgrpc.serving.rendezvous import dist_init_method
from pdgrpc.serving.threads import abandonable

__all__ = ["Followers", "follower_metrics_ports", "start_followers"]


def follower_metrics_ports(ns: argparse.Namespace) -> dict[int, int | None]:
    """Each rank's ``--metrics-port`` (``--metrics-port`` + rank), by rank; a ConfigError
    naming the flag where one would pass 65535, so a decode checks it before it starts."""
    return {rank: derived_metrics_port(ns.metrics_port, rank) for rank in range(1, ns.tp_size)}


@dataclasses.dataclass
class Followers:
    """Ranks 1..N-1 of a decode instance (rank r at ``procs[r - 1]``) and the init method
    of the gloo group they wait in."""

    procs: list[subprocess.Popen[bytes]]
    init: str

    def kill(self) -> None:
        """SIGKILL every rank still running: one that rank 0 sends no "stop" to
        (rank 0 stops before it serves) would otherwise wait on its group."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()

    def discard(self) -> None:
        """Kill the ranks still running and reap them all; for a rank 0 that ends here."""
        self.kill()
        for p in self.procs:
            p.wait()

    async def first_exit(self) -> str:
        """Wait until one rank exits; returns what happened to it, for the log."""
        waits = {
            asyncio.ensure_future(abandonable(p.wait, name=f"decode-tp{rank}-wait")): rank
            for rank, p in enumerate(self.procs, start=1)
        }
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        rank = min(waits[w] for w in done)
        p = self.procs[rank - 1]
        return f"decode TP rank {rank} (pid {p.pid}) exited with code {p.returncode}"

    async def wait(self, timeout: float) -> None:
        """Give each rank ``timeout`` seconds to exit after its "stop", then kill it."""
        for rank, p in enumerate(self.procs, start=1):
            try:
                await asyncio.wait_for(abandonable(p.wait, name=f"decode-tp{rank}-wait"), timeout)
            except asyncio.TimeoutError:
                p.kill()
                await abandonable(p.wait, name=f"decode-tp{rank}-wait")


def start_followers(ns: argparse.Namespace) -> Followers:
    """Start ranks 1..``--tp-size``-1 with this process's flags (``ns.argv``), the engine
    sizes resolved here (so every rank agrees), their rank and the group's init method."""
    ports = follower_metrics_ports(ns)
    init = dist_init_method()
    followers = Followers([], init)
    try:
        for rank, port in ports.items():
            argv = [sys.executable, "-m", "pdgrpc.decode.follower", *getattr(ns, "argv", []), *engine_limits_argv(ns),
                    "--tp-rank", str(rank), "--dist-init", init]
            if port is not None:
                argv += ["--metrics-port", str(port)]
            # Guarded: a rank whose rank 0 died (SIGTERM or SIGKILL during start-up, before any
            # stop could reach it) is killed by the kernel, not left waiting for a group that is
            # gone. Started without a preexec_fn, so no fork handler (gRPC's) runs in the child.
            followers.procs.append(subprocess.Popen(guarded_argv(argv), stdin=subprocess.DEVNULL))
    except BaseException:
        followers.discard()
        raise
    return followers
