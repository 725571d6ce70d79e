"""Process-wide gRPC settings that pdgrpc's entry points apply before importing grpc.

gRPC reads ``GRPC_EXPERIMENTS`` once, when ``grpc`` is imported. Since grpcio 1.6x,
sockets are served by EventEngine threads, and every unary call hops between the
EventEngine thread, the completion-queue poller and the event loop. On a 2-core
machine those hops are most of a loopback round trip, so the EventEngine client and
listener are turned off: the poller then does the socket work itself, as gRPC did for
years (``python -m pdgrpc.bench bootstrap`` shows the round trip with and without).

:func:`apply_grpc_defaults` sets it unless the user already set ``GRPC_EXPERIMENTS``
(any value, even empty, wins) or ``PDGRPC_GRPC_DEFAULTS=0``. It only helps when called
before anything imports ``grpc``; libraries embedding pdgrpc clients are never changed
behind their back — only ``python -m pdgrpc.*`` entry points call it.
"""

from __future__ import annotations

import os
import sys

GRPC_EXPERIMENTS = "-event_engine_client,-event_engine_listener"


def grpc_tuning_in_force() -> bool:
    """Whether this process runs (or, if grpc is not imported yet, will run) gRPC with
    pdgrpc's ``GRPC_EXPERIMENTS``."""
    return os.environ.get("GRPC_EXPERIMENTS") == GRPC_EXPERIMENTS


def grpc_tuning_wanted() -> bool:
    """Whether :func:`apply_grpc_defaults` would set ``GRPC_EXPERIMENTS`` (the user set
    neither it nor ``PDGRPC_GRPC_DEFAULTS=0``)."""
    return os.environ.get("PDGRPC_GRPC_DEFAULTS", "1") != "0" and "GRPC_EXPERIMENTS" not in os.environ


def apply_grpc_defaults() -> bool:
    """Set pdgrpc's ``GRPC_EXPERIMENTS`` for this process (and its children) if the
    user has not. Returns whether the setting is in force for this process."""
    if os.environ.get("PDGRPC_GRPC_DEFAULTS", "1") == "0":
        return False
    if grpc_tuning_wanted():
        if "grpc" in sys.modules:
            return False  # too late: grpc has read its configuration
        os.environ["GRPC_EXPERIMENTS"] = GRPC_EXPERIMENTS
    return grpc_tuning_in_force()
