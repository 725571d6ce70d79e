"""Per-client caps key on who the caller proved to be (issue 16): under mTLS two clients
on one host are two clients, each with its own share of ``--max-decodes-per-client``."""

from __future__ import annotations

import asyncio
import types
from typing import Any, AsyncIterator

import pytest

from pdgrpc.decode.service import DecodeServicer
from pdgrpc.v1 import common_pb2, decode_pb2
from tests.servicer_context import Context, Refused


async def _first(servicer: DecodeServicer, ctx: Context) -> Any:
    request = decode_pb2.DecodeRequest(bootstrap_room=7, local_prefill=True, sampling=common_pb2.SamplingParams(max_new_tokens=1))
    stream: AsyncIterator[Any] = servicer.Decode(request, ctx)  # type: ignore[arg-type]
    return await stream.__anext__()


def _scheduler() -> Any:
    """What the servicer uses of a scheduler for a request computed here: each is admitted
    and answers one token at once."""

    def submit_local(room: int, request_id: str, ids: tuple[int, ...], sampling: Any, max_new: int) -> Any:
        out: asyncio.Queue[Any] = asyncio.Queue()
        out.put_nowait(types.SimpleNamespace(token_ids=[5], logprobs=[], finish_reason="length", bytes_transferred=0,
                                             transfer_seconds=0.0, data_plane_seconds=0.0, cached_tokens=0, top=[]))
        return types.SimpleNamespace(room=room, out=out, trace=None, first_sent=asyncio.Event(),
                                     fate=types.SimpleNamespace(ended=True))

    engine = types.SimpleNamespace(num_pages=16, validate_request=lambda ids, max_new, field: None)
    return types.SimpleNamespace(metrics=types.SimpleNamespace(on_refused=lambda: None), engine=engine,
                                 buffers=types.SimpleNamespace(num_slots=4), submit_local=submit_local)


async def test_decode_calls_per_client_count_per_certificate_not_per_host() -> None:
    servicer = DecodeServicer(_scheduler(), max_per_client=1)
    servicer.open_calls.open["cn:alice"] = 1  # alice already has her one call open
    with pytest.raises(Refused, match="cn:alice already has 1 Decode calls open"):
        await _first(servicer, Context("alice", "10.0.0.5"))
    served = await _first(servicer, Context("bob", "10.0.0.5"))  # same host, another identity
    assert list(served.token_ids) == [5]
    servicer.open_calls.open["host:10.0.0.9"] = 1
    with pytest.raises(Refused, match="host:10.0.0.9"):  # no certificate: its host is its identity
        await _first(servicer, Context(None, "10.0.0.9"))
