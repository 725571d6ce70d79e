"""How every pdgrpc server process starts: :func:`launch`.

A role's entry point (``python -m pdgrpc.router``, a console script) is a ``main`` that
calls :func:`launch` with the name of the module holding the role's :class:`Role`.
:func:`launch` sets the process environment first, because gRPC reads it once, when it is
imported; only then does it import the role, parse its flags, and install security,
logging and tracing. An entry point therefore imports nothing that loads grpc or torch itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import importlib
import logging
import os
import signal
import sys
from typing import Any, Callable

from pdgrpc.rpc.tuning import apply_grpc_defaults

__all__ = ["Role", "launch", "prepare_environment"]


def _accept(ns: argparse.Namespace) -> None:
    pass


@dataclasses.dataclass(frozen=True)
class Role:
    """What :func:`launch` needs of a server role; its module names it ``ROLE``."""

    build_parser: Callable[[], argparse.ArgumentParser]
    # Runs the process once everything is installed; returns the exit status. An OSError
    # it raises (a port another process holds) ends the process with status 1 (launch).
    serve: Callable[[argparse.Namespace], int]
    # The tag every log line of the process carries (``router``, ``prefill.dp0``).
    log_name: Callable[[argparse.Namespace], str]
    # Flag checks beyond argparse's: a ValueError or PdgrpcError ends the program with
    # exit status 2 and the message, before anything starts.
    check: Callable[[argparse.Namespace], None] = _accept


def prepare_environment() -> None:
    """Set the environment every pdgrpc process runs with; effective only before grpc is
    imported, and inherited by the processes this one starts."""
    # pdgrpc processes start children only by fork+exec: gRPC's fork handlers have
    # nothing to do there, and in a child forked with a preexec_fn they restart gRPC's
    # poller thread, which dies (SIGABRT) once the child closes its inherited fds.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    apply_grpc_defaults()


# The exit status of a process that Ctrl-C (SIGINT) ended: 128 + the signal, the shell's convention.
_INTERRUPTED = 128 + signal.SIGINT
# The exit status of a role the host refused something it needs (a port, a file): argparse's
# 2 says the command line is wrong, and this one is right where the port is free.
_FAILED = 1


class _SigtermStopsStartup:
    """SIGTERM handled as Ctrl-C until the role's own stop handling (``StopSignal``) takes
    it over: SIGINT's handler, called here, makes asyncio cancel the role's main task, whose
    cleanup releases what it started, or raises KeyboardInterrupt where no loop runs yet. The
    launcher stops and restarts processes with SIGTERM, whether or not they serve yet."""

    def __init__(self) -> None:
        self.received = False
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # One stop at a time: a second SIGTERM while the first stops the process is ignored.
        if self.received:
            return
        self.received = True
        # SIGINT's handler is called, not the signal raised: a script's background job
        # starts with SIGINT ignored, and a raised SIGINT would then be dropped.
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler):  # asyncio's (cancels the main task) or Python's (KeyboardInterrupt)
            handler(signal.SIGINT, frame)
        else:
            signal.default_int_handler(signal.SIGINT, frame)

    def close(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)


def _report_native_crashes() -> None:
    """A crash in native code (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL) prints every
    thread's Python stack to stderr, which the launcher keeps in the role's log: the
    signal alone does not say where it happened. A handler already installed (by
    ``PYTHONFAULTHANDLER``, or a test runner) stays."""
    if faulthandler.is_enabled():
        return
    stream = sys.stderr
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):  # stderr replaced by an object with no file
        stream = sys.__stderr__
    if stream is not None:
        faulthandler.enable(stream)


def launch(module: str, argv: list[str] | None = None) -> int:
    """Run the role that ``module`` holds as this process, with command line ``argv``
    (default ``sys.argv[1:]``); returns the exit status. A Ctrl-C or SIGTERM that comes
    before the role's own handling, which drains, is in place stops the start-up, with one
    line: status 130 for Ctrl-C, 0 for SIGTERM (a stop that was asked for, as after a drain).
    A flag the role's checks refuse ends it with status 2, argparse's; an OSError from the
    role (a port another process holds) with status 1 and one line."""
    prepare_environment()
    _report_native_crashes()
    sigterm = _SigtermStopsStartup()
    try:
        return _launch(module, argv)
    except KeyboardInterrupt:
        # The start-up was cut short (importing torch, building the engine): asyncio has
        # cancelled the role's start-up, whose cleanup ran; the stop was asked for, so one
        # line says so instead of a traceback through the start-up code.
        name = module.rsplit(".", 1)[0]
        if sigterm.received:
            print(f"{name}: stopped by SIGTERM while starting", file=sys.stderr, flush=True)
            return 0
        print(f"{name}: stopped by Ctrl-C (SIGINT)", file=sys.stderr, flush=True)
        return _INTERRUPTED
    finally:
        sigterm.close()


def _launch(module: str, argv: list[str] | None) -> int:
    # Imported here, after the environment is set: these modules load grpc (and the
    # role perhaps torch), which read their settings once.
    role = importlib.import_module(module).ROLE
    if not isinstance(role, Role):
        raise TypeError(f"{module}.ROLE is not a pdgrpc.serving.launch.Role")
    from pdgrpc.errors import PdgrpcError
    from pdgrpc.rpc.local import configure
    from pdgrpc.rpc.security import install, security_from_args
    from pdgrpc.rpc.tracing import setup_tracing
    from pdgrpc.serving.logs import setup_logging

    args = list(sys.argv[1:] if argv is None else argv)
    parser = role.build_parser()
    # Flags are taken whole: an abbreviation would make a flag the role does not take
    # (a decode's --bootstrap) another one it does (--bootstrap-timeout), with its value.
    parser.allow_abbrev = False
    ns = parser.parse_args(args)
    ns.argv = args  # as given: a role that starts copies of itself passes them on
    try:
        role.check(ns)
        install(security_from_args(ns))
        configure(getattr(ns, "local_socket", None))  # the role took --local-socket (pdgrpc.rpc.local)
    except (PdgrpcError, ValueError) as exc:
        parser.error(str(exc))
    setup_logging(ns.log_level, role.log_name(ns))
    if hasattr(ns, "trace"):  # the role took --trace (pdgrpc.rpc.tracing)
        setup_tracing(ns.trace, role.log_name(ns))
    try:
        return role.serve(ns)
    except OSError as exc:  # its message names the setting and the reason (pdgrpc.rpc.server's bind)
        log = logging.getLogger(module.rsplit(".", 1)[0])
        log.error("%s", exc)
        log.debug("where the OSError came from", exc_info=True)  # --log-level debug: the traceback too
        return _FAILED
