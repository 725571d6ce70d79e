"""The checks of the TLS files a process is given, made before it serves: grpc takes any
bytes as a certificate or key and fails only at the bind, with no reason given, and
serves a certificate that has expired or is for clients only, which every client then
refuses. A file that cannot serve is a ConfigError naming its flag and path.

The PEM checks use the standard ``ssl`` module; the validity dates and the extended key
usage are read with the optional ``cryptography`` package (``pdgrpc[tls]``) where it is
installed, and go unchecked where it is not.
"""

from __future__ import annotations

import datetime
import ssl
from pathlib import Path

from pdgrpc.errors import ConfigError

__all__ = ["check_ca", "check_server_pair"]

# OpenSSL's reason for a private key that is not the certificate's.
_MISMATCH = "KEY_VALUES_MISMATCH"


def _no_certificate(path: Path, flag: str) -> ConfigError:
    return ConfigError(f"{flag} {str(path)!r}: no PEM certificate in it")


def check_ca(path: Path, flag: str) -> None:
    """ConfigError naming ``flag`` unless ``path`` holds at least one PEM certificate."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=str(path))
    except (ssl.SSLError, ValueError):
        raise _no_certificate(path, flag) from None


def check_server_pair(cert: Path, key: Path, cert_flag: str, key_flag: str) -> None:
    """ConfigError naming the flag at fault unless ``cert`` is a PEM certificate (chain) a
    server may present now and ``key`` its unencrypted PEM private key."""
    check_ca(cert, cert_flag)
    try:
        # An empty password: an encrypted key fails here instead of prompting on the terminal.
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(str(cert), str(key), password=b"")
    except ssl.SSLError as exc:
        if exc.reason == _MISMATCH:
            raise ConfigError(f"{key_flag} {str(key)!r} is not the private key of {cert_flag} {str(cert)!r}") from None
        raise ConfigError(f"{key_flag} {str(key)!r}: no unencrypted PEM private key in it") from None
    _check_use(cert, cert_flag)


def _check_use(path: Path, flag: str) -> None:
    """ConfigError unless the first certificate of ``path`` is valid now and, where it
    names its uses, names serving (a pdgrpc process serves with it)."""
    try:
        from cryptography import x509
        from cryptography.x509.oid import ExtendedKeyUsageOID
    except ImportError:  # the tls extra is optional: the dates and uses go unchecked
        return
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    now = datetime.datetime.now(datetime.timezone.utc)
    if now > cert.not_valid_after_utc:
        raise ConfigError(f"{flag} {str(path)!r} expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC")
    if now < cert.not_valid_before_utc:
        raise ConfigError(f"{flag} {str(path)!r} is valid only from {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC")
    try:
        uses = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:  # no restriction: any use
        return
    if ExtendedKeyUsageOID.SERVER_AUTH not in uses:
        names = {ExtendedKeyUsageOID.CLIENT_AUTH: "clientAuth", ExtendedKeyUsageOID.CODE_SIGNING: "codeSigning",
                 ExtendedKeyUsageOID.EMAIL_PROTECTION: "emailProtection"}
        named = ", ".join(names.get(oid, oid.dotted_string) for oid in uses)
        raise ConfigError(f"{flag} {str(path)!r} is not for servers: its extended key usage is {named}")
