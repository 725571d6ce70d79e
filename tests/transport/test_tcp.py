"""tcp-specific behaviour beyond the conformance suite: a restarted peer on the same
port, a room released while its bytes are arriving, and junk on the socket."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import torch

from pdgrpc.errors import PeerFailure
from pdgrpc.kvpoll import KVPoll
from pdgrpc.transport import registry
from pdgrpc.transport.base import Descriptor, RoomGrant
from pdgrpc.transport.pages import METADATA_REGION_ID, metadata_op, page_ops, region_pairs
from pdgrpc.transport.testing.peer import Layout, PeerProcess, digest
from pdgrpc.transport.tcp_wire import HEADER


async def _until(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0)


async def test_restarted_peer_on_the_same_port_is_never_served_by_the_old_connection() -> None:
    layout = Layout(layers=2, pages=16, slots=4)
    regions, _ = layout.build(seed=3)
    send = registry.create("tcp")
    await send.register(regions)
    try:
        first = PeerProcess("tcp", layout=layout)
        await first.start()
        try:
            peer = await send.connect(first.descriptor)
            port = int(Descriptor.from_bytes(first.descriptor).endpoint.decode().rpartition(":")[2])
            first.kill()
            await first.wait_dead()
        finally:
            await first.stop()
        async with PeerProcess("tcp", layout=layout, options={"port": port}) as second:
            assert Descriptor.from_bytes(second.descriptor).endpoint == Descriptor.from_bytes(first.descriptor).endpoint
            # The old instance's descriptor reaches the new process's port, which refuses
            # to be taken for the old instance.
            with pytest.raises(PeerFailure, match="refused|cannot connect|lost|closed"):
                await send.connect(first.descriptor)
            # The old cached peer handle is dead too: a write through it fails at once.
            await send.write(peer, 9, [])
            assert send.poll(9) is KVPoll.FAILED
            fresh = await send.connect(second.descriptor)
            assert fresh.instance_id == second.instance_id != peer.instance_id
            pairs = region_pairs(regions, fresh.descriptor.regions)
            await second.call("advertise", 10, [4, 5], 1)
            await send.write(fresh, 10, page_ops(pairs, [0, 1], [4, 5]),
                             metadata=metadata_op(regions[-1], 0, fresh.descriptor.region(METADATA_REGION_ID), 1))
            assert (await send.wait(10, 30)).state is KVPoll.SUCCESS
            pb = layout.page_bytes
            assert await second.call("digest", 0, 4 * pb, 6 * pb) == digest(layout.source_bytes(0, 3)[0 : 2 * pb])
    finally:
        await send.close()


async def test_room_released_mid_payload_receives_no_more_bytes() -> None:
    # 2 layers x K/V x 256 pages of 64 KiB = 64 MiB in one room, both ends in this loop.
    layout = Layout(layers=2, pages=256, page_shape=(16, 16, 128), slots=2)
    src_regions, _ = layout.build(seed=5)
    dst_regions, dst = layout.build(seed=None)
    a, b = registry.create("tcp"), registry.create("tcp")
    try:
        await a.register(src_regions)
        peer = await a.connect(await b.register(dst_regions))
        pages = list(range(layout.pages))
        b.advertise(RoomGrant.of(77, pages, slot=0))
        pairs = region_pairs(src_regions, peer.descriptor.regions)
        await a.write(peer, 77, page_ops(pairs, pages, pages))
        await _until(lambda: b.poll(77) is KVPoll.TRANSFERRING)
        b.release(77)  # e.g. the decode request was aborted: these pages go back to the pool
        at_release = {r: t.clone() for r, t in dst.items()}
        # The sender finishes the room; its metadata frame queues behind every page frame
        # on the same socket, so once it is rejected all page bytes have been handled.
        await a.write(peer, 77, [], metadata=metadata_op(src_regions[-1], 0, peer.descriptor.region(METADATA_REGION_ID), 0))
        st = await a.wait(77, 60)
        assert st.state is KVPoll.FAILED and "not advertised" in (st.reason or "")
        total = sum(int(t.count_nonzero()) for t in at_release.values())
        assert total < layout.kv_bytes // 2, "the whole room had landed before the release; nothing was tested"
        for r in dst:
            assert torch.equal(dst[r], at_release[r]), f"bytes landed in region {r} after its room was released"
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize(
    "junk",
    [
        bytes([99]) + bytes(31),  # unknown frame type
        bytes([4, 0, 0, 0, 1, 0, 0, 0]) + bytes(24),  # WRITE before HELLO
    ],
)
async def test_junk_on_the_socket_drops_only_that_connection(junk: bytes) -> None:
    layout = Layout(layers=1, pages=8, slots=2)
    src_regions, _ = layout.build(seed=1)
    dst_regions, _ = layout.build(seed=None)
    a, b = registry.create("tcp"), registry.create("tcp")
    try:
        await a.register(src_regions)
        desc = await b.register(dst_regions)
        peer = await a.connect(desc)
        host, _, port = Descriptor.from_bytes(desc).endpoint.decode().rpartition(":")
        loop = asyncio.get_running_loop()
        raw = socket.socket()
        raw.setblocking(False)
        await loop.sock_connect(raw, (host, int(port)))
        await loop.sock_sendall(raw, junk)
        got = b""
        while chunk := await asyncio.wait_for(loop.sock_recv(raw, 4096), 10):
            got += chunk  # the receiver's CHALLENGE, then nothing
        assert len(got) == HEADER.size + 16  # receiver hung up
        raw.close()
        b.advertise(RoomGrant.of(5, [1], slot=1))
        pairs = region_pairs(src_regions, peer.descriptor.regions)
        await a.write(peer, 5, page_ops(pairs, [2], [1]),
                      metadata=metadata_op(src_regions[-1], 0, peer.descriptor.region(METADATA_REGION_ID), 1))
        assert (await a.wait(5, 30)).state is KVPoll.SUCCESS
        assert (await b.wait(5, 30)).state is KVPoll.SUCCESS
    finally:
        await a.close()
        await b.close()


def test_writes_are_cut_into_frames_under_both_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    # The receiver refuses a frame announcing more than MAX_FRAME_PAYLOAD bytes, so the
    # sender cuts ops (and an op itself) to fit; the pieces cover every byte once, in order.
    import numpy as np

    from pdgrpc.transport import tcp_wire

    monkeypatch.setattr(tcp_wire, "MAX_FRAME_PAYLOAD", 100)
    monkeypatch.setattr(tcp_wire, "MAX_OPS_PER_FRAME", 3)
    ops = np.array([[0, 0, 1, 0, 250], [0, 250, 1, 1000, 30], [0, 300, 1, 2000, 60]]
                   + [[0, 400 + i, 1, 3000 + i, 1] for i in range(5)], dtype=np.int64)
    frames = list(tcp_wire.frame_chunks(ops))
    assert all(len(f) <= 3 and int(f[:, 4].sum()) <= 100 for f in frames)
    rows = np.concatenate(frames)
    src = [(o, o + n) for o, n in zip(rows[:, 1].tolist(), rows[:, 4].tolist())]
    dst = [(o, o + n) for o, n in zip(rows[:, 3].tolist(), rows[:, 4].tolist())]
    assert src[:3] == [(0, 100), (100, 200), (200, 250)] and dst[:3] == [(0, 100), (100, 200), (200, 250)]
    assert int(rows[:, 4].sum()) == int(ops[:, 4].sum()) and rows[3:].tolist() == ops[1:].tolist()
