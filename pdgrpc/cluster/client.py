"""A small GenerateService client: send one request, collect the whole stream.

Used by the demo, the end-to-end tests and ``bench e2e``::

    async with cluster.client_channel() as ch:
        done = await generate(GenerateServiceStub(ch), prompt="Hello", max_new_tokens=16)
        print(done.text, done.ttft_seconds, done.bytes_transferred)
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Mapping, Sequence

from pdgrpc.v1 import common_pb2, generate_pb2, generate_pb2_grpc

__all__ = ["Completion", "generate"]


@dataclasses.dataclass(frozen=True)
class Completion:
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    ttft_seconds: float  # as the router measured it (request arrival -> first token)
    client_ttft_seconds: float  # as this client saw it (call start -> first message)
    bytes_transferred: int
    transfer_seconds: float  # the decode's handshake -> commit (includes the prefill's compute)
    bootstrap_room: int
    messages: int
    data_plane_seconds: float = 0.0  # the first KV byte's arrival at the decode -> commit
    seed: int = 0  # the sampling seed the request ran with (sent, else drawn by the server)
    cached_tokens: int = 0  # prompt tokens the prefill reused from its prefix cache

    @property
    def gbps(self) -> float:
        """Data-plane rate, GB/s (10**9 bytes per second): bytes over
        ``data_plane_seconds``; 0 when nothing was timed."""
        return self.bytes_transferred / self.data_plane_seconds / 1e9 if self.data_plane_seconds > 0 else 0.0


async def generate(
    stub: generate_pb2_grpc.GenerateServiceStub,
    *,
    prompt: str = "",
    input_ids: Sequence[int] = (),
    messages: Sequence[Mapping[str, str]] = (),
    max_new_tokens: int = 16,
    temperature: float = 0.0,
    seed: int | None = None,
    top_k: int = 0,
    top_p: float = 0.0,
    ignore_eos: bool = False,
    routed_dp_rank: int | None = None,
    request_id: str = "",
    timeout: float | None = 120.0,
    metadata: Sequence[tuple[str, str]] | None = None,
    on_message: Callable[[generate_pb2.GenerateResponse], None] | None = None,
) -> Completion:
    """Run one Generate to the end; raises ``grpc.aio.AioRpcError`` on failure.
    ``messages``: a chat conversation (``{"role": ..., "content": ...}`` each) instead of
    ``prompt``. ``seed``: None lets the server draw one (``Completion.seed`` says which).
    ``metadata``: sent with the call (a W3C ``traceparent`` makes the request's spans part
    of that trace). ``on_message``: called with each message as it arrives."""
    request = generate_pb2.GenerateRequest(
        prompt=prompt,
        input_ids=list(input_ids),
        messages=[generate_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages],
        sampling=common_pb2.SamplingParams(
            temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos,
        ),
        request_id=request_id,
    )
    if seed is not None:
        request.sampling.seed = seed
    if routed_dp_rank is not None:
        request.routed_dp_rank = routed_dp_rank
    start = time.perf_counter()
    first_at = None
    ids: list[int] = []
    text: list[str] = []
    finish = ""
    first = None
    figures = None
    count = 0
    async for msg in stub.Generate(request, timeout=timeout, metadata=metadata):
        if first is None:
            first, first_at = msg, time.perf_counter()
        ids += msg.token_ids
        text.append(msg.text)
        finish = msg.finish_reason or finish
        count += 1
        if on_message is not None:
            on_message(msg)
        if figures is None and (msg.bytes_transferred or msg.transfer_seconds or msg.data_plane_seconds or msg.cached_tokens):
            figures = msg  # the relay of the decode's first message: the first, or the one after a token sent ahead
    assert first is not None and first_at is not None, "the router ends every successful stream after >= 1 message"
    kv = figures or first
    return Completion(
        token_ids=tuple(ids), text="".join(text), finish_reason=finish,
        ttft_seconds=first.ttft_seconds, client_ttft_seconds=first_at - start,
        bytes_transferred=kv.bytes_transferred, transfer_seconds=kv.transfer_seconds,
        bootstrap_room=first.bootstrap_room, messages=count, data_plane_seconds=kv.data_plane_seconds,
        seed=first.seed, cached_tokens=kv.cached_tokens,
    )
