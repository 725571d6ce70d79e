"""Head-sliced write ops (``pages.head_slice_ops``) for transfers between pools of
different TP sizes: real HND pool tensors, ops applied by a local byte copy and over the
real ``tcp`` transport, and the transport benchmark's head-sliced case."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from pdgrpc.errors import ConfigError
from pdgrpc.kvpoll import KVPoll
from pdgrpc.serving.tp import METADATA_SINK_REGION_ID, heads_of, transfer_room
from pdgrpc.transport import registry
from pdgrpc.transport.base import MemoryRegion, RegionKind, RoomGrant, WriteOps
from pdgrpc.transport.pages import (
    METADATA_REGION_ID,
    head_slice_ops,
    kv_regions,
    metadata_op,
    metadata_region,
    page_ops,
    region_pairs,
)

H = 4  # model KV heads
PAGE_SIZE = 4  # tokens per page
HEAD_DIM = 8
LAYERS = 3
DTYPE = torch.float16
HEAD_BYTES = PAGE_SIZE * HEAD_DIM * torch.empty((), dtype=DTYPE).element_size()


def _truth(num_pages: int, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Full-model K and V pools (all H heads), HND: ``[pages, heads, page_size, head_dim]``."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_pages, H, PAGE_SIZE, HEAD_DIM)
    ks = [torch.randn(shape, generator=g).to(DTYPE) for _ in range(LAYERS)]
    vs = [torch.randn(shape, generator=g).to(DTYPE) for _ in range(LAYERS)]
    return ks, vs


def _pool(ks: list[torch.Tensor], vs: list[torch.Tensor], heads: tuple[int, int]):
    """The pool of a rank holding global ``heads`` (its own contiguous tensors)."""
    k = [t[:, heads[0] : heads[1]].contiguous() for t in ks]
    v = [t[:, heads[0] : heads[1]].contiguous() for t in vs]
    return k, v, kv_regions(k, v)


def _empty_pool(num_pages: int, heads: tuple[int, int], fill: float = 0.0):
    shape = (num_pages, heads[1] - heads[0], PAGE_SIZE, HEAD_DIM)
    k = [torch.full(shape, fill, dtype=DTYPE) for _ in range(LAYERS)]
    v = [torch.full(shape, fill, dtype=DTYPE) for _ in range(LAYERS)]
    return k, v, kv_regions(k, v)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _apply(ops: WriteOps, src_regions: list[MemoryRegion], dst_regions: list[MemoryRegion]) -> None:
    """Execute write ops with a plain local byte copy."""
    src = {r.region_id: _bytes(r.tensor) for r in src_regions}
    dst = {r.region_id: _bytes(r.tensor) for r in dst_regions}
    for op in ops:
        dst[op.dst_region][op.dst_offset : op.dst_offset + op.length] = src[op.src_region][
            op.src_offset : op.src_offset + op.length
        ]


def _all(k: list[torch.Tensor], v: list[torch.Tensor]) -> list[torch.Tensor]:
    return [*k, *v]


def _ops(pairs, src_pages, dst_pages, src_heads, dst_heads, heads) -> WriteOps:
    return head_slice_ops(pairs, src_pages, dst_pages, src_heads=src_heads, dst_heads=dst_heads, heads=heads,
                          head_bytes=HEAD_BYTES)


# --------------------------------------------------------------------------- local copies


@pytest.mark.parametrize(
    "src_heads, dst_heads, heads",
    [
        ((0, 4), (2, 4), (2, 4)),  # TP1 -> rank 1 of TP2: the source's second half -> whole pages
        ((0, 4), (0, 2), (0, 2)),  # TP1 -> rank 0 of TP2
        ((2, 4), (0, 4), (2, 4)),  # rank 1 of TP2 -> TP1: whole pages -> second half
        ((1, 4), (2, 4), (2, 3)),  # a sub-slice at a different offset on each side
    ],
)
def test_head_slice_lands_exactly_and_nowhere_else(src_heads, dst_heads, heads) -> None:
    num_pages = 10
    ks, vs = _truth(num_pages)
    sk, sv, src_regions = _pool(ks, vs, src_heads)
    dk, dv, dst_regions = _empty_pool(num_pages, dst_heads, fill=-7.0)
    before = [t.clone() for t in _all(dk, dv)]
    src_pages, dst_pages = [1, 2, 3, 7, 0], [4, 5, 6, 0, 9]  # a run and scattered pages
    ops = _ops(region_pairs(src_regions, dst_regions), src_pages, dst_pages, src_heads, dst_heads, heads)
    assert len(ops) == 2 * LAYERS * len(src_pages)  # one op per page per region pair (strided)
    assert ops.nbytes == 2 * LAYERS * len(src_pages) * (heads[1] - heads[0]) * HEAD_BYTES
    _apply(ops, src_regions, dst_regions)

    sl_dst = slice(heads[0] - dst_heads[0], heads[1] - dst_heads[0])
    for got, was, truth in zip(_all(dk, dv), before, _all(ks, vs)):
        # the destination pages hold exactly the model's heads [h0, h1) of the source pages
        assert torch.equal(got[dst_pages, sl_dst], truth[src_pages, heads[0] : heads[1]])
        # and nothing else changed: other heads of those pages, and every other page
        expect = was.clone()
        expect[dst_pages, sl_dst] = truth[src_pages, heads[0] : heads[1]]
        assert torch.equal(got, expect)


def test_tp2_to_tp1_two_sources_fill_the_destination() -> None:
    num_pages = 8
    ks, vs = _truth(num_pages, seed=1)
    dk, dv, dst_regions = _empty_pool(num_pages, (0, H))
    src_pages, dst_pages = [0, 1, 2, 5], [3, 4, 5, 7]
    for rank in range(2):
        heads = heads_of(rank, 2, H)
        _, _, src_regions = _pool(ks, vs, heads)
        ops = _ops(region_pairs(src_regions, dst_regions), src_pages, dst_pages, heads, (0, H), heads)
        _apply(ops, src_regions, dst_regions)
    untouched = [p for p in range(num_pages) if p not in dst_pages]
    for got, truth in zip(_all(dk, dv), _all(ks, vs)):
        assert torch.equal(got[dst_pages], truth[src_pages])
        assert not got[untouched].any()


def test_tp1_to_tp2_one_source_fills_two_destinations() -> None:
    num_pages = 8
    ks, vs = _truth(num_pages, seed=2)
    _, _, src_regions = _pool(ks, vs, (0, H))
    src_pages, dst_pages = [6, 7, 0], [0, 1, 2]
    for rank in range(2):
        heads = heads_of(rank, 2, H)
        dk, dv, dst_regions = _empty_pool(num_pages, heads)
        ops = _ops(region_pairs(src_regions, dst_regions), src_pages, dst_pages, (0, H), heads, heads)
        _apply(ops, src_regions, dst_regions)
        for got, truth in zip(_all(dk, dv), _all(ks, vs)):
            assert torch.equal(got[dst_pages], truth[src_pages, heads[0] : heads[1]])
            assert not got[3:].any()


def test_whole_page_slice_is_exactly_page_ops() -> None:
    ks, vs = _truth(16)
    _, _, src_regions = _pool(ks, vs, (2, 4))
    _, _, dst_regions = _empty_pool(16, (2, 4))
    pairs = region_pairs(src_regions, dst_regions)
    src_pages, dst_pages = [0, 1, 2, 3, 9, 10, 4], [5, 6, 7, 8, 1, 2, 15]
    got = _ops(pairs, src_pages, dst_pages, (2, 4), (2, 4), (2, 4))
    want = page_ops(pairs, src_pages, dst_pages)
    assert isinstance(got, WriteOps)
    assert np.array_equal(got.array, want.array)
    assert len(got) == 3 * 2 * LAYERS  # coalesced runs: [0..3], [9, 10], [4]
    # the pairs may be any iterable (a generator is consumed once)
    again = _ops(iter(pairs), src_pages, dst_pages, (2, 4), (2, 4), (2, 4))
    assert np.array_equal(again.array, want.array)


def test_op_order_and_offsets() -> None:
    ks, vs = _truth(4)
    _, _, src_regions = _pool(ks, vs, (0, 4))
    _, _, dst_regions = _empty_pool(4, (1, 3))
    pairs = region_pairs(src_regions, dst_regions)
    ops = _ops(pairs, [2, 3], [0, 1], (0, 4), (1, 3), (2, 3))
    spb, dpb = 4 * HEAD_BYTES, 2 * HEAD_BYTES
    want = []
    for s, d in pairs:  # region pair by region pair, then page by page
        for sp, dp in ((2, 0), (3, 1)):
            want.append((s.region_id, sp * spb + 2 * HEAD_BYTES, d.region_id, dp * dpb + 1 * HEAD_BYTES, HEAD_BYTES))
    assert [tuple(op) for op in ops] == want


def test_empty_page_lists_and_no_pairs() -> None:
    ks, vs = _truth(4)
    _, _, src_regions = _pool(ks, vs, (0, 4))
    _, _, dst_regions = _empty_pool(4, (2, 4))
    assert len(_ops(region_pairs(src_regions, dst_regions), [], [], (0, 4), (2, 4), (2, 4))) == 0
    assert len(_ops([], [1], [1], (0, 4), (2, 4), (2, 4))) == 0


def test_many_ops_are_built_vectorized() -> None:
    """~100k ops (48 region pairs x 2048 scattered pages) come back as one array."""
    from pdgrpc.transport.base import RegionInfo

    src = [RegionInfo(i, f"s{i}", RegionKind.KV, 4096 * 4096, 4096) for i in range(48)]
    dst = [RegionInfo(i, f"d{i}", RegionKind.KV, 2048 * 4096, 2048) for i in range(48)]
    rng = np.random.default_rng(0)
    sp, dp = rng.permutation(4096)[:2048], rng.permutation(4096)[:2048]
    ops = head_slice_ops(list(zip(src, dst)), sp, dp, src_heads=(0, 2), dst_heads=(1, 2), heads=(1, 2),
                         head_bytes=2048)
    assert len(ops) == 48 * 2048
    a = ops.array
    assert (a[:, 4] == 2048).all() and (a[:, 1] % 4096 == 2048).all() and (a[:, 3] % 2048 == 0).all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(src_heads=(0, 2), dst_heads=(0, 4), heads=(1, 3)), "not inside the source"),
        (dict(src_heads=(0, 4), dst_heads=(2, 4), heads=(1, 3)), "not inside the destination"),
        (dict(src_heads=(0, 4), dst_heads=(2, 4), heads=(3, 3)), "empty"),
        (dict(src_heads=(0, 4), dst_heads=(4, 2), heads=(2, 4)), "empty"),
        (dict(src_heads=(0, 4), dst_heads=(2, 4), heads=(2, 4), head_bytes=0), "head_bytes"),
        (dict(src_heads=(0, 2), dst_heads=(2, 4), heads=(2, 4)), "not inside the source"),
        # the pools hold heads [0, 4) and [2, 4); declared otherwise, the page sizes disagree
        (dict(src_heads=(1, 4), dst_heads=(2, 4), heads=(2, 4)), "source region .* page size does not match"),
        (dict(src_heads=(0, 4), dst_heads=(1, 4), heads=(2, 4)), "destination region .* page size does not match"),
        (dict(src_heads=(0, 4), dst_heads=(2, 4), heads=(2, 4), head_bytes=HEAD_BYTES // 2), "page size does not match"),
        (dict(src_heads=(0, 4), dst_heads=(2, 4), heads=(2, 4), src_pages=[1, 2], dst_pages=[1]), "differ in length"),
        (dict(src_heads=(0, 4), dst_heads=(2, 4), heads=(2, 4), src_pages=[-1], dst_pages=[1]), ">= 0"),
        (dict(src_heads=(0, 4), dst_heads=(2, 4), heads=(2, 4), src_pages=[1], dst_pages=[-3]), ">= 0"),
    ],
)
def test_errors(kwargs, match) -> None:
    ks, vs = _truth(4)
    _, _, src_regions = _pool(ks, vs, (0, 4))
    _, _, dst_regions = _empty_pool(4, (2, 4))
    args = dict(src_pages=[0, 1], dst_pages=[2, 3], head_bytes=HEAD_BYTES)
    args.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        head_slice_ops(region_pairs(src_regions, dst_regions), **args)


def test_whole_page_errors_match_page_ops() -> None:
    ks, vs = _truth(4)
    _, _, src_regions = _pool(ks, vs, (0, 4))
    _, _, dst_regions = _empty_pool(4, (0, 4))
    pairs = region_pairs(src_regions, dst_regions)
    for s, d, match in (([0, 1], [0], "differ in length"), ([0, -1], [0, 1], ">= 0")):
        with pytest.raises(ConfigError, match=match):
            _ops(pairs, s, d, (0, 4), (0, 4), (0, 4))


# --------------------------------------------------------------------------- over tcp


def _rows(slots: int = 4, row_bytes: int = 64, seed: int | None = None) -> torch.Tensor:
    if seed is None:
        return torch.zeros((slots, row_bytes), dtype=torch.uint8)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (slots, row_bytes), dtype=torch.uint8, generator=g)


async def test_head_sliced_transfer_over_tcp_tp2_to_tp1() -> None:
    """Two TP2 prefill ranks each write their heads of every page into one TP1 decode's
    whole pages over the real tcp transport (one transfer room each); the designated
    sender's row lands in the metadata region, the other's in the sink."""
    num_pages = 12
    ks, vs = _truth(num_pages, seed=5)
    dk, dv, dst_kv = _empty_pool(num_pages, (0, H), fill=3.0)
    rows, sink = _rows(), _rows()
    dst_regions = [*dst_kv, metadata_region(rows), MemoryRegion(METADATA_SINK_REGION_ID, sink, RegionKind.METADATA, "sink")]
    before = [t.clone() for t in _all(dk, dv)]
    recv = registry.create("tcp")
    senders = [registry.create("tcp") for _ in range(2)]
    room, slot = 4242, 2
    src_pages, dst_pages = [0, 1, 2, 3, 8, 5], [6, 7, 8, 9, 1, 3]
    try:
        desc = await recv.register(dst_regions)
        src_rows = []
        for p, snd in enumerate(senders):
            heads = heads_of(p, 2, H)
            _, _, src_kv = _pool(ks, vs, heads)
            srows = _rows(seed=10 + p)
            src_rows.append(srows)
            src_regions = [*src_kv, metadata_region(srows)]
            await snd.register(src_regions)
            peer = await snd.connect(desc)
            troom = transfer_room(room, p, 0)
            recv.advertise(RoomGrant.of(troom, dst_pages, slot))
            ops = head_slice_ops(region_pairs(src_regions, peer.descriptor.regions), src_pages, dst_pages,
                                 src_heads=heads, dst_heads=(0, H), heads=heads, head_bytes=HEAD_BYTES)
            assert len(ops) == 2 * LAYERS * len(src_pages)
            meta_dst = peer.descriptor.region(METADATA_REGION_ID if p == 0 else METADATA_SINK_REGION_ID)
            await snd.write(peer, troom, ops, metadata=metadata_op(src_regions[-1], 1, meta_dst, slot))
        for p, snd in enumerate(senders):
            troom = transfer_room(room, p, 0)
            assert (await snd.wait(troom, 30)).state is KVPoll.SUCCESS
            assert (await recv.wait(troom, 30)).state is KVPoll.SUCCESS
        untouched = [q for q in range(num_pages) if q not in dst_pages]
        for got, was, truth in zip(_all(dk, dv), before, _all(ks, vs)):
            assert torch.equal(got[dst_pages], truth[src_pages])
            assert torch.equal(got[untouched], was[untouched])
        assert torch.equal(rows[slot], src_rows[0][1]) and torch.equal(sink[slot], src_rows[1][1])
        assert not rows[[0, 1, 3]].any() and not sink[[0, 1, 3]].any()
    finally:
        for t in (*senders, recv):
            await t.close()


async def test_head_sliced_transfer_over_tcp_tp1_to_tp2() -> None:
    num_pages = 40
    ks, vs = _truth(num_pages, seed=6)
    _, _, src_kv = _pool(ks, vs, (0, H))
    srows = _rows(seed=3)
    src_regions = [*src_kv, metadata_region(srows)]
    send = registry.create("tcp")
    recvs = [registry.create("tcp") for _ in range(2)]
    pools = []
    src_pages = list(range(3, 33))  # contiguous on both sides: adjacent destination blocks
    dst_pages = list(range(10, 40))
    try:
        await send.register(src_regions)
        for d, recv in enumerate(recvs):
            heads = heads_of(d, 2, H)
            dk, dv, dst_kv = _empty_pool(num_pages, heads)
            pools.append((heads, dk, dv))
            rows = _rows()
            peer = await send.connect(await recv.register([*dst_kv, metadata_region(rows)]))
            troom = transfer_room(77, 0, d)
            recv.advertise(RoomGrant.of(troom, dst_pages, 0))
            ops = head_slice_ops(region_pairs(src_regions, peer.descriptor.regions), src_pages, dst_pages,
                                 src_heads=(0, H), dst_heads=heads, heads=heads, head_bytes=HEAD_BYTES)
            await send.write(peer, troom, ops,
                             metadata=metadata_op(src_regions[-1], 0, peer.descriptor.region(METADATA_REGION_ID), 0))
            assert (await send.wait(troom, 30)).state is KVPoll.SUCCESS
            assert (await recv.wait(troom, 30)).state is KVPoll.SUCCESS
            assert torch.equal(rows[0], srows[0])
        for heads, dk, dv in pools:
            for got, truth in zip(_all(dk, dv), _all(ks, vs)):
                assert torch.equal(got[dst_pages], truth[src_pages, heads[0] : heads[1]])
                assert not got[:10].any()
    finally:
        for t in (send, *recvs):
            await t.close()


async def test_large_head_sliced_transfer_over_tcp_is_bit_exact() -> None:
    """Tens of MiB of strided half-page blocks (more than the socket buffers hold, so
    sends and receives stop part-way through blocks), contiguous and scattered pages."""
    pages, heads, hd, ps = 512, 4, 128, 16  # 16 KiB pages, 4 KiB per head
    hb = ps * hd * 2
    g = torch.Generator().manual_seed(9)
    src = [torch.randint(-2000, 2000, (pages, heads, ps, hd), generator=g).to(torch.float16) for _ in range(4)]
    dst = [torch.zeros((pages, 2, ps, hd), dtype=torch.float16) for _ in range(4)]
    src_regions = [*kv_regions(src[:2], src[2:]), metadata_region(_rows(seed=4))]
    dst_regions = [*kv_regions(dst[:2], dst[2:]), metadata_region(_rows())]
    send, recv = registry.create("tcp"), registry.create("tcp")
    rng = np.random.default_rng(1)
    try:
        await send.register(src_regions)
        peer = await send.connect(await recv.register(dst_regions))
        pairs = region_pairs(src_regions, peer.descriptor.regions)
        mop = metadata_op(src_regions[-1], 0, peer.descriptor.region(METADATA_REGION_ID), 0)
        cases = {1: (list(range(pages)), list(range(pages))),
                 2: (rng.permutation(pages)[:300].tolist(), rng.permutation(pages)[:300].tolist())}
        for room, (sp, dp) in cases.items():  # one after the other: room 2 overwrites room 1's pages
            recv.advertise(RoomGrant.of(room, dp, 0))
            ops = head_slice_ops(pairs, sp, dp, src_heads=(0, heads), dst_heads=(2, 4), heads=(2, 4), head_bytes=hb)
            await send.write(peer, room, ops, metadata=mop)
            assert (await recv.wait(room, 60)).state is KVPoll.SUCCESS
            for d, s in zip(dst, src):
                assert torch.equal(d[dp], s[sp, 2:4]), f"room {room}: destination pages differ from the source's heads"
            recv.release(room)
            assert (await send.wait(room, 30)).state is KVPoll.SUCCESS
            send.release(room)
    finally:
        await send.close()
        await recv.close()


async def test_head_sliced_write_outside_the_grant_is_rejected_over_tcp() -> None:
    """A head slice aimed at a page the room was not granted fails the room; nothing lands."""
    ks, vs = _truth(8, seed=7)
    _, _, src_kv = _pool(ks, vs, (0, H))
    dk, dv, dst_kv = _empty_pool(8, (2, 4))
    send, recv = registry.create("tcp"), registry.create("tcp")
    try:
        await send.register(src_kv)
        peer = await send.connect(await recv.register(dst_kv))
        recv.advertise(RoomGrant.of(5, [0, 1], None))
        ops = head_slice_ops(region_pairs(src_kv, peer.descriptor.regions), [0, 1], [1, 2],
                             src_heads=(0, H), dst_heads=(2, 4), heads=(2, 4), head_bytes=HEAD_BYTES)
        await send.write(peer, 5, ops)
        st = await send.wait(5, 30)
        assert st.state is KVPoll.FAILED and "page 2" in (st.reason or ""), st
        assert recv.poll(5) is KVPoll.FAILED
        assert not any(t.any() for t in _all(dk, dv))
    finally:
        await send.close()
        await recv.close()


# --------------------------------------------------------------------------- the benchmark


@pytest.mark.timeout(240)
def test_bench_reports_head_sliced_vs_whole_page() -> None:
    from pdgrpc.bench import transport as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--backend", "tcp", "--tokens", "256", "--layers", "2", "--iterations", "1",
                              "--warmup", "0", "--cases", "head-sliced"])
    results = bench.run(args)
    rows = [r for r in results if r.case == "tcp 256 tok head-sliced vs whole-page"]
    assert len(rows) == 1, [r.case for r in results]
    row = rows[0]
    assert row.metric == "throughput" and row.unit == "GB/s"
    assert row.value > 0 and row.baseline_value > 0 and row.ratio > 0
    assert row.ratio == pytest.approx(row.value / row.baseline_value)
    # head-sliced brings its whole-page baseline; scattered was not asked for
    assert any(r.case.startswith("tcp 256 tok contiguous") for r in results)
    assert not any("scattered" in r.case for r in results)
