"""``tests.transport.transfer_faults``: the sender-side wrapper that fails seeded
rooms at four points, over a real tcp sender/receiver pair with real KV tensors and
metadata rows. What the receiver holds after each point is what the e2e test
(``tests/e2e/test_transfer_faults.py``) relies on."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pdgrpc.errors import ConfigError
from pdgrpc.kvpoll import KVPoll
from pdgrpc.state.metadata import MetadataBuffers, MetadataRow
from pdgrpc.transport import registry
from pdgrpc.transport.base import RoomGrant
from pdgrpc.transport.pages import METADATA_REGION_ID, kv_regions, metadata_op, metadata_region, page_ops, region_pairs
from tests.transport.transfer_faults import POINTS, FailingTransfers, fault_point

SEED = 16
PAGES, SLOTS = 16, 4
SHAPE = (PAGES, 2, 4, 8)


def _room_hit_at(point: str, probability: float = 1.0) -> int:
    return next(r for r in range(1, 10_000) if fault_point(SEED, r, probability) == point)


class _Pair:
    def __init__(self, probability: float = 1.0) -> None:
        g = torch.Generator().manual_seed(1)
        self.src = [torch.randn(SHAPE, generator=g).half() for _ in range(4)]
        self.dst = [torch.zeros(SHAPE, dtype=torch.float16) for _ in range(4)]
        self.src_rows, self.dst_rows = MetadataBuffers(SLOTS), MetadataBuffers(SLOTS)
        self.src_regions = [*kv_regions(self.src[:2], self.src[2:]), metadata_region(self.src_rows.tensor)]
        self.recv = registry.create("tcp")
        self.send = FailingTransfers(registry.create("tcp"), seed=SEED, probability=probability)

    async def __aenter__(self) -> "_Pair":
        desc = await self.recv.register([*kv_regions(self.dst[:2], self.dst[2:]), metadata_region(self.dst_rows.tensor)])
        await self.send.register(self.src_regions)
        self.peer = await self.send.connect(desc)
        self.pairs = region_pairs(self.src_regions, self.peer.descriptor.regions)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.send.close()
        await self.recv.close()

    async def write(self, room: int, slot: int, pages: list[int], *, row: bool = True) -> None:
        self.recv.advertise(RoomGrant.of(room, pages, slot)) if room not in self.recv.rooms else None
        self.src_rows.write_row(slot, MetadataRow(output_id=7), room)
        mop = metadata_op(self.src_regions[-1], slot, self.peer.descriptor.region(METADATA_REGION_ID), slot) if row else None
        await self.send.write(self.peer, room, page_ops(self.pairs, pages, pages), metadata=mop)

    def landed(self, pages: list[int]) -> list[bool]:
        return [all(torch.equal(d[p], s[p]) for d, s in zip(self.dst, self.src)) for p in pages]


@pytest.mark.parametrize("point", POINTS)
async def test_each_point_fails_the_sender_room_leaving_what_it_says(point) -> None:
    room, pages = _room_hit_at(point), [0, 1, 2, 3]
    async with _Pair() as p:
        await p.write(room, 1, pages)
        st = p.send.status(room)
        assert st.state is KVPoll.FAILED and f"injected transfer fault at {point} (seed {SEED})" in (st.reason or "")
        assert p.send.hits == {room: point}
        recv = await p.recv.wait(room, 0.5)  # what reaches the receiver meanwhile
        landed = p.landed(pages)
        if point == "after_row":
            assert recv.state is KVPoll.SUCCESS and all(landed) and p.dst_rows.room(1) == room
        else:
            # no row, so the receiver never sees SUCCESS: only the sender's abort ends it
            assert recv.state in (KVPoll.WAITING_FOR_INPUT, KVPoll.TRANSFERRING), recv
            assert p.dst_rows.room(1) == 0
            if point == "before_first_page":
                assert not any(landed) and recv.state is KVPoll.WAITING_FOR_INPUT
            elif point == "before_row":
                assert all(landed)
            else:  # half of the page ops (per layer and K/V): some bytes, not every page whole
                assert any(bool(d.any()) for d in p.dst) and not all(landed), landed
        # later writes for the failed room send nothing
        before = [d.clone() for d in p.dst]
        await p.write(room, 1, [4, 5], row=False)
        await asyncio.sleep(0.1)
        assert all(torch.equal(a, b) for a, b in zip(before, p.dst))
        p.send.release(room)
        assert p.send.hits == {} and room not in p.send.rooms


async def test_rooms_not_hit_pass_through_and_the_choice_is_the_seeds() -> None:
    rooms = [r for r in range(1, 400) if fault_point(SEED, r, 0.05) is None][:3]
    assert fault_point(SEED, 12345, 0.05) == fault_point(SEED, 12345, 0.05)
    assert 0.02 < sum(fault_point(SEED, r, 0.05) is not None for r in range(4000)) / 4000 < 0.08
    async with _Pair(probability=0.05) as p:
        for slot, room in enumerate(rooms):
            await p.write(room, slot, [slot])
            assert (await p.send.wait(room, 10)).state is KVPoll.SUCCESS
            assert (await p.recv.wait(room, 10)).state is KVPoll.SUCCESS
        assert all(p.landed([0, 1, 2])) and p.send.hits == {}


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "x", True])
def test_bad_probability(bad) -> None:
    with pytest.raises(ConfigError, match="probability"):
        FailingTransfers(registry.create("fake"), seed=1, probability=bad)


def test_the_e2e_wrapper_loads_by_name_through_the_registry() -> None:
    cls = registry.load("tests.e2e.faulty:FailsFivePercent")
    t = cls(host="127.0.0.1", tp_rank=0)
    assert isinstance(t, FailingTransfers) and t.name == "tcp" and (t.seed, t.probability) == (16, 0.05)
