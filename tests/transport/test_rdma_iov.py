"""rdma head-sliced writes (strided 2 KiB source slices into adjacent whole destination
pages, the TP1 -> TP2 case): bit-exact, and a write whose adjacent ops run one page past
the grant lands nothing (authorization is per op, however the rows travel)."""

from __future__ import annotations

import pytest
import torch

from pdgrpc.kvpoll import KVPoll
from pdgrpc.transport import registry
from pdgrpc.transport.pages import METADATA_REGION_ID, head_slice_ops, metadata_op, region_pairs
from pdgrpc.transport.testing.peer import Layout, PeerProcess, digest

pytest.importorskip("libucx", reason="the rdma backend needs the UCX libraries of the ucx extra: pip install 'pdgrpc[ucx]'")

WAIT_S = 30.0


async def test_head_sliced_write_is_bit_exact_and_out_of_grant_neighbours_land_nothing() -> None:
    heads, half, tokens, dim = 2, 1, 16, 64
    src_layout = Layout(layers=2, pages=96, page_shape=(heads, tokens, dim), slots=4)
    dst_layout = Layout(layers=2, pages=96, page_shape=(heads - half, tokens, dim), slots=4)
    head_bytes = src_layout.page_bytes // heads
    regions, flats = src_layout.build(7)
    send = registry.create("rdma")
    await send.register(regions)
    try:
        async with PeerProcess("rdma", layout=dst_layout) as recv:
            peer = await send.connect(recv.descriptor)
            pairs = region_pairs(regions, peer.descriptor.regions)
            dmeta = peer.descriptor.region(METADATA_REGION_ID)
            src, dst = list(range(3, 83)), list(range(10, 90))  # strided sources, adjacent destinations
            ops = head_slice_ops(pairs, src, dst, src_heads=(0, heads), dst_heads=(half, heads),
                                 heads=(half, heads), head_bytes=head_bytes)
            await recv.call("advertise", 2, dst, 0)
            await send.write(peer, 2, ops, metadata=metadata_op(regions[-1], 0, dmeta, 0))
            assert (await send.wait(2, WAIT_S)).state is KVPoll.SUCCESS
            want = digest(torch.cat([flats[r].view(-1, src_layout.page_bytes)[src, half * head_bytes:].reshape(-1)
                                     for r in src_layout.kv_region_ids()]))
            assert await recv.call("digest_pages", dst_layout.kv_region_ids(), dst) == want

            # Adjacent destination pages 90..93 (which would merge into one row), but
            # only 90..92 are granted: the room fails and not one byte lands.
            before = [await recv.call("digest", r) for r in dst_layout.kv_region_ids()]
            ops = head_slice_ops(pairs, [0, 1, 2, 3], [90, 91, 92, 93], src_heads=(0, heads),
                                 dst_heads=(half, heads), heads=(half, heads), head_bytes=head_bytes)
            await recv.call("advertise", 3, [90, 91, 92], 1)
            await send.write(peer, 3, ops, metadata=metadata_op(regions[-1], 0, dmeta, 1))
            st = await send.wait(3, WAIT_S)
            assert st.state is KVPoll.FAILED, st
            [(state, _reason)] = await recv.call("status", [3])
            assert state == KVPoll.FAILED
            assert [await recv.call("digest", r) for r in dst_layout.kv_region_ids()] == before
    finally:
        await send.close()
