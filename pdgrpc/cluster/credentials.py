"""What a local cluster's processes and clients present (``--tls auto``, ``--auth-token auto``).

:class:`ClusterCredentials` makes, in the cluster's run directory, a throwaway CA and one
certificate per process (its name is the certificate's common name, which bootstrap
sees as its identity) plus one for clients, and/or a random bearer token
(:mod:`pdgrpc.rpc.certs`); :meth:`~ClusterCredentials.flags` are a process's security
flags, :attr:`~ClusterCredentials.client` what a client of the cluster presents.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from pdgrpc.rpc.certs import CertFiles, issue, make_ca, write_token
from pdgrpc.rpc.security import Security

__all__ = ["CLIENT", "ClusterCredentials"]

CLIENT = "client"  # the certificate a cluster's clients present


class ClusterCredentials:
    def __init__(self, directory: Path, names: Iterable[str], *, tls: bool, token: bool) -> None:
        self.ca: CertFiles | None = make_ca(directory) if tls else None
        self.certs: dict[str, CertFiles] = {}
        if self.ca is not None:
            for name in (*names, CLIENT):
                self.certs[name] = issue(self.ca, directory, name)
        self.token: Path | None = write_token(directory / "token") if token else None
        client = self.certs.get(CLIENT)
        self.client = Security(
            cert=None if client is None else client.cert, key=None if client is None else client.key,
            ca=None if self.ca is None else self.ca.cert, token_file=self.token,
        )

    def flags(self, name: str) -> list[str]:
        """The security flags of process ``name``."""
        out: list[str] = []
        cert = self.certs.get(name)
        if cert is not None and self.ca is not None:
            out += ["--tls-cert", str(cert.cert), "--tls-key", str(cert.key), "--tls-ca", str(self.ca.cert)]
        if self.token is not None:
            out += ["--auth-token-file", str(self.token)]
        return out
