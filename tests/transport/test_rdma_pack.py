"""Packed rdma data messages (pdgrpc.transport.rdma_pack): which messages are packed,
the gather and scatter, the byte budget, and a transfer that mixes packed messages with
iov messages, on host memory (the same code moves GPU memory; tests/transport
test_conformance's CUDA classes run it there)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
from typing import Callable

import numpy as np
import pytest
import torch

from pdgrpc.errors import ConfigError
from pdgrpc.kvpoll import KVPoll
from pdgrpc.transport import registry
from pdgrpc.transport.base import RoomGrant
from pdgrpc.transport.pages import METADATA_REGION_ID, metadata_op, page_ops, region_pairs
from pdgrpc.transport.rdma_pack import Pack, Packer
from pdgrpc.transport.rdma_regions import Regions
from pdgrpc.transport.testing.peer import Layout, PeerProcess

pytest.importorskip("libucx", reason="the rdma backend needs the UCX libraries of the ucx extra: pip install 'pdgrpc[ucx]'")

LAYOUT = Layout(layers=2, pages=64, page_shape=(16, 2, 64), slots=4, huge_pages=False)


def _regions(seed: int | None) -> tuple[Regions, dict[int, torch.Tensor]]:
    regions = Regions()
    built, flats = LAYOUT.build(seed)
    for r in built:
        regions.add(r)
    return regions, flats


def test_only_messages_of_several_ops_in_gpu_memory_are_packed_by_default() -> None:
    regions, _ = _regions(None)
    two, one = np.array([0, 1]), np.array([0])
    assert not Packer(regions, Pack.AUTO).wants(two)  # host memory: UCX moves its iov in place
    assert Packer(regions, Pack.ALWAYS).wants(two)
    assert not Packer(regions, Pack.ALWAYS).wants(one)  # one range is contiguous already
    assert not Packer(regions, Pack.NEVER).wants(two)


def test_gather_then_scatter_moves_every_range_and_the_budget_bounds_the_buffers() -> None:
    src, src_flats = _regions(3)
    dst, dst_flats = _regions(None)
    page = LAYOUT.page_bytes
    rng = random.Random(5)
    pages = rng.sample(range(LAYOUT.pages), 12)
    regions = np.array([r for r in (0, 1, 2, 3) for _ in pages], dtype=np.int64)
    offsets = np.array([p * page for _ in (0, 1, 2, 3) for p in pages], dtype=np.int64)
    lengths = np.full(len(regions), page, dtype=np.int64)
    nbytes = int(lengths.sum())
    sender = Packer(src, Pack.ALWAYS, budget=nbytes)
    got = sender.gather(regions, offsets, lengths)
    assert got is not None
    buf, ready = got
    assert ready.done() and buf.numel() == nbytes and sender.in_use == nbytes
    assert sender.gather(regions[:2], offsets[:2], lengths[:2]) is None  # over the budget: travels as iov
    receiver = Packer(dst, Pack.ALWAYS, budget=nbytes)
    into = receiver.receive_buffer(regions, nbytes)
    assert into is not None and receiver.receive_buffer(regions, 1) is None
    into.copy_(buf)
    assert receiver.scatter(into, regions, offsets, lengths).done()
    for r in (0, 1, 2, 3):
        for p in pages:
            assert torch.equal(dst_flats[r][p * page : (p + 1) * page], src_flats[r][p * page : (p + 1) * page])
    sender.give_back(nbytes)
    receiver.give_back(nbytes)
    assert sender.in_use == receiver.in_use == 0
    assert sender.gather(regions[:2], offsets[:2], lengths[:2]) is not None


def test_an_unknown_pack_mode_is_refused_naming_the_option() -> None:
    with pytest.raises(ConfigError, match="rdma: pack must be one of auto, always, never, got 'sometimes'"):
        registry.create("rdma", pack="sometimes")
    with pytest.raises(ConfigError, match="rdma: pack_max must be >= 0 bytes, got -1"):
        registry.create("rdma", pack_max=-1)


async def test_packed_and_iov_messages_mix_in_one_transfer_bit_exact() -> None:
    """Small messages (zero_copy_min) over scattered pages, every one packed on the
    sender, and a receiver whose budget holds only some of them at once: the rest are
    received as iov messages. Every byte lands where it was granted, and no packed
    buffer outlives the transfer."""
    src_regions, src_flats = LAYOUT.build(11)
    dst_regions, dst_flats = LAYOUT.build(None)
    page = LAYOUT.page_bytes
    send = registry.create("rdma", pack="always", zero_copy_min=4 * page, liveness_lease=30.0)
    recv = registry.create("rdma", pack="always", zero_copy_min=4 * page, pack_max=8 * page, liveness_lease=30.0)
    try:
        desc = await recv.register(dst_regions)
        await send.register(src_regions)
        peer = await send.connect(desc)
        rng = random.Random(9)
        src_pages = rng.sample(range(LAYOUT.pages), 40)
        dst_pages = rng.sample(range(LAYOUT.pages), 40)
        recv.advertise(RoomGrant.of(5, dst_pages, slot=2))
        pairs = region_pairs(src_regions, peer.descriptor.regions)
        meta = metadata_op(src_regions[-1], 1, peer.descriptor.region(METADATA_REGION_ID), 2)
        await send.write(peer, 5, page_ops(pairs, src_pages, dst_pages), metadata=meta)
        assert (await send.wait(5, 30.0)).state is KVPoll.SUCCESS
        assert (await recv.wait(5, 30.0)).state is KVPoll.SUCCESS
        for r in LAYOUT.kv_region_ids():
            for s, d in zip(src_pages, dst_pages):
                assert torch.equal(dst_flats[r][d * page : (d + 1) * page], src_flats[r][s * page : (s + 1) * page])
        row = LAYOUT.row_bytes
        assert torch.equal(dst_flats[METADATA_REGION_ID][2 * row : 3 * row], src_flats[METADATA_REGION_ID][row : 2 * row])
        assert send.packed_bytes == 0 and recv.packed_bytes == 0
    finally:
        await send.close()
        await recv.close()


async def test_packed_receives_of_a_sender_that_died_give_their_buffers_back() -> None:
    """A sender announces a write (the receiver posts its packed receives) and dies
    before its bytes go out: the room fails, and every packed buffer is given back, so
    a dead peer never shrinks the budget of the live ones."""
    page = LAYOUT.page_bytes
    dst_regions, _ = LAYOUT.build(None)
    recv = registry.create("rdma", pack="always", zero_copy_min=4 * page, liveness_lease=30.0)
    try:
        desc = await recv.register(dst_regions)
        async with PeerProcess("rdma", layout=LAYOUT, seed=3,
                               options={"pack": "always", "zero_copy_min": 4 * page}) as sender:
            await sender.call("connect", desc)
            recv.advertise(RoomGrant.of(8, range(0, 40, 2), slot=1))
            await sender.call("announce_pages", recv.instance_id, 8, list(range(20)), list(range(0, 40, 2)))
            await _until(lambda: recv.receives_posted(8) > 0)
            assert recv.packed_bytes > 0  # the receives are up, into packed buffers
            sender.kill()
            await sender.wait_dead()
            assert (await recv.wait(8, 30.0)).state is KVPoll.FAILED
            await _until(lambda: recv.writer_gone(sender.instance_id))
        assert recv.packed_bytes == 0
    finally:
        await recv.close()


async def test_packed_sends_to_a_hung_receiver_give_their_buffers_back_when_it_is_failed() -> None:
    """A receiver that stops answering holds the sender's packed sends (UCX cannot
    cancel a rendezvous send to a hung peer); once the control plane fails that peer,
    the sender gives every packed buffer back."""
    page = LAYOUT.page_bytes
    src_regions, _ = LAYOUT.build(5)
    send = registry.create("rdma", pack="always", zero_copy_min=4 * page, contiguous_min=0, liveness_lease=30.0)
    try:
        await send.register(src_regions)
        async with PeerProcess("rdma", layout=LAYOUT, options={"liveness_lease": 30.0}) as recv:
            peer = await send.connect(recv.descriptor)
            await recv.call("advertise", 9, list(range(0, 40, 2)), 1)
            os.kill(recv.pid, signal.SIGSTOP)
            try:
                pairs = region_pairs(src_regions, peer.descriptor.regions)
                await send.write(peer, 9, page_ops(pairs, range(20), range(0, 40, 2)))
                await _until(lambda: send.packed_bytes > 0)
                send.fail_peer(recv.instance_id, "the test stopped it")
                assert send.poll(9) is KVPoll.FAILED
                assert send.packed_bytes == 0
            finally:
                os.kill(recv.pid, signal.SIGCONT)
    finally:
        await send.close()


async def _until(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)
