"""The prefill worker's role (:func:`pdgrpc.serving.launch.launch`): its flags, where it
computes, and the order it starts in.

A worker that computes in a process of its own (``--compute-in process``) starts that
process first, then loads the modules that import torch (:mod:`pdgrpc.prefill.worker_server`):
the child loads torch and builds its engine meanwhile, instead of after the worker. So this
module, and what it imports, imports no torch.
"""

from __future__ import annotations

import argparse
import logging
import os

from pdgrpc.argtypes import check_rank, rank_count
from pdgrpc.metrics import add_metrics_arguments
from pdgrpc.prefill.cli import add_worker_arguments
from pdgrpc.prefill.compute_child import spawn
from pdgrpc.prefill.dispatch import METHODS
from pdgrpc.prefill.worker_config import worker_name
from pdgrpc.rpc.security import add_security_arguments
from pdgrpc.serving.engines import uses_checkpoint
from pdgrpc.serving.launch import Role
from pdgrpc.serving.rendezvous import check_dist_init

__all__ = ["ROLE", "build_parser", "check", "compute_in", "serve"]

log = logging.getLogger("pdgrpc.prefill.worker")

_DESCRIPTION = (
    "One prefill worker process, started by its DP controller (not run by hand): it serves the controller's "
    "Prefill calls and decodes' handshakes, writes each prompt's KV into its decode's memory, and registers "
    "with bootstrap."
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdgrpc.prefill.worker_main", description=_DESCRIPTION)
    p.add_argument("--dp-rank", type=int, required=True, help="this worker's dp rank")
    p.add_argument("--dp-size", type=rank_count, required=True, help="dp ranks of the instance")
    p.add_argument("--tp-rank", type=int, default=0, help="this worker's tp rank in its dp group")
    p.add_argument("--tp-size", type=rank_count, default=1, help="tp ranks per dp group")
    p.add_argument(
        "--dist-init", default="",
        help="torch.distributed init_method of this dp group (tcp://HOST:PORT); required with --tp-size > 1",
    )
    p.add_argument("--bootstrap", required=True, help="HOST:PORT of the BootstrapService to register with")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on")
    p.add_argument(
        "--advertise-host", default="",
        help="host part of the HandshakeService address registered with bootstrap (decodes on other hosts dial it); "
        "default: --host (127.0.0.1 when --host is a wildcard)",
    )
    p.add_argument("--load-balance-method", choices=METHODS, required=True)
    p.add_argument("--force-dp-rank-query", action="store_true")
    p.add_argument(
        "--link-fd", type=int, default=None,
        help="inherited Unix socket on which the controller sends Prefill calls (set by the controller; "
        "without it the worker is reached over gRPC only)",
    )
    add_worker_arguments(p)
    # Not in add_worker_arguments: each worker gets its own port from the controller
    # (derived_metrics_port), not the controller's flag passed through.
    add_metrics_arguments(p)
    add_security_arguments(p)
    return p


def check(ns: argparse.Namespace) -> None:
    """Refuse a rank outside its group before anything starts: taken, it fails later, in
    the worker's config or its registration with bootstrap, or waits on a TP group that
    never forms."""
    check_rank(ns.dp_rank, ns.dp_size, "--dp-rank", "--dp-size")
    check_rank(ns.tp_rank, ns.tp_size, "--tp-rank", "--tp-size")
    check_dist_init(ns.dist_init, ns.tp_size)


def compute_in(ns: argparse.Namespace) -> str:
    """Where this worker computes: ``--compute-in``, unless that cannot be had here
    (said in the log)."""
    if ns.compute_in != "process":
        return "thread"
    if uses_checkpoint(ns):
        log.info("%s: --compute-in process: a --model engine computes on a thread (in a compute process its "
                 "prompts computed slower: docs/performance.md)", worker_name(ns))
        return "thread"
    if getattr(ns, "device", "cpu") != "cpu":
        log.info("%s: --compute-in process: a --device %s pool is not shared memory; computing on a thread", worker_name(ns), ns.device)
        return "thread"
    if ns.tp_size > 1:
        log.info("%s: --compute-in process: a TP rank computes on a thread (its gloo group lives in the worker)", worker_name(ns))
        return "thread"
    if not hasattr(os, "memfd_create"):
        log.info("%s: --compute-in process needs memfd_create (Linux); computing on a thread", worker_name(ns))
        return "thread"
    return "process"


def serve(ns: argparse.Namespace) -> int:
    # Read first: a controller that dies while this starts leaves this process to another
    # parent, and the worker must still know whose exit it watches.
    controller = os.getppid()
    child = spawn(f"prefill {worker_name(ns)}") if compute_in(ns) == "process" else None
    try:
        # Loads torch, as the child does at the same time.
        from pdgrpc.prefill.worker_server import serve as serve_worker
    except BaseException:
        if child is not None:
            child.discard()
        raise
    return serve_worker(ns, child, controller)


ROLE = Role(build_parser=build_parser, serve=serve, log_name=lambda ns: f"prefill.{worker_name(ns)}", check=check)
