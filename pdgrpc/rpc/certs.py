"""A throwaway CA, certificates issued by it, and bearer tokens, for a local cluster.

``python -m pdgrpc.cluster --tls auto`` (and the tests) get a secure cluster without a
PKI: :func:`make_ca` creates a CA in the cluster's run directory, :func:`issue` one
certificate per process (usable as server and as client certificate: every pdgrpc
process is both), valid for the loopback names only unless ``hosts`` says more, naming
the role its holder calls as (:mod:`pdgrpc.rpc.roles`), and client-only certificates (``server=False``: what a cluster's clients present, which
cannot serve as one of its processes).
:func:`write_token` writes a random bearer token (``--auth-token auto``). Keys are
EC P-256, files are PEM, private keys and tokens are readable by their owner only.

Needs the optional ``cryptography`` package: ``pip install 'pdgrpc[tls]'``. A CA made
here is for one cluster's lifetime; a real deployment issues certificates from its own CA.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import hashlib
import ipaddress
import os
import secrets
from pathlib import Path
from typing import Any, Iterable

from pdgrpc.errors import ConfigError
from pdgrpc.rpc.roles import ROLE_URI, ROLES

__all__ = ["KEY_NAME_SUFFIX", "LOOPBACK_HOSTS", "CertFiles", "issue", "key_name", "make_ca", "write_token"]

LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")
_VALID_FOR = datetime.timedelta(days=7)
KEY_NAME_SUFFIX = ".key.pdgrpc"


def key_name(fingerprint: bytes) -> str:
    """The DNS name a server certificate :func:`issue` makes carries for its key, given the
    key's fingerprint (SHA-256 of its DER SubjectPublicKeyInfo): no other key's certificate
    from this CA carries it, so a client that expects it (``grpc.ssl_target_name_override``)
    accepts only a server holding that key."""
    return base64.b32encode(fingerprint).decode().rstrip("=").lower() + KEY_NAME_SUFFIX


@dataclasses.dataclass(frozen=True)
class CertFiles:
    """A certificate and its private key, as PEM files."""

    cert: Path
    key: Path


def _crypto() -> Any:
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:
        raise ConfigError("generating certificates needs the 'cryptography' package: pip install 'pdgrpc[tls]'") from None
    return x509, hashes, serialization, ec, ExtendedKeyUsageOID, NameOID


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _save(directory: Path, name: str, cert: Any, key: Any) -> CertFiles:
    _, _, serialization, *_ = _crypto()
    directory.mkdir(parents=True, exist_ok=True)
    files = CertFiles(directory / f"{name}.pem", directory / f"{name}.key")
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(
        files.key,
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )
    return files


def make_ca(directory: str | Path, name: str = "pdgrpc throwaway CA") -> CertFiles:
    """A new self-signed CA (``ca.pem``, ``ca.key`` in ``directory``)."""
    x509, hashes, _, ec, _, NameOID = _crypto()
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + _VALID_FOR)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(key, hashes.SHA256())
    )
    return _save(Path(directory), "ca", cert, key)


def issue(
    ca: CertFiles, directory: str | Path, name: str, hosts: Iterable[str] = LOOPBACK_HOSTS, *, server: bool = True,
    role: str | None = None,
) -> CertFiles:
    """A certificate for process ``name`` (its common name, which peers see as its
    identity), signed by ``ca``, valid for ``hosts`` (IP addresses or DNS names) as a
    server and usable as a client certificate (``<name>.pem``, ``<name>.key``), and for
    its key's :func:`key_name`, so a client can insist on this key. With
    ``server=False`` a client certificate only: no host names and client use alone, so
    a TLS client refuses a server that presents it. ``role`` (one of
    :data:`pdgrpc.rpc.roles.ROLES`): the role its holder calls as, a URI SAN
    (``spiffe://pdgrpc/role/<role>``); without it the holder has every role."""
    x509, hashes, serialization, ec, ExtendedKeyUsageOID, NameOID = _crypto()
    ca_cert = x509.load_pem_x509_certificate(ca.cert.read_bytes())
    ca_key = serialization.load_pem_private_key(ca.key.read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[Any] = []
    for h in hosts if server else ():
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    if server:
        spki = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        names.append(x509.DNSName(key_name(hashlib.sha256(spki).digest())))
    if role is not None:
        if role not in ROLES:
            raise ConfigError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        names.append(x509.UniformResourceIdentifier(ROLE_URI + role))
    now = datetime.datetime.now(datetime.timezone.utc)
    uses = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH] if server else [ExtendedKeyUsageOID.CLIENT_AUTH]
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + _VALID_FOR)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(uses), critical=False)
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return _save(Path(directory), name, cert, key)


def write_token(path: str | Path) -> Path:
    """A fresh random bearer token (256 bits, URL-safe text) in ``path``, mode 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_private(path, (secrets.token_urlsafe(32) + "\n").encode())
    return path
