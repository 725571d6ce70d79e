"""The decode server's role (``python -m pdgrpc.decode``, :func:`pdgrpc.serving.launch.launch`):
its flags (:mod:`pdgrpc.decode.cli`), their checks, and the order it starts in.

``--help`` and a flag error need no engine, so this module, and what it imports, imports
no torch. A TP decode starts its other ranks first (:mod:`pdgrpc.decode.followers`), then
loads the modules that import torch (:mod:`pdgrpc.decode.leader_server`): every rank
loads torch and builds its engine at the same time, not one after the other.
"""

from __future__ import annotations

import argparse

from pdgrpc.decode.cli import build_parser
from pdgrpc.decode.followers import follower_metrics_ports, start_followers
from pdgrpc.discovery.cli import check_discovery_args
from pdgrpc.serving.engines import check_engine_args
from pdgrpc.serving.launch import Role
from pdgrpc.transport import registry

__all__ = ["ROLE", "check", "serve"]


def check(ns: argparse.Namespace) -> None:
    """Flag values no decode can start with, refused before any rank starts."""
    check_engine_args(ns, tp_size=ns.tp_size)
    registry.check(ns.transport)  # a missing backend names what to install
    follower_metrics_ports(ns)
    check_discovery_args(ns)


def serve(ns: argparse.Namespace) -> int:
    followers = start_followers(ns) if ns.tp_size > 1 else None
    try:
        # Loads torch, as the other ranks do at the same time.
        from pdgrpc.decode.leader_server import serve as serve_leader

        return serve_leader(ns, followers)
    finally:
        # However rank 0 ends, no other rank outlives it.
        if followers is not None:
            followers.discard()


ROLE = Role(build_parser=build_parser, serve=serve, log_name=lambda ns: "decode", check=check)
