"""Shared pieces of the prefill process tests: the engine config, prompts, requests,
and one request driven the way decode and router drive it."""

from __future__ import annotations

import asyncio
import random

import grpc

from pdgrpc.engine.base import SamplingParams
from pdgrpc.engine.config import EngineConfig
from pdgrpc.prefill.cli import build_parser
from pdgrpc.serving.flags import engine_config_from_args
from pdgrpc.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from tests.eventually import eventually_async
from tests.prefill.fake_decode import FakeDecode, KVPoll, Room, room_secret
from tests.prefill.procs import ENGINE_FLAGS, PrefillProc

CONFIG: EngineConfig = engine_config_from_args(build_parser().parse_args(ENGINE_FLAGS))
SETTLE_S = 15.0


def new_room() -> int:
    return random.getrandbits(62) + 1


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [256] + [rng.randrange(256) for _ in range(n - 1)]  # BOS, then bytes


async def prefill_stub(p: PrefillProc) -> tuple[grpc.aio.Channel, prefill_pb2_grpc.PrefillServiceStub]:
    ch = grpc.aio.insecure_channel(p.address)
    return ch, prefill_pb2_grpc.PrefillServiceStub(ch)


def sampling_to_proto(params: SamplingParams, max_new_tokens: int = 1) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=params.seed,
        top_logprobs=params.top_logprobs,
        max_new_tokens=max_new_tokens,
        ignore_eos=params.ignore_eos,
    )


def request(room: int, ids: list[int], sampling: SamplingParams = SamplingParams(), routed: int | None = None) -> prefill_pb2.PrefillRequest:
    r = prefill_pb2.PrefillRequest(
        bootstrap_room=room, request_id=f"t{room}", input_ids=ids, sampling=sampling_to_proto(sampling, 4), room_secret=room_secret(room)
    )
    if routed is not None:
        r.routed_dp_rank = routed
    return r


async def assert_settles_to_zero(p: PrefillProc, dp_size: int = 2) -> None:
    """The instance's own GetStats (summed over workers) reaches all-zero usage, bounded."""
    ch, stub = await prefill_stub(p)
    try:
        last: list[common_pb2.ResourceStats] = []

        async def idle() -> bool:
            last[:] = [(await stub.GetStats(prefill_pb2.GetStatsRequest(), timeout=5)).stats]
            return (last[0].active_requests, last[0].pages_in_use, last[0].transport_rooms) == (0, 0, 0)

        await eventually_async(idle, SETTLE_S, what="prefill released everything", interval=0.05)
        assert last[0].pages_total == dp_size * CONFIG.num_pages
    finally:
        await ch.close()


async def run_one(p: PrefillProc, d: FakeDecode, ids: list[int], sampling: SamplingParams, *, query: bool,
                  routed: int | None = None, handshake_first: bool = False, dp_size: int = 2) -> tuple[prefill_pb2.PrefillResponse, Room]:
    """One request the way decode + router drive it; returns (prefill response, decode room)."""
    room = new_room()
    r = d.allocate(room, len(ids))
    ch, stub = await prefill_stub(p)
    try:
        if handshake_first:  # the rank is known up front (routed), so decode can be first
            assert routed is not None
            workers = await d.workers(p.bootstrap, routed)
            await d.handshake(workers[0].transfer_address, r)
            call = asyncio.ensure_future(stub.Prefill(request(room, ids, sampling, routed), timeout=60))
        else:
            call = asyncio.ensure_future(stub.Prefill(request(room, ids, sampling, routed), timeout=60))
            worker = await d.worker_for(p.bootstrap, room, query=query, dp_size=dp_size) if routed is None else \
                (await d.workers(p.bootstrap, routed))[0].transfer_address
            await d.handshake(worker, r)
        resp = await call
        st = await d.wait(r)
        assert st.state is KVPoll.SUCCESS, st.reason
        return resp, r
    finally:
        await ch.close()


async def active_requests(stub: prefill_pb2_grpc.PrefillServiceStub) -> int:
    return (await stub.GetStats(prefill_pb2.GetStatsRequest())).stats.active_requests


async def hold_on_dp1(
    stub: prefill_pb2_grpc.PrefillServiceStub, ids: list[int]
) -> "tuple[int, asyncio.Future[prefill_pb2.PrefillResponse]]":
    """A Prefill pinned to dp1 that will wait there for a handshake nobody sends: its room
    and call, once the worker holds it (the instance reports an active request)."""
    room = new_room()
    held = asyncio.ensure_future(stub.Prefill(request(room, ids, routed=1), timeout=60))
    await eventually_async(lambda: active_requests(stub), 15, what="the request reached worker dp1")
    return room, held


def assert_landed_bit_exact(d: FakeDecode, r: Room, ids: list[int], sampling: SamplingParams) -> None:
    """The decode's pages hold exactly the KV a local prefill of ``ids`` computes, and its
    metadata row the same first token and logprobs, with the room written."""
    import torch

    from tests.prefill.fake_decode import reference_prefill

    ref_engine, ref_pages, tok = reference_prefill(CONFIG, ids, sampling)
    got = d.kv_of(r.pages, len(ids))
    want = d.kv_of(ref_pages, len(ids), ref_engine)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"KV tensor {i} differs from a local prefill of the prompt"
    row = d.row(r)
    k = sampling.top_logprobs
    assert (row.output_id, row.output_token_logprob_value) == (tok.token_id, tok.logprob)
    assert row.top_logprobs_indices[:k] == tok.top_ids and row.top_logprobs_values[:k] == tok.top_logprobs
    assert d.rows.room(r.slot) == r.room
