"""Signed discovery records: who wrote a record, proven with the writer's certificate.

Under mTLS every instance signs the record it puts into etcd with its own certificate's
key (``--tls-cert``/``--tls-key``): the value is an envelope holding the record, the
certificate and the signature (:meth:`RecordSigner.seal`). A reader with the cluster's
CA (``--tls-ca``) takes a record only when the certificate chains to that CA, is valid
now, names the record's role (``spiffe://pdgrpc/role/<role>``, :mod:`pdgrpc.rpc.roles`;
a certificate naming no role names every role) and the signature verifies
(:meth:`RecordVerifier.open`). Anyone else who can write to etcd -- without a key the
CA signed, or with a client's -- can only add keys that are ignored and counted.

The reader also learns the signer's key (:func:`key_fingerprint`): a router dials a
record's address only once the server there has shown that key
(:mod:`pdgrpc.discovery.identity`), so a signer cannot point a record at another
instance; and, when the signer's certificate carries its key's name
(:func:`pdgrpc.rpc.certs.key_name`, in every server certificate the launcher issues),
the router's channels there accept no other server on any later connection either.
"""

from __future__ import annotations

import base64
import datetime
import json
from pathlib import Path
from typing import Any

from pdgrpc.errors import ConfigError
from pdgrpc.rpc.certs import key_name
from pdgrpc.rpc.roles import ROLE_URI

__all__ = ["SEALED", "RecordSigner", "RecordVerifier", "key_fingerprint"]

SEALED = 1  # the envelope's format version


def _crypto() -> Any:
    try:
        from cryptography import x509
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
    except ImportError:
        raise ConfigError("signed discovery records need the 'cryptography' package: pip install 'pdgrpc[tls]'") from None
    return x509, InvalidSignature, hashes, serialization, ec, padding, rsa


def key_fingerprint(cert_der: bytes) -> bytes:
    """SHA-256 of the certificate's public key (its DER SubjectPublicKeyInfo): the same
    for every certificate issued to one key."""
    x509, _, hashes, serialization, *_ = _crypto()
    spki = x509.load_der_x509_certificate(cert_der).public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo,
    )
    digest = hashes.Hash(hashes.SHA256())
    digest.update(spki)
    return bytes(digest.finalize())


def _read(path: Path, flag: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot read {str(path)!r}: {exc.strerror or exc}") from None


class RecordSigner:
    """Seals records with one instance's certificate and key."""

    def __init__(self, cert: Path, key: Path) -> None:
        x509, _, _, serialization, ec, _, rsa = _crypto()
        cert_pem = _read(cert, "--tls-cert")
        self._cert = x509.load_pem_x509_certificate(cert_pem).public_bytes(serialization.Encoding.PEM).decode()
        self._key = serialization.load_pem_private_key(_read(key, "--tls-key"), password=None)
        if not isinstance(self._key, (ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey)):
            raise ConfigError("--tls-key: discovery records are signed with an EC or RSA key")

    def seal(self, record: bytes) -> bytes:
        """The envelope etcd stores: the record, this instance's certificate, the signature."""
        _, _, hashes, _, ec, padding, _ = _crypto()
        if isinstance(self._key, ec.EllipticCurvePrivateKey):
            sig = self._key.sign(record, ec.ECDSA(hashes.SHA256()))
        else:
            sig = self._key.sign(record, padding.PKCS1v15(), hashes.SHA256())
        doc = {"sealed": SEALED, "record": record.decode(), "cert": self._cert, "sig": base64.b64encode(sig).decode()}
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


class RecordVerifier:
    """Opens envelopes whose certificate the cluster's CA signed."""

    def __init__(self, ca: Path) -> None:
        x509, *_ = _crypto()
        self._ca = x509.load_pem_x509_certificate(_read(ca, "--tls-ca"))

    def open(self, value: bytes) -> tuple[bytes, frozenset[str] | None, bytes, str | None]:
        """The record inside ``value``, the roles its writer's certificate names (None:
        every role), the writer's :func:`key_fingerprint` and the
        :func:`~pdgrpc.rpc.certs.key_name` its certificate carries (None: it carries
        none); ConfigError saying why it is not taken."""
        x509, InvalidSignature, hashes, serialization, ec, padding, rsa = _crypto()
        try:
            doc = json.loads(value)
        except (UnicodeDecodeError, ValueError):
            raise ConfigError("not a signed record (not JSON)") from None
        if not isinstance(doc, dict) or doc.get("sealed") != SEALED:
            raise ConfigError("not a signed record")
        record, cert_pem, sig = doc.get("record"), doc.get("cert"), doc.get("sig")
        if not (isinstance(record, str) and isinstance(cert_pem, str) and isinstance(sig, str)):
            raise ConfigError("signed record without record, cert or sig")
        try:
            cert = x509.load_pem_x509_certificate(cert_pem.encode())
            cert.verify_directly_issued_by(self._ca)
        except (ValueError, TypeError, InvalidSignature) as exc:
            raise ConfigError(f"its certificate is not one the cluster's CA issued ({exc or type(exc).__name__})") from None
        now = datetime.datetime.now(datetime.timezone.utc)
        if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
            raise ConfigError("its certificate is not valid now")
        key = cert.public_key()
        try:
            raw = base64.b64decode(sig, validate=True)
            if isinstance(key, ec.EllipticCurvePublicKey):
                key.verify(raw, record.encode(), ec.ECDSA(hashes.SHA256()))
            elif isinstance(key, rsa.RSAPublicKey):
                key.verify(raw, record.encode(), padding.PKCS1v15(), hashes.SHA256())
            else:
                raise ConfigError("its certificate's key is neither EC nor RSA")
        except (ValueError, InvalidSignature):
            raise ConfigError("its signature does not verify") from None
        try:
            sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            uris, dns = sans.get_values_for_type(x509.UniformResourceIdentifier), sans.get_values_for_type(x509.DNSName)
        except x509.ExtensionNotFound:
            uris, dns = [], []
        roles = frozenset(u[len(ROLE_URI):] for u in uris if u.startswith(ROLE_URI))
        fingerprint = key_fingerprint(cert.public_bytes(serialization.Encoding.DER))
        name = key_name(fingerprint)
        return record.encode(), roles or None, fingerprint, name if name in dns else None
