"""What a servicer reads of a ``grpc.aio`` servicer context, for driving it in-process:
the caller's address and TLS identity, and ``abort``, which raises :class:`Refused`."""

from __future__ import annotations

import grpc


class Refused(Exception):
    """A call the facade ended with ``code`` and ``message``."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(code, message)
        self.code, self.message = code, message


class Context:
    """A call from ``host``, under mTLS as ``common_name`` (None: no certificate)."""

    def __init__(self, common_name: str | None, host: str = "10.0.0.5") -> None:
        self._peer = f"ipv4:{host}:40000"
        self._auth = {"x509_common_name": [common_name.encode()]} if common_name else {}

    def peer(self) -> str:
        return self._peer

    def auth_context(self) -> dict[str, list[bytes]]:
        return self._auth

    async def abort(self, code: grpc.StatusCode, message: str, trailing_metadata: object = ()) -> None:
        raise Refused(code, message)
