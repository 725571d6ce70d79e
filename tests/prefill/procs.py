"""Starting ``python -m pdgrpc.prefill`` (and a bootstrap) as real processes for tests.

Every wait is bounded; :meth:`PrefillProc.stop` sends SIGTERM and kills whatever is left
(the controller *and* its workers), so no process outlives a test module.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

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


class Proc:
    def __init__(self, argv: list[str], log_dir: Path, name: str) -> None:
        self.out_path = log_dir / f"{name}.out"
        self.log_path = log_dir / f"{name}.log"
        with open(self.out_path, "wb") as out, open(self.log_path, "wb") as err:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"}
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, pattern: str, source: str = "out") -> re.Match[str]:
        path = self.out_path if source == "out" else self.log_path
        def printed() -> re.Match[str] | bool | None:
            # an exited process prints nothing more: stop waiting for it
            return re.search(pattern, path.read_text(errors="replace")) or self.proc.poll() is not None

        try:
            m = eventually(printed, STARTUP_S, interval=0.05)
        except AssertionError:
            m = None
        if not isinstance(m, re.Match):
            raise RuntimeError(f"process did not print {pattern!r} (exit {self.proc.poll()}):\n{self.log()[-4000:]}")
        return m

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)


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

    def stop(self, timeout: float = 20.0) -> int:
        code = super().stop(timeout)
        for pid in getattr(self, "worker_pids", []):
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        return code


class BootstrapProc(Proc):
    def __init__(self, log_dir: Path) -> None:
        super().__init__([sys.executable, "-m", "pdgrpc.bootstrap", "--host", "127.0.0.1", "--port", "0"], log_dir, "bootstrap")
        try:
            self.address = self.wait_for(r"listening on (\S+:\d+)", source="log").group(1)
        except BaseException:
            self.stop()
            raise
