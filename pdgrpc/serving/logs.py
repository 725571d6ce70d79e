"""Logging for the servers: one line per request event.

Every line about a request starts with ``room=<bootstrap_room>`` so ``grep room=123``
over all servers' logs tells that request's story (admitted, dispatched, handshake,
transferred, failed and why). :func:`request_event` is the only way servers log request
events, which keeps that format uniform.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

__all__ = ["add_logging_arguments", "request_event", "setup_logging"]


def add_logging_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--log-level``."""
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log verbosity; 'info' logs one line per request event (room, what happened). Default: %(default)s",
    )


def setup_logging(level: str = "info", name: str = "") -> None:
    """Configure the root logger once for a server process. ``name`` (e.g. ``prefill.w0``)
    goes into every line so interleaved logs of a cluster stay readable."""
    tag = name or os.path.basename(sys.argv[0])
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format=f"%(asctime)s %(levelname)s [{tag} pid=%(process)d] %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    # grpc's own chatter is rarely about our requests.
    logging.getLogger("grpc").setLevel(max(logging.WARNING, logging.getLogger().level))


def _fmt(v: Any) -> str:
    s = str(v)
    return repr(s) if (" " in s or not s) else s


def request_event(logger: logging.Logger, room: int, what: str, *, level: int = logging.INFO, **fields: Any) -> None:
    """Log ``room=<room> <what> key=value ...`` at ``level`` (INFO by default)."""
    if not logger.isEnabledFor(level):
        return
    extra = " ".join(f"{k}={_fmt(v)}" for k, v in fields.items())
    logger.log(level, "room=%d %s%s", room, what, (" " + extra) if extra else "")
