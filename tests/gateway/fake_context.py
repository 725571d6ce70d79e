"""What the smg facade reads of a ``grpc.aio`` servicer context, for driving its legs
in-process: the caller's TLS identity, and ``abort``, which raises :class:`Refused`."""

from __future__ import annotations

import grpc


class Refused(Exception):
    """A call the facade ended with ``code`` and ``message``."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(code, message)
        self.code, self.message = code, message


class Context:
    def __init__(self, common_name: str) -> None:
        self._auth = {"x509_common_name": [common_name.encode()]}

    def peer(self) -> str:
        return "ipv4:10.0.0.5:40000"

    def auth_context(self) -> dict[str, list[bytes]]:
        return self._auth

    async def abort(self, code: grpc.StatusCode, message: str, trailing_metadata: object = ()) -> None:
        raise Refused(code, message)
