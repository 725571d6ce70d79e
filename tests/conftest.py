"""Shared test configuration."""

from __future__ import annotations

import os

# Keep UCX on loopback-friendly transports and quiet in tests; real hosts override this.
os.environ.setdefault("UCX_TLS", "tcp,sm,self")
os.environ.setdefault("UCX_LOG_LEVEL", "error")
# Tests spawn servers (fork + exec) from a process that uses gRPC; with gRPC's fork
# handlers on, a forked child can abort before exec (see pdgrpc/cluster/launcher.py).
# Set before anything imports grpc.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
