"""``python -m pdgrpc.prefill``: the prefill DP controller and its workers (see ``--help``)."""

from __future__ import annotations

import os
import logging
import sys

# The controller only fork+execs its workers; gRPC's fork handlers have nothing to do and
# would log "skipping fork() handlers" for every worker. Must be set before grpc loads.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from pdgrpc.rpc.tuning import apply_grpc_defaults  # noqa: E402

# Before grpc is imported (below); the setting is in the environment, so the workers this
# controller starts inherit it too.
apply_grpc_defaults()

from pdgrpc.discovery.cli import check_discovery_args
from pdgrpc.errors import ConfigError, TransportUnavailable
from pdgrpc.prefill.cli import build_parser
from pdgrpc.rpc.security import install, security_from_args
from pdgrpc.rpc.server import run
from pdgrpc.rpc.tracing import setup_tracing
from pdgrpc.serving import setup_logging
from pdgrpc.serving.engines import check_engine_args
from pdgrpc.transport import registry


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.dp_size < 1:
        parser.error(f"--dp-size must be >= 1, got {ns.dp_size}")
    if ns.chunk_size < 1:
        parser.error(f"--chunk-size must be >= 1, got {ns.chunk_size}")
    if ns.tp_size < 1:
        parser.error(f"--tp-size must be >= 1, got {ns.tp_size}")
    try:
        check_engine_args(ns, tp_size=ns.tp_size)  # fail here, not in every worker
        registry.load(ns.transport)  # a missing backend names what to install
        check_discovery_args(ns)
        install(security_from_args(ns))
    except (ConfigError, TransportUnavailable) as exc:
        parser.error(str(exc))
    setup_logging(ns.log_level, "prefill")
    setup_tracing(ns.trace, "prefill")
    from pdgrpc.prefill.controller_main import main_async  # after logging: imports torch

    try:
        return run(main_async(ns))
    except ConfigError as exc:  # e.g. a non-loopback --host with neither TLS nor a token
        logging.getLogger("pdgrpc.prefill").error("%s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
