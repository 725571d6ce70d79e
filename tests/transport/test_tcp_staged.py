"""tcp with device regions, staged through pinned buffers (tcp_device), on the CPU: the
device is simulated by marking KV regions as device memory and using plain buffers, so
the staged send and receive paths run for real over sockets (the CUDA run of the same
checks is the conformance suite's CUDA variant)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
import torch

from pdgrpc.errors import ConfigError
from pdgrpc.kvpoll import KVPoll
from pdgrpc.transport import registry, tcp_device
from pdgrpc.transport.base import RoomGrant
from pdgrpc.transport.memkind import MemoryKind
from pdgrpc.transport.pages import METADATA_REGION_ID, metadata_op, page_ops, region_pairs
from pdgrpc.transport.testing.peer import Layout
from pdgrpc.transport.tcp_device import TcpDevice

LAYOUT = Layout(layers=2, pages=48, page_shape=(16, 2, 64), slots=4, huge_pages=False)  # 4 KiB pages


@pytest.fixture
def kv_on_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """KV tensors (pages first, 4-D here) count as device memory; metadata rows (2-D) as host."""
    monkeypatch.setattr(tcp_device, "memory_kind", lambda t: MemoryKind.CUDA if t.dim() > 2 else MemoryKind.HOST)


class _HostOnly(TcpDevice):
    def add(self, region: Any) -> bool:
        return False


def _device(staged: bool) -> TcpDevice:
    # staged: small pieces that do not divide a page, so ranges split across pieces and frames
    return TcpDevice(piece_bytes=3000, buffers=2, alloc=lambda n: torch.zeros(n, dtype=torch.uint8)) if staged else _HostOnly()


def _tcp(staged: bool, **options: Any) -> Any:
    return registry.create("tcp", device=_device(staged), **options)


@pytest.mark.usefixtures("kv_on_device")
@pytest.mark.parametrize(("send_staged", "recv_staged", "connections"),
                         [(True, False, 1), (False, True, 1), (True, True, 1), (True, True, 3)])
async def test_staged_pages_arrive_bit_exact_and_the_row_last(send_staged: bool, recv_staged: bool, connections: int) -> None:
    src_regions, src = LAYOUT.build(seed=11)
    dst_regions, dst = LAYOUT.build(seed=None)
    send_device = _device(send_staged)
    a, b = registry.create("tcp", device=send_device, connections=connections), _tcp(recv_staged)
    rng = random.Random(connections)
    try:
        await a.register(src_regions)
        peer = await a.connect(await b.register(dst_regions))
        pairs = region_pairs(src_regions, peer.descriptor.regions)
        rooms = {}
        for slot, room in enumerate((501, 502, 503)):
            s_pages, d_pages = rng.sample(range(LAYOUT.pages), 12), list(range(slot * 16, slot * 16 + 12))
            rooms[room] = (s_pages, d_pages, slot)
            b.advertise(RoomGrant.of(room, d_pages, slot=slot))
        for room, (s_pages, d_pages, slot) in rooms.items():
            meta = metadata_op(src_regions[-1], slot, peer.descriptor.region(METADATA_REGION_ID), slot)
            await a.write(peer, room, page_ops(pairs, s_pages[:5], d_pages[:5]))  # two writes, then the row
            await a.write(peer, room, page_ops(pairs, s_pages[5:], d_pages[5:]), metadata=meta)
        for room in rooms:
            assert (await b.wait(room, 30)).state is KVPoll.SUCCESS
            assert (await a.wait(room, 30)).state is KVPoll.SUCCESS
        pb = LAYOUT.page_bytes
        for room, (s_pages, d_pages, slot) in rooms.items():
            for rid in LAYOUT.kv_region_ids():
                for s, d in zip(s_pages, d_pages):
                    assert torch.equal(dst[rid][d * pb : (d + 1) * pb], src[rid][s * pb : (s + 1) * pb]), (room, rid, s, d)
            rb = LAYOUT.row_bytes
            assert torch.equal(dst[METADATA_REGION_ID][slot * rb : (slot + 1) * rb], src[METADATA_REGION_ID][slot * rb : (slot + 1) * rb])
        if send_staged:
            assert send_device.send_high_water <= 2  # never more than the pool's buffers staged
    finally:
        await a.close()
        await b.close()


@pytest.mark.usefixtures("kv_on_device")
async def test_staged_receive_of_a_released_room_copies_nothing_more() -> None:
    src_regions, _ = LAYOUT.build(seed=5)
    dst_regions, dst = LAYOUT.build(seed=None)
    a, b = _tcp(False), _tcp(True)
    try:
        await a.register(src_regions)
        peer = await a.connect(await b.register(dst_regions))
        pages = list(range(8))
        b.advertise(RoomGrant.of(9, pages, slot=0))
        b.release(9)  # released before its bytes arrive: they are refused, nothing lands
        await a.write(peer, 9, page_ops(region_pairs(src_regions, peer.descriptor.regions), pages, pages))
        assert (await a.wait(9, 30)).state is KVPoll.FAILED
        assert not any(dst[rid].any() for rid in LAYOUT.kv_region_ids())
        # the connection is still in step: a fresh room on it works
        b.advertise(RoomGrant.of(10, [20], slot=1))
        meta = metadata_op(src_regions[-1], 1, peer.descriptor.region(METADATA_REGION_ID), 1)
        await a.write(peer, 10, page_ops(region_pairs(src_regions, peer.descriptor.regions), [3], [20]), metadata=meta)
        assert (await b.wait(10, 30)).state is KVPoll.SUCCESS
        pb = LAYOUT.page_bytes
        assert torch.equal(dst[0][20 * pb : 21 * pb], LAYOUT.source_bytes(0, 5)[3 * pb : 4 * pb])
    finally:
        await a.close()
        await b.close()


def test_a_device_that_is_not_a_stager_is_refused_naming_the_option() -> None:
    with pytest.raises(ConfigError, match="device must be a TcpDevice"):
        registry.create("tcp", device="cuda")


def test_metadata_rows_must_be_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tcp_device, "memory_kind", lambda t: MemoryKind.CUDA)
    regions, _ = LAYOUT.build(seed=None)
    with pytest.raises(ConfigError, match="metadata rows stay on the host"):
        for r in regions:
            TcpDevice().add(r)


@pytest.mark.usefixtures("kv_on_device")
async def test_staged_room_released_mid_frame_receives_no_more_bytes() -> None:
    """One large host frame into staged device regions; the room is released while it
    arrives: nothing lands after the release, and the connection stays in step."""
    layout = Layout(layers=2, pages=256, page_shape=(16, 16, 128), slots=2, huge_pages=False)  # 64 MiB
    src_regions, _ = layout.build(seed=5)
    dst_regions, dst = layout.build(seed=None)
    a = _tcp(False)
    b = registry.create("tcp", device=TcpDevice(piece_bytes=1 << 20, buffers=2, alloc=lambda n: torch.zeros(n, dtype=torch.uint8)))
    try:
        await a.register(src_regions)
        peer = await a.connect(await b.register(dst_regions))
        pages = list(range(layout.pages))
        b.advertise(RoomGrant.of(77, pages, slot=0))
        await a.write(peer, 77, page_ops(region_pairs(src_regions, peer.descriptor.regions), pages, pages))
        while b.poll(77) is not KVPoll.TRANSFERRING:
            await asyncio.sleep(0)
        b.release(77)
        at_release = {r: t.clone() for r, t in dst.items()}
        await a.write(peer, 77, [], metadata=metadata_op(src_regions[-1], 0, peer.descriptor.region(METADATA_REGION_ID), 0))
        st = await a.wait(77, 60)
        assert st.state is KVPoll.FAILED and "not advertised" in (st.reason or "")
        total = sum(int(t.count_nonzero()) for t in at_release.values())
        assert total < layout.kv_bytes // 2, "the whole room had landed before the release; nothing was tested"
        for r in dst:
            assert torch.equal(dst[r], at_release[r]), f"bytes landed in region {r} after its room was released"
        # the connection's staging buffers came back: the next room on it lands whole
        b.advertise(RoomGrant.of(78, [0, 1], slot=1))
        meta = metadata_op(src_regions[-1], 1, peer.descriptor.region(METADATA_REGION_ID), 1)
        await a.write(peer, 78, page_ops(region_pairs(src_regions, peer.descriptor.regions), [7, 9], [0, 1]), metadata=meta)
        assert (await b.wait(78, 60)).state is KVPoll.SUCCESS
        pb = layout.page_bytes
        assert torch.equal(dst[1][: 2 * pb], torch.cat([layout.source_bytes(1, 5)[p * pb : (p + 1) * pb] for p in (7, 9)]))
    finally:
        await a.close()
        await b.close()
