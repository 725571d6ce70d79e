"""Run a real single-member ``etcd`` (the Debian package ``etcd-server``) for tests, the
launcher's ``etcd`` role and the bench: a temporary data dir, given ports, stop and
restart on the same data (leases survive a restart, as in production).

::

    with EtcdProcess.start_on("127.0.0.1") as etcd:
        ... --discovery etcd.url ...

With :class:`EtcdTls` it serves clients (and peers) over TLS only and takes only clients
that present a certificate its CA signed (etcd's ``--client-cert-auth``).
"""

from __future__ import annotations

import dataclasses
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

__all__ = ["ETCD_PACKAGE_HINT", "EtcdProcess", "EtcdTls", "etcd_argv", "etcd_healthy", "find_etcd"]

ETCD_PACKAGE_HINT = "install the Debian package etcd-server (scripts/setup.sh does so when run as root)"


def find_etcd() -> str | None:
    """Path of the ``etcd`` binary, or None."""
    return shutil.which("etcd") or next((p for p in ("/usr/bin/etcd", "/usr/local/bin/etcd") if os.access(p, os.X_OK)), None)


@dataclasses.dataclass(frozen=True)
class EtcdTls:
    """etcd's own certificate and key (naming its host) and the CA whose clients it takes."""

    ca: Path
    cert: Path
    key: Path


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EtcdProcess:
    """One etcd member on ``host``; ``prefix`` runs it elsewhere (``ip netns exec h1``)."""

    def __init__(self, host: str, client_port: int, peer_port: int, data_dir: Path | None = None,
                 prefix: Sequence[str] = (), log_path: Path | None = None, tls: EtcdTls | None = None) -> None:
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
        self.tls = tls
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
        return f"{'etcds' if self.tls else 'etcd'}://{self.host}:{self.client_port}"

    def argv(self) -> list[str]:
        return [*self.prefix, *etcd_argv(self.binary, self.host, self.client_port, self.peer_port, self.data_dir / "member-data", self.tls)]

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
            tls = [] if self.tls is None else [str(self.tls.ca), str(self.tls.cert), str(self.tls.key)]
            argv = [*self.prefix, "python3", "-c", _HEALTH_SNIPPET, self.host, str(self.client_port), *tls]
            return subprocess.run(argv, capture_output=True, timeout=10).returncode == 0
        return _health(self.host, self.client_port, self.tls)

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


def etcd_argv(binary: str, host: str, client_port: int, peer_port: int, data_dir: Path, tls: EtcdTls | None = None) -> list[str]:
    """A single-member etcd listening on ``host``: plain http without ``tls``; with it, TLS
    for clients and peers, each of which must present a certificate of ``tls.ca``."""
    scheme = "http" if tls is None else "https"
    client = f"{scheme}://{host}:{client_port}"
    peer = f"{scheme}://{host}:{peer_port}"
    secured = [] if tls is None else [
        "--client-cert-auth", "--trusted-ca-file", str(tls.ca), "--cert-file", str(tls.cert), "--key-file", str(tls.key),
        "--peer-client-cert-auth", "--peer-trusted-ca-file", str(tls.ca), "--peer-cert-file", str(tls.cert),
        "--peer-key-file", str(tls.key),
    ]
    return [
        binary, "--name", "pdgrpc", "--data-dir", str(data_dir),
        "--listen-client-urls", client, "--advertise-client-urls", client,
        "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
        "--initial-cluster", f"pdgrpc={peer}", "--initial-cluster-state", "new", "--log-level", "warn", *secured,
    ]


def etcd_healthy(host: str, port: int, tls: EtcdTls | None = None) -> bool:
    """Whether etcd on ``host:port`` answers its /health as healthy (reachable from here;
    with ``tls``, over TLS presenting etcd's own certificate)."""
    return _health(host, port, tls)


def _health(host: str, port: int, tls: EtcdTls | None = None) -> bool:
    import http.client
    import ssl

    try:
        if tls is None:
            conn = http.client.HTTPConnection(host, port, timeout=1.0)
        else:
            ctx = ssl.create_default_context(cafile=str(tls.ca))
            ctx.load_cert_chain(str(tls.cert), str(tls.key))
            conn = http.client.HTTPSConnection(host, port, timeout=1.0, context=ctx)
        conn.request("GET", "/health")
        body = conn.getresponse().read()
        conn.close()
    except OSError:
        return False
    return b'"true"' in body


_HEALTH_SNIPPET = """
import http.client, ssl, sys
if len(sys.argv) > 3:
    ctx = ssl.create_default_context(cafile=sys.argv[3]); ctx.load_cert_chain(sys.argv[4], sys.argv[5])
    c = http.client.HTTPSConnection(sys.argv[1], int(sys.argv[2]), timeout=1.0, context=ctx)
else:
    c = http.client.HTTPConnection(sys.argv[1], int(sys.argv[2]), timeout=1.0)
try:
    c.request("GET", "/health"); sys.exit(0 if b'"true"' in c.getresponse().read() else 1)
except OSError:
    sys.exit(1)
"""
