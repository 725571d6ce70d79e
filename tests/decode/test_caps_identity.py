"""Per-client caps key on who the caller proved to be (issue 16): under mTLS two clients
on one host are two clients, each with its own share of ``--max-decodes-per-client``."""

from __future__ import annotations

import types
from typing import Any, AsyncIterator

import grpc
import pytest

from pdgrpc.decode.service import DecodeServicer
from pdgrpc.v1 import decode_pb2


class _Refused(Exception):
    pass


class _Context:
    """What the servicer reads of a grpc.aio context: the peer, its TLS identity, abort."""

    def __init__(self, host: str, common_name: str | None) -> None:
        self._peer = f"ipv4:{host}:40000"
        self._auth = {"x509_common_name": [common_name.encode()]} if common_name else {}

    def peer(self) -> str:
        return self._peer

    def auth_context(self) -> dict[str, list[bytes]]:
        return self._auth

    async def abort(self, code: grpc.StatusCode, message: str, trailing_metadata: object = ()) -> None:
        raise _Refused(code, message)


async def _first(servicer: DecodeServicer, ctx: _Context) -> Any:
    stream: AsyncIterator[Any] = servicer.Decode(decode_pb2.DecodeRequest(bootstrap_room=7), ctx)  # type: ignore[arg-type]
    return await stream.__anext__()


async def test_decode_calls_per_client_count_per_certificate_not_per_host() -> None:
    scheduler = types.SimpleNamespace(
        metrics=types.SimpleNamespace(on_refused=lambda: None), engine=types.SimpleNamespace(num_pages=16),
        buffers=types.SimpleNamespace(num_slots=4),
    )
    servicer = DecodeServicer(scheduler, max_per_client=1)  # type: ignore[arg-type]

    async def one_item(request: Any, context: Any, client: str) -> AsyncIterator[str]:
        yield "served"

    servicer._decode = one_item  # type: ignore[method-assign]
    servicer.open_calls.open["cn:alice"] = 1  # alice already has her one call open
    with pytest.raises(_Refused, match="cn:alice already has 1 Decode calls open"):
        await _first(servicer, _Context("10.0.0.5", "alice"))
    assert await _first(servicer, _Context("10.0.0.5", "bob")) == "served"  # same host, another identity
    servicer.open_calls.open["host:10.0.0.9"] = 1
    with pytest.raises(_Refused, match="host:10.0.0.9"):  # no certificate: its host is its identity
        await _first(servicer, _Context("10.0.0.9", None))
