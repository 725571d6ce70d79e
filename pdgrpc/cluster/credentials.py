"""What a local cluster's processes and clients present (``[security]``, ``--tls auto``).

:class:`ClusterCredentials` either makes, in the cluster's run directory, a throwaway CA
(whose key is deleted once it has signed) and one certificate per process (its name is
the certificate's common name, which bootstrap sees as its identity, and it names the
process's role, :mod:`pdgrpc.rpc.roles`) plus one for clients and one for the launcher's
own calls, and/or one random bearer token per role with the file of their digests that
every server checks callers against (:mod:`pdgrpc.rpc.certs`); or uses the files a
topology's ``[security]`` table names (``tls-cert``, ``tls-key``, ``tls-ca``,
``auth-token-file``: the same for every process and for the launcher's own calls, so
without roles). Behind smg, the prefill and decode servers also share a random room key
(``--smg-room-key-file``). Under ``--tls auto`` a topology's etcd serves TLS with a
certificate of the same CA and takes only clients with one (:attr:`~ClusterCredentials.etcd`;
:meth:`~ClusterCredentials.etcd_flags` are what a process presents to it).
:meth:`~ClusterCredentials.flags` are a process's security flags,
:attr:`~ClusterCredentials.client` what a client of the cluster presents,
:meth:`~ClusterCredentials.security` what any of them presents.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from pdgrpc.discovery.server import EtcdTls
from pdgrpc.rpc.certs import LOOPBACK_HOSTS, CertFiles, issue, make_ca, write_token
from pdgrpc.rpc.roles import BOOTSTRAP, CLIENT, DECODE, GATEWAY, PREFILL, ROLES, ROUTER
from pdgrpc.rpc.security import Security, token_digest

__all__ = ["CLIENT", "LAUNCHER", "ROLE_OF", "ClusterCredentials"]

LAUNCHER = "launcher"  # the credentials of the launcher's own calls (GetStats, Drain): a router's
# The role each kind of topology process calls as; an etcd gets no pdgrpc credentials.
ROLE_OF = {"bootstrap": BOOTSTRAP, "prefill": PREFILL, "decode": DECODE, "router": ROUTER, "colocated": ROUTER, "smg": GATEWAY}


class ClusterCredentials:
    def __init__(
        self, directory: Path, processes: Mapping[str, str], *, tls: bool, token: bool, files: Mapping[str, Path] | None = None,
        smg: bool = False, addresses: Mapping[str, str] | None = None,
    ) -> None:
        """``processes``: each process's name and kind (its topology role); ``addresses``:
        where a process listens when not on loopback only (its certificate names it)."""
        addresses = addresses or {}
        files = files or {}
        self.roles = {name: ROLE_OF[kind] for name, kind in processes.items() if kind in ROLE_OF}
        self.roles.update({CLIENT: CLIENT, LAUNCHER: ROUTER})
        self.certs: dict[str, CertFiles] = {}
        self.ca: Path | None = files.get("tls-ca")
        self.etcd: EtcdTls | None = None
        if tls:
            made = make_ca(directory)
            self.ca = made.cert
            try:
                for name, kind in processes.items():
                    if kind == "etcd":  # a server only: its certificate calls nothing of pdgrpc's but Generate
                        hosts = tuple(dict.fromkeys((*LOOPBACK_HOSTS, addresses.get(name, LOOPBACK_HOSTS[0]))))
                        own = issue(made, directory, name, hosts, role=CLIENT)
                        self.etcd = EtcdTls(made.cert, own.cert, own.key)
                # Every process serves and calls; a client only calls.
                self.certs = {
                    name: issue(made, directory, name, tuple(dict.fromkeys((*LOOPBACK_HOSTS, addresses.get(name, LOOPBACK_HOSTS[0])))),
                                server=role != CLIENT, role=role)
                    for name, role in self.roles.items()
                }
            finally:
                # Once it has signed (or failed to), the CA's key goes, so a run directory
                # kept afterwards (the CLI's, a failed run's) holds no key that could mint
                # a certificate the cluster trusts.
                made.key.unlink(missing_ok=True)
        elif "tls-cert" in files:
            shared = CertFiles(files["tls-cert"], files["tls-key"])
            self.certs = {name: shared for name in self.roles}
        # One token per role, and the digests every server checks a caller's token against:
        # a client's token names a client, and cannot register a worker.
        self.tokens: dict[str, Path] = {}
        self.roles_file: Path | None = None
        if token:
            self.tokens = {role: write_token(directory / "tokens" / role) for role in ROLES}
            self.roles_file = directory / "roles"
            self.roles_file.write_text("".join(f"{role} {token_digest(_read_token(path))}\n" for role, path in self.tokens.items()))
        elif "auth-token-file" in files:
            self.tokens = dict.fromkeys(ROLES, files["auth-token-file"])
        # The key an smg setup's prefill and decode servers derive room secrets under
        # (--smg-room-key-file): a request id alone then proves nothing.
        self.smg_room_key: Path | None = write_token(directory / "smg-room-key") if smg else None
        # smg's HTTP side takes only callers with this key (its --api-key) in a secured cluster.
        self.smg_api_key: Path | None = write_token(directory / "smg-api-key") if smg and self.secured else None
        self.client = self.security(CLIENT)

    @property
    def secured(self) -> bool:
        """Whether the cluster's servers take only callers with credentials (a certificate or a token)."""
        return bool(self.certs or self.tokens)

    @property
    def token(self) -> Path | None:
        """The token a client of the cluster presents."""
        return self.tokens.get(CLIENT)

    def security(self, name: str) -> Security:
        """What process ``name`` (or :data:`CLIENT`, :data:`LAUNCHER`) presents on its calls."""
        cert = self.certs.get(name)
        return Security(
            cert=None if cert is None else cert.cert, key=None if cert is None else cert.key, ca=self.ca,
            token_file=self.tokens.get(self.roles.get(name, CLIENT)),
        )

    def etcd_flags(self, name: str) -> list[str]:
        """What process ``name`` presents to the topology's etcd (none when etcd runs plain)."""
        cert = self.certs.get(name)
        if self.etcd is None or cert is None:
            return []
        return ["--discovery-ca", str(self.etcd.ca), "--discovery-cert", str(cert.cert), "--discovery-key", str(cert.key)]

    def flags(self, name: str) -> list[str]:
        """The security flags of process ``name``."""
        out: list[str] = []
        cert = self.certs.get(name)
        if cert is not None:
            out += ["--tls-cert", str(cert.cert), "--tls-key", str(cert.key)]
        if self.ca is not None:
            out += ["--tls-ca", str(self.ca)]
        token = self.tokens.get(self.roles.get(name, CLIENT))
        if token is not None:
            out += ["--auth-token-file", str(token)]
        if self.roles_file is not None:
            out += ["--auth-roles-file", str(self.roles_file)]
        return out


def _read_token(path: Path) -> str:
    return path.read_text().strip()
