"""SGLang's bootstrap servers beside pdgrpc's, for ``bench bootstrap --peer-python PATH``.

``PATH`` is a Python that has ``sglang`` (and aiohttp, uvloop) importable; pdgrpc never
imports sglang itself. Under it run three processes (:mod:`pdgrpc.bench.sglang_peer`):
SGLang's Python bootstrap server (``CommonKVBootstrapServer``), the Rust server's
bootstrap registry (what ``SGLANG_RUST_SERVER=1`` serves), and one aiohttp client on
uvloop with a keep-alive connection to each. :class:`Peers` drives them: the bench
calls :meth:`Peers.run` between its own rounds, so that every system sees the same
machine load, and :meth:`Peers.cpu` for the CPU time per call, client and server.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import tempfile
from pathlib import Path
from typing import IO, Any

from pdgrpc.bench.procstat import cpu_ns

PEER_SCRIPT = Path(__file__).with_name("sglang_peer.py")
SYSTEMS = ("SGLang Python", "SGLang Rust")
_KIND = {"SGLang Python": "python", "SGLang Rust": "rust"}
# The bench's case names -> the peer client's.
CASES = {
    "ping (health Check)": "ping",
    "register 1 room": "register 1 room",
    "query 1 room": "query 1 room",
    "query 32 rooms": "query 32 rooms",
    "query 1024 rooms": "query 1024 rooms",
}


class PeerError(RuntimeError):
    """The peer Python cannot run SGLang's servers (message says why and what to do)."""


def check_peer_python(path: str) -> str:
    """The sglang version under ``path``; :class:`PeerError` if it cannot run the peers."""
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        raise PeerError(f"--peer-python {path}: not an executable file")
    probe = "import sglang, aiohttp, uvloop; print(sglang.__version__)"
    try:
        out = subprocess.run([path, "-c", probe], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PeerError(f"--peer-python {path}: cannot run it: {exc}") from exc
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise PeerError(
            f"--peer-python {path}: it cannot import sglang, aiohttp and uvloop ({last}). Give a Python "
            "with them installed, e.g. a venv with `pip install sglang==0.5.23 --no-deps` plus the "
            "packages its disaggregation module imports (see docs/performance.md)"
        )
    return out.stdout.strip()


class _PeerServer:
    def __init__(self, python: str, kind: str, log: IO[str]) -> None:
        self.proc = subprocess.Popen(
            [python, str(PEER_SCRIPT), "serve", kind], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # "ready PORT", or "" if it died
        if not line.startswith("ready "):
            self.proc.kill()
            log.flush()
            raise PeerError(f"SGLang {kind} bootstrap server did not start: {_tail(log)}")
        self.port = int(line.split()[1])

    def cpu_ns(self) -> int:
        return cpu_ns(self.proc.pid)

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()  # the server's cue to exit
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _tail(log: IO[str]) -> str:
    try:
        return Path(log.name).read_text()[-2000:]
    except OSError:
        return "(no log)"


class Peers:
    """SGLang's two bootstrap servers and the aiohttp client, started and set up."""

    def __init__(self, python: str, *, fresh_rooms: int, seed: int = 3) -> None:
        self.version = check_peer_python(python)
        self._log = tempfile.NamedTemporaryFile("w+", prefix="pdgrpc-bench-sglang-", suffix=".log", delete=False)
        self.servers: dict[str, _PeerServer] = {}
        try:
            for system in SYSTEMS:
                self.servers[system] = _PeerServer(python, _KIND[system], self._log)
            self.client = subprocess.Popen(
                [python, str(PEER_SCRIPT), "client"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True
            )
            rng = random.Random(seed)
            known = [rng.getrandbits(63) | 1 for _ in range(4096)]
            fresh = [rng.getrandbits(63) | 1 for _ in range(fresh_rooms)]
            for server in self.servers.values():
                self._ask({
                    "op": "setup", "port": server.port, "known": known, "fresh": fresh, "dp_size": 8,
                    "sets32": [rng.sample(known, 32) for _ in range(16)], "sets1024": [rng.sample(known, 1024) for _ in range(16)],
                })
        except BaseException:
            self.close()
            raise
        self._offset = 0

    def _send(self, msg: object) -> None:
        assert self.client.stdin is not None
        self.client.stdin.write(json.dumps(msg) + "\n")
        self.client.stdin.flush()

    def _recv(self) -> dict[str, Any]:
        assert self.client.stdout is not None
        line = self.client.stdout.readline()
        if not line:
            self._log.flush()
            raise PeerError(f"the SGLang aiohttp client exited: {_tail(self._log)}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def _ask(self, msg: object) -> dict[str, Any]:
        self._send(msg)
        return self._recv()

    def run(self, system: str, n: int, warmup: int) -> dict[str, list[float]]:
        """Latency samples (s) by bench case name: ``n`` rounds of every case."""
        reply = self._ask({"op": "run", "port": self.servers[system].port, "n": n, "warmup": warmup, "offset": self._offset})
        self._offset += n + warmup
        return {case: reply["samples"][peer] for case, peer in CASES.items()}

    def cpu(self, system: str, n: int) -> dict[str, tuple[float, float]]:
        """CPU time per call (µs), (client, server), by bench case name."""
        server = self.servers[system]
        self._send({"op": "cpu", "port": server.port, "n": n, "offset": self._offset})
        self._offset += n
        server_us: dict[str, float] = {}
        s0 = server.cpu_ns()
        for _ in CASES:
            done = self._recv()["case_done"]
            s1 = server.cpu_ns()
            server_us[done] = (s1 - s0) / n / 1e3
            self._send("next")
            s0 = server.cpu_ns()
        client_s = self._recv()["cpu"]
        return {case: (client_s[peer] / n * 1e6, server_us[peer]) for case, peer in CASES.items()}

    def close(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            if client.stdin is not None:
                client.stdin.close()
            try:
                client.wait(timeout=10)
            except subprocess.TimeoutExpired:
                client.kill()
                client.wait()
        for server in self.servers.values():
            server.stop()
        self._log.close()
        os.unlink(self._log.name)


def rounds_order(systems: list[str], r: int) -> list[str]:
    """The systems in round ``r``: rotated, so that no system always goes first."""
    k = r % len(systems)
    return systems[k:] + systems[:k]


__all__ = ["CASES", "PeerError", "Peers", "SYSTEMS", "check_peer_python", "rounds_order"]
