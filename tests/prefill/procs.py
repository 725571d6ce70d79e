"""Starting servers (``python -m pdgrpc.prefill``, ``.decode``, ``.bootstrap``, or any
command) as real processes for tests.

Every wait is bounded; :meth:`Proc.stop` sends SIGTERM and kills whatever is left
(:meth:`PrefillProc.stop` the controller *and* its workers), so no process outlives a test.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Self

from tests.eventually import eventually

STARTUP_S = 90.0

ENGINE_FLAGS = [
    "--model-size", "tiny", "--page-size", "4", "--num-pages", "64",
    "--max-prompt-tokens", "64", "--max-seq-len", "128",
]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); a reaped or zombie worker is not running.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (read from /proc; Linux)."""
    kids = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            if f"\nPPid:\t{pid}\n" in status.read_text():
                kids.append(int(status.parent.name))
        except OSError:
            pass  # a process that ended meanwhile
    return kids


def session_pids(sid: int) -> list[int]:
    """The running processes of session ``sid`` (read from /proc; Linux)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, _pgrp, session = stat.read_text().rsplit(")", 1)[1].split()[:4]
        except (OSError, ValueError):
            continue  # a process that ended meanwhile
        if int(session) == sid and state != "Z":
            pids.append(int(stat.parent.name))
    return pids


def accepts(init: str) -> bool:
    """Whether something accepts connections at ``init`` (``tcp://HOST:PORT``): rank 0 of
    a TP group hosts the group's store there once it is inside its join."""
    host, port = init.removeprefix("tcp://").rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except OSError:
        return False
    return True


class Proc:
    """``argv`` as a process: its stdout in ``NAME.out``, its stderr in ``NAME.log`` (under
    ``log_dir``). ``env`` adds to the environment. ``new_session`` gives it a process group
    of its own, which :meth:`stop` kills whole (what it started goes with it)."""

    def __init__(
        self, argv: list[str], log_dir: Path, name: str, *, env: Mapping[str, str] | None = None, cwd: Path | None = None,
        preexec_fn: Callable[[], None] | None = None, new_session: bool = False,
    ) -> None:
        self.out_path = log_dir / f"{name}.out"
        self.log_path = log_dir / f"{name}.log"
        self.new_session = new_session
        with open(self.out_path, "wb") as out, open(self.log_path, "wb") as err:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=cwd, preexec_fn=preexec_fn,
                start_new_session=new_session, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def out(self) -> str:
        return self.out_path.read_text(errors="replace")

    def tail(self, chars: int = 4000) -> str:
        """The last ``chars`` of its stdout and of its stderr, for a failure's message."""
        return f"stdout:\n{self.out()[-chars:]}\nstderr:\n{self.log()[-chars:]}"

    def wait_for(self, pattern: str, source: str = "out", timeout: float = STARTUP_S) -> re.Match[str]:
        path = self.out_path if source == "out" else self.log_path
        def printed() -> re.Match[str] | bool | None:
            # an exited process prints nothing more: stop waiting for it
            return re.search(pattern, path.read_text(errors="replace")) or self.proc.poll() is not None

        try:
            m = eventually(printed, timeout, interval=0.05)
        except AssertionError:
            m = None
        if not isinstance(m, re.Match):
            raise RuntimeError(f"process did not print {pattern!r} (exit {self.proc.poll()}):\n{self.tail()}")
        return m

    def stop(self, timeout: float = 20.0, signum: int = signal.SIGTERM) -> int:
        """Send ``signum`` (when it still runs), wait up to ``timeout``, then SIGKILL."""
        if self.proc.poll() is None:
            self.proc.send_signal(signum)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)
        finally:
            if self.new_session:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ServerProc(Proc):
    """A server process, waited for until its log says ``pattern`` (what it listens on:
    :attr:`address`); stopped again when it does not get there."""

    def __init__(self, argv: list[str], log_dir: Path, name: str, *, pattern: str = r"listening on (\S+:\d+)", **kw: Any) -> None:
        super().__init__(argv, log_dir, name, **kw)
        try:
            self.address: str = self.wait_for(pattern, source="log").group(1)
        except BaseException:
            self.stop()
            raise


class PrefillProc(Proc):
    def __init__(self, flags: list[str], log_dir: Path, name: str = "prefill") -> None:
        super().__init__([sys.executable, "-m", "pdgrpc.prefill", "--host", "127.0.0.1", "--port", "0", *flags], log_dir, name)
        try:
            info = json.loads(self.wait_for(r"PDGRPC_READY (\{.*\})").group(1))
        except BaseException:
            self.stop()
            raise
        self.address: str = info["address"]
        self.bootstrap: str = info["bootstrap"]
        from tests.prefill.fake_decode import KNOWN_BOOTSTRAPS

        KNOWN_BOOTSTRAPS.append(self.bootstrap)
        self.worker_addresses: list[str] = info["workers"]
        self.worker_pids: list[int] = info["worker_pids"]

    def stop(self, timeout: float = 20.0, signum: int = signal.SIGTERM) -> int:
        code = super().stop(timeout, signum)
        for pid in getattr(self, "worker_pids", []):
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        return code


class BootstrapProc(ServerProc):
    """``python -m pdgrpc.bootstrap`` on 127.0.0.1 with ``flags``."""

    def __init__(self, log_dir: Path, *flags: str, name: str = "bootstrap", **kw: Any) -> None:
        argv = [sys.executable, "-m", "pdgrpc.bootstrap", "--host", "127.0.0.1", "--port", "0", *flags]
        super().__init__(argv, log_dir, name, **kw)


class DecodeProc(ServerProc):
    """``python -m pdgrpc.decode`` on 127.0.0.1 with ``flags``."""

    def __init__(self, flags: list[str], log_dir: Path, name: str = "decode") -> None:
        argv = [sys.executable, "-m", "pdgrpc.decode", "--host", "127.0.0.1", "--port", "0", *flags]
        super().__init__(argv, log_dir, name, pattern=r"pdgrpc decode listening on (\S+:\d+)")
