"""Run a real single-member ``etcd`` (the Debian package ``etcd-server``) for tests, the
launcher's ``etcd`` role and the bench: a temporary data dir, given ports, stop and
restart on the same data (leases survive a restart, as in production).

::

    with EtcdProcess.start_on("127.0.0.1") as etcd:
        ... --discovery etcd.url ...
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Sequence

from pdgrpc.errors import ConfigError, PdgrpcError

__all__ = ["ETCD_PACKAGE_HINT", "EtcdProcess", "etcd_argv", "etcd_healthy", "find_etcd"]

ETCD_PACKAGE_HINT = "install the Debian package etcd-server (scripts/setup.sh does so when run as root)"


def find_etcd() -> str | None:
    """Path of the ``etcd`` binary, or None."""
    return shutil.which("etcd") or next((p for p in ("/usr/bin/etcd", "/usr/local/bin/etcd") if os.access(p, os.X_OK)), None)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EtcdProcess:
    """One etcd member on ``host``; ``prefix`` runs it elsewhere (``ip netns exec h1``)."""

    def __init__(self, host: str, client_port: int, peer_port: int, data_dir: Path | None = None,
                 prefix: Sequence[str] = (), log_path: Path | None = None) -> None:
        binary = find_etcd()
        if binary is None:
            raise ConfigError(f"etcd not found on PATH: {ETCD_PACKAGE_HINT}")
        self.binary = binary
        self.host = host
        self.client_port = client_port
        self.peer_port = peer_port
        self._own_dir = data_dir is None
        self._failed = False  # a start that did not come up keeps the log its error names
        self.data_dir = data_dir or Path(tempfile.mkdtemp(prefix="pdgrpc-etcd-"))
        self.prefix = list(prefix)
        self._own_log = log_path is None
        self.log_path = log_path or self.data_dir.with_suffix(".log")
        self.proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def start_on(cls, host: str = "127.0.0.1", **kw: object) -> "EtcdProcess":
        """Free ports on ``host`` (which must be reachable from here), started and ready."""
        etcd = cls(host, _free_port(host), _free_port(host), **kw)  # type: ignore[arg-type]
        etcd.start()
        return etcd

    @property
    def url(self) -> str:
        """The ``--discovery`` value."""
        return f"etcd://{self.host}:{self.client_port}"

    def argv(self) -> list[str]:
        return [*self.prefix, *etcd_argv(self.binary, self.host, self.client_port, self.peer_port, self.data_dir / "member-data")]

    def start(self, ready_timeout: float = 20.0, wait: bool = True) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        if wait:
            self.wait_ready(ready_timeout)

    def wait_ready(self, timeout: float = 20.0) -> None:
        """Until etcd answers on its client port (checked by a TCP connect and its /health)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                self._failed = True
                raise PdgrpcError(f"etcd exited with code {self.proc.returncode}; see {self.log_path}")
            if self._healthy():
                return
            time.sleep(0.1)
        self._failed = True
        raise PdgrpcError(f"etcd not ready on {self.host}:{self.client_port} within {timeout:.0f} s; see {self.log_path}")

    def _healthy(self) -> bool:
        if self.prefix:  # another namespace: ask from there
            argv = [*self.prefix, "python3", "-c", _HEALTH_SNIPPET, self.host, str(self.client_port)]
            return subprocess.run(argv, capture_output=True, timeout=10).returncode == 0
        return _health(self.host, self.client_port)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop etcd (its data stays for :meth:`start`)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        """Stop etcd for good. A data dir of its own goes, and a log of its own with it
        unless etcd failed (the error named the log)."""
        self.stop(signal.SIGKILL)
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            if self._own_log and not self._failed:
                self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> "EtcdProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def etcd_argv(binary: str, host: str, client_port: int, peer_port: int, data_dir: Path) -> list[str]:
    """A single-member etcd listening on ``host`` (plain http: tests and the launcher run it
    on loopback or on a subnet private to their network namespaces)."""
    client = f"http://{host}:{client_port}"
    peer = f"http://{host}:{peer_port}"
    return [
        binary, "--name", "pdgrpc", "--data-dir", str(data_dir),
        "--listen-client-urls", client, "--advertise-client-urls", client,
        "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
        "--initial-cluster", f"pdgrpc={peer}", "--initial-cluster-state", "new", "--log-level", "warn",
    ]


def etcd_healthy(host: str, port: int) -> bool:
    """Whether etcd on ``host:port`` answers its /health as healthy (reachable from here)."""
    return _health(host, port)


def _health(host: str, port: int) -> bool:
    import http.client

    try:
        conn = http.client.HTTPConnection(host, port, timeout=1.0)
        conn.request("GET", "/health")
        body = conn.getresponse().read()
        conn.close()
    except OSError:
        return False
    return b'"true"' in body


_HEALTH_SNIPPET = """
import http.client, sys
c = http.client.HTTPConnection(sys.argv[1], int(sys.argv[2]), timeout=1.0)
try:
    c.request("GET", "/health"); sys.exit(0 if b'"true"' in c.getresponse().read() else 1)
except OSError:
    sys.exit(1)
"""
