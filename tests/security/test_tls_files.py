"""A TLS file a server cannot use stops it at start-up, exit 2, with one line naming the
flag and the file: not PEM, a key that is not the certificate's, a CA file with no
certificate, a certificate expired or not for servers. Taken, grpc fails the bind with
no reason given, and the server said "cannot bind" (its port is free), or served a
certificate every client refuses."""

from __future__ import annotations

import datetime
import subprocess
import sys
from pathlib import Path

import pytest

from pdgrpc.rpc.certs import CertFiles, issue, make_ca

pytest.importorskip("cryptography", reason="builds the certificates (the tls extra)")


def _expired(ca: CertFiles, directory: Path) -> CertFiles:
    """A server certificate from ``ca`` whose validity ended yesterday."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca_cert = x509.load_pem_x509_certificate(ca.cert.read_bytes())
    ca_key = serialization.load_pem_private_key(ca.key.read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "expired")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=30))
        .not_valid_after(now - datetime.timedelta(days=1))
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    files = CertFiles(directory / "expired.pem", directory / "expired.key")
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    files.key.chmod(0o600)
    return files


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tls")
    ca = make_ca(d)
    server, other = issue(ca, d, "server"), issue(ca, d, "other")
    client = issue(ca, d, "client", server=False)
    expired = _expired(ca, d)
    (d / "garbage.pem").write_text("not a certificate\n")
    (d / "empty.pem").write_text("")
    return {
        "ca": ca.cert, "cert": server.cert, "key": server.key, "other-key": other.key, "garbage": d / "garbage.pem",
        "empty": d / "empty.pem", "client-cert": client.cert, "client-key": client.key,
        "expired-cert": expired.cert, "expired-key": expired.key,
    }


# (flags with {name} for a file of the fixture, the error's message)
BAD_FILES = [
    (["--tls-cert", "{garbage}", "--tls-key", "{key}"], "--tls-cert '{garbage}': no PEM certificate in it"),
    (["--tls-cert", "{empty}", "--tls-key", "{key}"], "--tls-cert '{empty}': no PEM certificate in it"),
    (["--tls-cert", "{key}", "--tls-key", "{cert}"], "--tls-cert '{key}': no PEM certificate in it"),
    (["--tls-cert", "{cert}", "--tls-key", "{garbage}"], "--tls-key '{garbage}': no unencrypted PEM private key in it"),
    (["--tls-cert", "{cert}", "--tls-key", "{other-key}"], "--tls-key '{other-key}' is not the private key of --tls-cert '{cert}'"),
    (["--tls-cert", "{cert}", "--tls-key", "{key}", "--tls-ca", "{garbage}"], "--tls-ca '{garbage}': no PEM certificate in it"),
    (["--tls-cert", "{cert}", "--tls-key", "{key}", "--tls-ca", "{empty}"], "--tls-ca '{empty}': no PEM certificate in it"),
    (["--tls-cert", "{expired-cert}", "--tls-key", "{expired-key}"], "--tls-cert '{expired-cert}' expired on "),
    (["--tls-cert", "{client-cert}", "--tls-key", "{client-key}"], "--tls-cert '{client-cert}' is not for servers"),
]


@pytest.mark.parametrize("flags, message", BAD_FILES, ids=[" ".join(f) for f, _ in BAD_FILES])
def test_a_tls_file_a_server_cannot_use_is_refused_naming_the_flag(flags: list[str], message: str, files: dict[str, Path]) -> None:
    names = {k: str(v) for k, v in files.items()}
    argv = [f.format(**names) for f in flags]
    out = subprocess.run([sys.executable, "-m", "pdgrpc.bootstrap", "--port", "0", *argv], stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"python -m pdgrpc.bootstrap: error: {message.format(**names)}" in out.stderr, out.stderr[-3000:]
    assert "cannot bind" not in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]


def test_the_routers_public_certificate_is_checked_too(files: dict[str, Path]) -> None:
    argv = ["--port", "0", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2",
            "--public-tls-cert", str(files["cert"]), "--public-tls-key", str(files["other-key"])]
    out = subprocess.run([sys.executable, "-m", "pdgrpc.router", *argv], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-3000:]
    message = f"--public-tls-key '{files['other-key']}' is not the private key of --public-tls-cert '{files['cert']}'"
    assert f"python -m pdgrpc.router: error: {message}" in out.stderr, out.stderr[-3000:]
