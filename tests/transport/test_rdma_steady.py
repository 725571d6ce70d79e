"""rdma: an op of ``contiguous_min`` bytes or more travels as a contiguous message of its
own (UCX's one-copy cma path between processes on one host, which stays fast on a busy
host), small ops keep sharing scatter/gather messages; a write mixing both lands
bit-exact (issue 19)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdgrpc.errors import ConfigError
from pdgrpc.kvpoll import KVPoll
from pdgrpc.transport import registry
from pdgrpc.transport.pages import METADATA_REGION_ID, metadata_op, page_ops, region_pairs
from pdgrpc.transport.testing.peer import Layout, PeerProcess, digest
from pdgrpc.transport.rdma_wire import plan_chunk

pytest.importorskip("libucx", reason="the rdma backend needs the UCX libraries of the ucx extra: pip install 'pdgrpc[ucx]'")

WAIT_S = 30.0


def _table(lengths: list[int]) -> np.ndarray:
    """Op rows (src region, src offset, dst region, dst offset, length), back to back."""
    off = np.r_[0, np.cumsum(lengths)[:-1]]
    return np.array([[0, o, 0, o, n] for o, n in zip(off, lengths)], dtype=np.int64)


def test_large_ops_travel_alone_and_small_ones_share_messages() -> None:
    ptrs = np.zeros(1 << 16, dtype=np.uint64)
    # 3 pages, a 2 MiB run, 2 pages, two 2 MiB runs, 1 page
    lengths = [4096] * 3 + [2 << 20] + [4096] * 2 + [2 << 20] * 2 + [4096]
    plan = plan_chunk(_table(lengths), ptrs, 16 << 20, 4096, 256 << 10)
    assert plan is not None and plan.counts == [3, 1, 2, 1, 1, 1]
    # without the threshold (contiguous_min=0 on the transport), all of it shares one iov message
    assert plan_chunk(_table(lengths), ptrs, 16 << 20, 4096, None).counts == [9]  # type: ignore[union-attr]
    # iov_max still splits the small ops' messages
    assert plan_chunk(_table([4096] * 5), ptrs, 16 << 20, 2, 256 << 10).counts == [2, 2, 1]  # type: ignore[union-attr]


def test_a_negative_contiguous_min_is_refused_naming_the_option() -> None:
    with pytest.raises(ConfigError, match="contiguous_min"):
        registry.create("rdma", contiguous_min=-1)


async def _write_and_check(layout: Layout, seed: int, src: list[int], dst: list[int], room: int,
                           row_slots: tuple[int, int]) -> None:
    """Write pages ``src`` into a peer process's pages ``dst`` (row slot ``row_slots[0]``
    into ``row_slots[1]``) with contiguous_min 64 KiB; assert the room succeeded and
    the destination pages equal the source pages."""
    regions, flats = layout.build(seed)
    send = registry.create("rdma", contiguous_min=64 << 10)
    await send.register(regions)
    try:
        async with PeerProcess("rdma", layout=layout) as recv:
            peer = await send.connect(recv.descriptor)
            await recv.call("advertise", room, dst, row_slots[1])
            ops = page_ops(region_pairs(regions, peer.descriptor.regions), src, dst)
            dmeta = peer.descriptor.region(METADATA_REGION_ID)
            await send.write(peer, room, ops, metadata=metadata_op(regions[-1], row_slots[0], dmeta, row_slots[1]))
            assert (await send.wait(room, WAIT_S)).state is KVPoll.SUCCESS
            want = digest(torch.cat([flats[r].view(-1, layout.page_bytes)[src].reshape(-1)
                                     for r in layout.kv_region_ids()]))
            assert await recv.call("digest_pages", layout.kv_region_ids(), dst) == want
            row = layout.row_bytes
            s0, s1 = row_slots
            assert await recv.call("read", METADATA_REGION_ID, s1 * row, (s1 + 1) * row) == \
                flats[METADATA_REGION_ID][s0 * row : (s0 + 1) * row].numpy().tobytes()
    finally:
        await send.close()


async def test_a_write_mixing_long_runs_and_single_pages_is_bit_exact() -> None:
    # 4 KiB pages; runs of 24 pages (96 KiB) travel alone with contiguous_min=64 KiB
    layout = Layout(layers=2, pages=96, page_shape=(2, 16, 64), slots=4)
    src = list(range(0, 24)) + [40, 30, 50] + list(range(60, 84))
    dst = list(range(70, 94)) + [0, 5, 9] + list(range(10, 34))
    await _write_and_check(layout, 11, src, dst, room=2, row_slots=(0, 0))


async def test_a_write_of_long_runs_only_lands_bit_exact_row_included() -> None:
    # Every op travels alone (the contiguous case: one op per message on both sides),
    # and the metadata row is committed after them.
    layout = Layout(layers=2, pages=96, page_shape=(2, 16, 64), slots=4)
    assert plan_chunk(_table([24 * layout.page_bytes] * 4), np.zeros(1 << 16, dtype=np.uint64), 16 << 20, 4096,
                      64 << 10).counts == [1, 1, 1, 1]  # type: ignore[union-attr]
    await _write_and_check(layout, 12, list(range(0, 24)), list(range(50, 74)), room=3, row_slots=(1, 2))


def test_quiet_sends_takes_on_or_off_and_refuses_anything_else() -> None:
    with pytest.raises(ConfigError, match="quiet_sends must be 1 .on. or 0 .off., got 2"):
        registry.create("rdma", quiet_sends=2)
    with pytest.raises(ConfigError, match="known: .*quiet_sends"):
        registry.create("rdma", quiet_send=1)


@pytest.mark.parametrize("quiet", [1, 0], ids=["quiet-sends", "armed-sends"])
async def test_back_to_back_large_writes_land_bit_exact_with_or_without_quiet_sends(quiet: int) -> None:
    """Writes of 1 MiB runs (contiguous messages, one batch per write): with quiet_sends
    (the default) the first write teaches the sender the peer's rate, from which later
    writes' quiet windows are sized (their timing: tests/transport/test_ucx_quiet.py),
    and both writes land bit-exact either way."""
    layout = Layout(layers=2, pages=512, page_shape=(2, 16, 64), slots=4)  # 4 KiB pages, 2 MiB regions
    regions, flats = layout.build(21)
    send = registry.create("rdma", quiet_sends=quiet)
    await send.register(regions)
    try:
        async with PeerProcess("rdma", layout=layout) as recv:
            peer = await send.connect(recv.descriptor)
            pairs = region_pairs(regions, peer.descriptor.regions)
            dmeta = peer.descriptor.region(METADATA_REGION_ID)
            for room, (src, dst) in enumerate([(range(0, 256), range(256, 512)), (range(256, 512), range(0, 256))],
                                              start=5):
                await recv.call("advertise", room, list(dst), 0)
                await send.write(peer, room, page_ops(pairs, list(src), list(dst)),
                                 metadata=metadata_op(regions[-1], 0, dmeta, 0))
                if room == 6:  # the first write taught the sender how fast this peer reads
                    window = send.worker.quiet
                    assert (window is not None and window.learned) is bool(quiet)
                assert (await send.wait(room, WAIT_S)).state is KVPoll.SUCCESS
                want = digest(torch.cat([flats[r].view(-1, layout.page_bytes)[list(src)].reshape(-1)
                                         for r in layout.kv_region_ids()]))
                assert await recv.call("digest_pages", layout.kv_region_ids(), list(dst)) == want
                send.release(room)
                await recv.call("release", room)
    finally:
        await send.close()
