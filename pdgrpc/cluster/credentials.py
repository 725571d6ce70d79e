"""What a local cluster's processes and clients present (``[security]``, ``--tls auto``).

:class:`ClusterCredentials` either makes, in the cluster's run directory, a throwaway CA
(whose key is deleted once it has signed) and one certificate per process (its name is
the certificate's common name, which bootstrap sees as its identity) plus one for
clients, and/or a random bearer token (:mod:`pdgrpc.rpc.certs`); or uses the files a
topology's ``[security]`` table names (``tls-cert``, ``tls-key``, ``tls-ca``,
``auth-token-file``: the same for every process and for the launcher's own calls).
Behind smg, the prefill and decode servers also share a random room key
(``--smg-room-key-file``).
:meth:`~ClusterCredentials.flags` are a process's security flags,
:attr:`~ClusterCredentials.client` what a client of the cluster presents.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Mapping

from pdgrpc.rpc.certs import CertFiles, issue, make_ca, write_token
from pdgrpc.rpc.security import Security

__all__ = ["CLIENT", "ClusterCredentials"]

CLIENT = "client"  # the certificate a cluster's clients present


class ClusterCredentials:
    def __init__(
        self, directory: Path, names: Iterable[str], *, tls: bool, token: bool, files: Mapping[str, Path] | None = None,
        smg: bool = False,
    ) -> None:
        files = files or {}
        names = (*names, CLIENT)
        self.certs: dict[str, CertFiles] = {}
        self.ca: Path | None = files.get("tls-ca")
        if tls:
            made = make_ca(directory)
            self.ca = made.cert
            try:
                # Every process serves and calls; a client only calls.
                self.certs = {name: issue(made, directory, name, server=name != CLIENT) for name in names}
            finally:
                # Once it has signed (or failed to), the CA's key goes, so a run directory
                # kept afterwards (the CLI's, a failed run's) holds no key that could mint
                # a certificate the cluster trusts.
                made.key.unlink(missing_ok=True)
        elif "tls-cert" in files:
            shared = CertFiles(files["tls-cert"], files["tls-key"])
            self.certs = {name: shared for name in names}
        self.token: Path | None = write_token(directory / "token") if token else files.get("auth-token-file")
        # The key an smg setup's prefill and decode servers derive room secrets under
        # (--smg-room-key-file): a request id alone then proves nothing.
        self.smg_room_key: Path | None = write_token(directory / "smg-room-key") if smg else None
        client = self.certs.get(CLIENT)
        self.client = Security(
            cert=None if client is None else client.cert, key=None if client is None else client.key,
            ca=self.ca, token_file=self.token,
        )

    def flags(self, name: str) -> list[str]:
        """The security flags of process ``name``."""
        out: list[str] = []
        cert = self.certs.get(name)
        if cert is not None:
            out += ["--tls-cert", str(cert.cert), "--tls-key", str(cert.key)]
        if self.ca is not None:
            out += ["--tls-ca", str(self.ca)]
        if self.token is not None:
            out += ["--auth-token-file", str(self.token)]
        return out
