"""Shared test configuration."""

from __future__ import annotations

import os

# Keep UCX on loopback-friendly transports and quiet in tests; real hosts override this.
os.environ.setdefault("UCX_TLS", "tcp,sm,self")
os.environ.setdefault("UCX_LOG_LEVEL", "error")
