"""Who answers at a signed record's address: the check a router makes before it dials.

A signed record (:mod:`pdgrpc.discovery.signing`) proves who wrote it, not that its
address is the writer's: an instance holding any certificate of the cluster's CA could
sign a record naming another instance's address. :class:`DialIdentity` therefore opens
one TLS connection to the address, presenting this process's certificate, and reports
the :func:`~pdgrpc.discovery.signing.key_fingerprint` of the certificate the server
there shows (it must chain to the cluster's CA). The :class:`~pdgrpc.discovery.etcd.Watcher`
asks it for every signed record before the view lists the record's instance, and again
whenever the record's address or signer changes; a server showing another key is never
dialed (:meth:`~pdgrpc.discovery.record.MembershipView.prove`). This check covers one
connection; the router's own channels hold every later one to the signer by its key's
name (:meth:`~pdgrpc.discovery.record.MembershipView.server_name`).
"""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

from pdgrpc.discovery.signing import key_fingerprint

__all__ = ["DialIdentity", "NotTheSigner"]


class NotTheSigner(Exception):
    """The server at an address showed a certificate the cluster's CA did not sign."""


class DialIdentity:
    """Reads the key a server shows at an address over TLS, as a router's channels would
    meet it: verified against ``ca``, presenting ``cert``/``key`` when given."""

    def __init__(self, ca: Path, cert: Path | None, key: Path | None, timeout_s: float = 3.0) -> None:
        ctx = ssl.create_default_context(cafile=str(ca))
        # The identity is the key pinned below, not a host name: certificates name hosts loosely.
        ctx.check_hostname = False
        if cert is not None and key is not None:
            ctx.load_cert_chain(str(cert), str(key))
        ctx.set_alpn_protocols(["h2"])
        self._ctx = ctx
        self.timeout_s = timeout_s

    async def presented(self, address: str) -> bytes:
        """The key fingerprint of the certificate the server at ``address`` shows; OSError
        or TimeoutError when none answers, :class:`NotTheSigner` when its certificate is
        not the cluster's."""
        host, _, port = address.rpartition(":")
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(host.strip("[]"), int(port), ssl=self._ctx), self.timeout_s,
            )
        except ssl.SSLCertVerificationError as exc:
            raise NotTheSigner(exc.verify_message or str(exc)) from None
        try:
            der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        finally:
            writer.transport.abort()  # nothing was sent: no TLS goodbye to wait for
        return key_fingerprint(der)
