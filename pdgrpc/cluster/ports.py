"""Ports for a local cluster: free ones on 127.0.0.1, and where each metrics endpoint goes.

:class:`~pdgrpc.cluster.launcher.Cluster` picks every port here before it starts the
processes; a port is bound then released, so another program may take it before the child
binds it (the launcher then starts again on fresh ports).
"""

from __future__ import annotations

import socket

from pdgrpc.cluster.errors import ClusterError
from pdgrpc.cluster.topology import ProcessSpec

__all__ = ["HOST", "METRICS_ROLES", "free_port", "free_port_block", "metrics_children"]

HOST = "127.0.0.1"


def free_port(exclude: set[int] | None = None, tries: int = 100) -> int:
    """A port free right now and not in ``exclude`` (the ports already handed out for
    the same cluster: the kernel may return a just-released port again). Bound then
    released: another program may take it before the child binds it, which
    :meth:`Cluster.start` survives by retrying with fresh ports."""
    for _ in range(tries):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((HOST, 0))
            port = int(s.getsockname()[1])
        if exclude is None or port not in exclude:
            return port
    raise ClusterError(f"no free port on {HOST} outside the {len(exclude or ())} already taken after {tries} tries")


def free_port_block(n: int, tries: int = 100, exclude: set[int] | None = None) -> int:
    """The first of ``n`` consecutive ports that are free right now and not in
    ``exclude`` (same caveat as :func:`free_port`): a prefill derives its workers'
    metrics ports from its own."""
    for _ in range(tries):
        base = free_port(exclude)
        if base + n > 65536 or (exclude and any(p in exclude for p in range(base, base + n))):
            continue
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind((HOST, port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise ClusterError(f"no {n} consecutive free ports on {HOST} after {tries} tries")


METRICS_ROLES = ("bootstrap", "prefill", "decode", "router")  # the servers with --metrics-port


def metrics_children(spec: ProcessSpec) -> list[str]:
    """The child processes with their own metrics endpoint, in port-offset order: a
    prefill's workers (``dp<r>``, or ``dp<r>.tp<t>`` with TP) at ``1 + r * tp + t``, a
    decode's TP ranks ``tp<r>`` (r >= 1) at ``r``."""
    tp = int(str(spec.args.get("tp-size", 1)))
    if spec.role == "prefill":
        dp = int(str(spec.args.get("dp-size", 1)))
        return [f"dp{r}" if tp == 1 else f"dp{r}.tp{t}" for r in range(dp) for t in range(tp)]
    if spec.role == "decode":
        return [f"tp{r}" for r in range(1, tp)]
    return []
