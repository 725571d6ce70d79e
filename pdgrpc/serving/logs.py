"""Logging for the servers: one line per request event.

Every line about a request starts with ``room=<bootstrap_room>`` so ``grep room=123``
over all servers' logs tells that request's story (admitted, dispatched, handshake,
transferred, failed and why). :func:`request_event` is the only way servers log request
events, which keeps that format uniform.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
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


class _OneLine(logging.Formatter):
    """A message is one line: a character that is not printable (a line break, a
    terminal escape) is written escaped, so no text a caller chose starts a line of its
    own. A traceback, appended after the message, keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        if not record.message.isprintable():
            record.message = "".join(c if c.isprintable() else repr(c)[1:-1] for c in record.message)
        return super().formatMessage(record)


def setup_logging(level: str = "info", name: str = "") -> None:
    """Configure the root logger once for a server process. ``name`` (e.g. ``prefill.w0``)
    goes into every line so interleaved logs of a cluster stay readable."""
    tag = name or os.path.basename(sys.argv[0])
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_OneLine(f"%(asctime)s %(levelname)s [{tag} pid=%(process)d] %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler], force=True)
    # grpc's own chatter is rarely about our requests.
    logging.getLogger("grpc").setLevel(max(logging.WARNING, logging.getLogger().level))


def _fmt(v: Any) -> str:
    s = str(v)
    # Quoted when it would not read as one value: a space, nothing, or a character that
    # is not printable (a line break in a caller's request_id would start a forged line).
    return repr(s) if (" " in s or not s or not s.isprintable()) else s


# Lines deferred by request_event(defer=True), oldest first: written on the loop's next
# turn, or before any line logged sooner, so a process's lines keep their order.
_deferred: collections.deque[tuple[logging.Logger, int, str, int, dict[str, Any]]] = collections.deque()
_flush_on: asyncio.AbstractEventLoop | None = None  # the loop a _write_deferred is queued on


def _write_deferred() -> None:
    global _flush_on
    _flush_on = None
    while _deferred:
        logger, room, what, level, fields = _deferred.popleft()
        _write(logger, room, what, level, fields)


def _write(logger: logging.Logger, room: int, what: str, level: int, fields: dict[str, Any]) -> None:
    extra = " ".join(f"{k}={_fmt(v)}" for k, v in fields.items())
    logger.log(level, "room=%d %s%s", room, what, (" " + extra) if extra else "")


def request_event(logger: logging.Logger, room: int, what: str, *, level: int = logging.INFO, defer: bool = False, **fields: Any) -> None:
    """Log ``room=<room> <what> key=value ...`` at ``level`` (INFO by default).

    ``defer``: write the line on the running loop's next turn, after the callbacks already
    queued -- for a line logged just after the caller started latency-critical work that
    runs on the loop (a call whose send is queued, a stream woken with its first token):
    right after a compute a line's Python runs with cold caches, and the request should
    not wait for it. A line logged without ``defer`` first writes the deferred ones, so the order
    of a process's lines never changes.
    """
    if not logger.isEnabledFor(level):
        return
    if defer:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop in this thread: nothing to let go first
            loop = None
        if loop is not None:
            global _flush_on
            if _flush_on is not loop:  # (a loop that closed with lines queued never wrote them)
                _flush_on = loop
                loop.call_soon(_write_deferred)
            _deferred.append((logger, room, what, level, fields))
            return
    if _deferred:
        _write_deferred()
    _write(logger, room, what, level, fields)
