"""The transport conformance suite: what a backend must do to be a pdgrpc transport.

A plugin author proves a backend by subclassing :class:`TransportConformance` in a test
module and naming the backend (a registered name or ``"module:Class"``)::

    from pdgrpc.transport.testing import TransportConformance

    class TestMyBackend(TransportConformance):
        backend = "mybackend"
        options = {}            # keyword options for registry.create

It needs ``pytest`` and ``pytest-asyncio``. Every test puts the sender and the receiver
in **separate OS processes**: the test process holds one side, a
:class:`~pdgrpc.transport.testing.peer.PeerProcess` (forked from a clean fork server) the other.

What is checked (backends with ``moves_bytes = False``, like ``fake``, run only the
checks that apply: registry, descriptors, room states, concurrency, peer failure hook,
clean close):

* bit-exact round trip of random page lists, contiguous and scattered, many layers,
  also written in several chunks;
* the metadata row lands last: it is never visible before all of its room's pages;
* 256 concurrent rooms interleaved on one connection;
* every kind of unauthorized write is rejected (unknown room, page outside the grant,
  offset/length outside a region, unknown region, wrong metadata slot, write after
  release): the room fails with a reason, no byte lands outside what was granted, and
  a good room on the same connection is unaffected;
* a peer SIGKILLed mid-transfer fails the other side's in-flight rooms within
  :data:`FAIL_DEADLINE_S` (sender killed, and receiver killed); the dead peer's
  descriptor is never served by the old connection; a fresh peer then works;
* ``fail_peer`` (the control plane's liveness hook) fails that peer's rooms at once and
  the next ``connect`` builds a fresh connection;
* a >= 256 MiB transfer arrives bit-exact;
* ``close`` leaves no asyncio task, thread or file descriptor behind, in either process.

:class:`CudaTransportConformance` runs the data checks with the KV regions in GPU memory
(both sides, or one side with ``peer_device = "cpu"``); it skips, saying so, where torch
sees no CUDA device. A variant that cannot change some checks' outcome names them in
``leave_out`` (:data:`NON_DATA_CHECKS`: those that do not depend on where the bytes live).

Measured failure-detection times are appended to :data:`MEASURED` (printed by pytest's
``-s``), so CI logs show how close to the deadline a backend runs.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from pdgrpc.errors import TransportError
from pdgrpc.kvpoll import KVPoll
from pdgrpc.transport import registry
from pdgrpc.transport.base import Descriptor, RoomGrant, Transport
from pdgrpc.transport.pages import METADATA_REGION_ID
from pdgrpc.transport.testing.peer import Layout
from pdgrpc.transport.testing._support import (
    FAIL_DEADLINE_S, MEASURED, WAIT_S, cached_source, close_transport, expected_row, row_room, sender_peer,
)
from pdgrpc.transport.testing.failures import FailureChecks


class TransportConformance(FailureChecks):
    """Subclass and set :attr:`backend` (and :attr:`options`) to run the suite."""

    # ------------------------------------------------------------------ registry & descriptors
    async def test_registry_and_descriptor(self) -> None:
        cls = registry.load(self._backend())
        assert issubclass(cls, Transport)
        layout = Layout(layers=2, pages=8, slots=4)
        a = await self._local(layout, None)
        b = await self._local(layout, None)
        try:
            d = Descriptor.from_bytes(a.descriptor)
            assert d.instance_id == a.t.instance_id != b.t.instance_id
            assert {r.region_id: r.nbytes for r in d.regions} == {
                rid: layout.region_nbytes(rid) for rid in layout.region_ids()
            }
            assert d.require_region(METADATA_REGION_ID).item_bytes == layout.row_bytes
            with pytest.raises(TransportError):
                a.t.poll(987654321)  # never seen
        finally:
            await close_transport(a.t)
            await close_transport(b.t)

    # ------------------------------------------------------------------ data path
    async def test_round_trip_random_page_lists(self) -> None:
        """Contiguous and scattered page lists over many layers, bit-exact."""
        layout = Layout(layers=12, pages=96, slots=8)
        rng = random.Random(7)
        recv = await self._local(layout, None)
        try:
            async with self._peer(layout, self.seed) as sender:
                await sender.call("connect", recv.descriptor)
                cases = {
                    101: (list(range(0, 24)), list(range(40, 64))),  # one contiguous run
                    102: (rng.sample(range(96), 20), rng.sample(range(0, 40), 20)),  # scattered
                    103: ([2, 3, 4, 9, 10, 50], [64, 65, 66, 80, 81, 95]),  # runs of mixed length
                }
                grants = {room: dst for room, (_, dst) in cases.items()}
                # room 104 is written in three chunks before its metadata row
                c_src = list(range(70, 82))
                c_dst = list(range(82, 94))
                grants[104] = c_dst
                for slot, (room, dst) in enumerate(grants.items()):
                    recv.t.advertise(RoomGrant.of(room, dst, slot=slot))
                    # a receiver waits for bytes; a backend that moves none is done at once
                    assert recv.t.poll(room) is (KVPoll.WAITING_FOR_INPUT if self._moves_bytes() else KVPoll.SUCCESS)
                nops = {}
                for slot, (room, (src, dst)) in enumerate(cases.items()):
                    nops[room] = await sender.call("write_pages", sender_peer(recv), room, src, dst, (slot, slot))
                for part in range(3):
                    s, d = c_src[part * 4 : part * 4 + 4], c_dst[part * 4 : part * 4 + 4]
                    meta = (3, 3) if part == 2 else None
                    await sender.call("write_pages", sender_peer(recv), 104, s, d, meta)
                got = await self._wait_local(recv.t, list(grants))
                assert all(st.state is KVPoll.SUCCESS for st in got.values()), got
                sent = await sender.call("wait", list(grants), WAIT_S)
                assert [s for s, _ in sent] == [KVPoll.SUCCESS] * len(grants), sent
                if not self._moves_bytes():
                    return
                # contiguous pages were coalesced into one op per region
                assert nops[101] == 2 * layout.layers
                for slot, (room, (src, dst)) in enumerate(cases.items()):
                    self._check_pages(recv, src, dst)
                    assert torch.equal(recv.row(slot), expected_row(layout, self.seed, slot, room))
                self._check_pages(recv, c_src, c_dst)
                # pages nobody was granted are untouched
                granted = {p for dst in grants.values() for p in dst}
                for rid in layout.kv_region_ids():
                    for p in set(range(layout.pages)) - granted:
                        assert not recv.page_bytes(rid, p).any(), f"page {p} of region {rid} was written"
        finally:
            await close_transport(recv.t)

    async def test_prepared_write_sends_what_write_would(self) -> None:
        """``prepare_write`` ahead, the send later: the same pages land, and the row is
        the one in the source slot at send time, not at prepare time."""
        layout = Layout(layers=4, pages=32, slots=4)
        recv = await self._local(layout, None)
        try:
            async with self._peer(layout, self.seed) as sender:
                await sender.call("connect", recv.descriptor)
                src, dst = [3, 4, 5, 11, 20], [30, 1, 2, 17, 8]
                recv.t.advertise(RoomGrant.of(77, dst, slot=2))
                await sender.call("prepare_then_write", sender_peer(recv), 77, src, dst, (1, 2))
                [st] = (await self._wait_local(recv.t, [77])).values()
                assert st.state is KVPoll.SUCCESS, st
                assert [s for s, _ in await sender.call("wait", [77], WAIT_S)] == [KVPoll.SUCCESS]
                if not self._moves_bytes():
                    return
                self._check_pages(recv, src, dst)
                assert torch.equal(recv.row(2), expected_row(layout, self.seed, 1, 77))
        finally:
            await close_transport(recv.t)

    async def test_metadata_row_lands_last(self) -> None:
        """Whenever a room's row is visible, all of that room's pages are already there."""
        self._require_bytes()
        layout = Layout(layers=8, pages=256, slots=32)
        recv = await self._local(layout, None)
        rooms = {1000 + i: (list(range(i * 8, i * 8 + 8)), i) for i in range(32)}
        expected = {rid: cached_source(layout, rid, self.seed) for rid in layout.kv_region_ids()}
        violations: list[str] = []
        seen_rows = 0

        def check() -> None:
            nonlocal seen_rows
            for room, (pages, slot) in rooms.items():
                if row_room(recv.row(slot)) != room:
                    continue
                seen_rows += 1
                for rid in layout.kv_region_ids():
                    ib = layout.page_bytes
                    for p in pages:
                        if not torch.equal(recv.page_bytes(rid, p), expected[rid][p * ib : (p + 1) * ib]):
                            violations.append(f"room {room}: row visible before page {p} of region {rid}")
                            return

        try:
            async with self._peer(layout, self.seed) as sender:
                await sender.call("connect", recv.descriptor)
                for room, (pages, slot) in rooms.items():
                    recv.t.advertise(RoomGrant.of(room, pages, slot))
                stop = asyncio.Event()

                async def watch() -> None:
                    while not stop.is_set():  # runs between every I/O callback of this loop
                        check()
                        await asyncio.sleep(0)

                watcher = asyncio.create_task(watch())
                for room, (pages, slot) in rooms.items():
                    await sender.call("write_pages", sender_peer(recv), room, pages, pages, (slot, slot))
                got = await self._wait_local(recv.t, list(rooms))
                stop.set()
                await watcher
                check()
                assert not violations, violations[:5]
                assert all(st.state is KVPoll.SUCCESS for st in got.values()), got
                assert seen_rows >= len(rooms)
        finally:
            await close_transport(recv.t)

    async def test_256_concurrent_rooms_on_one_connection(self) -> None:
        layout = Layout(layers=2, pages=512, slots=256, row_bytes=64)
        n = 256
        recv = await self._local(layout, None)
        try:
            async with self._peer(layout, self.seed) as sender:
                await sender.call("connect", recv.descriptor)
                # room i owns pages i and i+256, interleaved through the pool
                rooms = {5000 + i: ([i, i + 256], i) for i in range(n)}
                for room, (pages, slot) in rooms.items():
                    recv.t.advertise(RoomGrant.of(room, pages, slot))
                peer_id = sender_peer(recv)
                for half in (0, 1):  # first every room's first page, then every second page + row
                    writes = [
                        (room, [(pages[half] * 7 + 3) % layout.pages], [pages[half]], (slot, slot) if half else None)
                        for room, (pages, slot) in rooms.items()
                    ]
                    await sender.call("write_pages_many", peer_id, writes)
                got = await self._wait_local(recv.t, list(rooms))
                bad = {r: st for r, st in got.items() if st.state is not KVPoll.SUCCESS}
                assert not bad, list(bad.items())[:3]
                sent = await sender.call("wait", list(rooms), WAIT_S)
                assert all(s == KVPoll.SUCCESS for s, _ in sent)
                if self._moves_bytes():
                    for room, (pages, slot) in rooms.items():
                        self._check_pages(recv, [(p * 7 + 3) % layout.pages for p in pages], pages)
                        assert row_room(recv.row(slot)) == room
        finally:
            await close_transport(recv.t)

    async def test_unauthorized_writes_are_rejected(self) -> None:
        self._require_bytes()
        layout = Layout(layers=2, pages=32, slots=8)
        pb, rb = layout.page_bytes, layout.row_bytes
        region_bytes = layout.region_nbytes(0)
        recv = await self._local(layout, None)
        try:
            async with self._peer(layout, self.seed) as sender:
                await sender.call("connect", recv.descriptor)
                peer_id = sender_peer(recv)
                good, unknown, outside, mixed, past_end, bad_region, bad_slot, late = range(201, 209)
                grants = {
                    good: ([0, 1], 0),
                    outside: ([4, 5], 1),
                    mixed: ([8, 9], 2),
                    past_end: ([30, 31], 3),
                    bad_region: ([12], 4),
                    bad_slot: ([14], 5),
                    late: ([16, 17], 6),
                }
                for room, (pages, slot) in grants.items():
                    recv.t.advertise(RoomGrant.of(room, pages, slot))
                recv.t.release_because(late, "aborted by the test: its metadata row was corrupt")
                before = recv.snapshot()
                w = lambda dst_region, dst_off, n, src_off=0: (0, src_off, dst_region, dst_off, n)  # noqa: E731
                bad_writes = {
                    unknown: ([w(0, 20 * pb, pb)], "not advertised"),
                    outside: ([w(0, 7 * pb, pb)], "page 7"),
                    mixed: ([w(0, 8 * pb, pb), w(1, 10 * pb, pb)], "page 10"),
                    past_end: ([w(0, region_bytes - pb // 2, pb)], "outside region"),
                    bad_region: ([w(999, 12 * pb, pb)], "region"),
                    late: ([w(0, 16 * pb, pb)], "not advertised"),
                }
                for room, (ops, _) in bad_writes.items():
                    await sender.call("write_ops", peer_id, room, ops, None)
                # metadata row aimed at a slot the room was not granted (5 -> 7)
                await sender.call("write_ops", peer_id, bad_slot, [w(0, 14 * pb, pb)],
                                  (METADATA_REGION_ID, 0, METADATA_REGION_ID, 7 * rb, rb))
                # the good room, on the same connection, after all of the above
                await sender.call("write_pages", peer_id, good, [3, 4], [0, 1], (0, 0))

                got = await self._wait_local(recv.t, [good])
                assert got[good].state is KVPoll.SUCCESS, got[good]
                self._check_pages(recv, [3, 4], [0, 1])
                for room, reason in [(outside, "page 7"), (mixed, "page 10"), (past_end, "outside region"),
                                     (bad_region, "region"), (bad_slot, "slot")]:
                    st = (await self._wait_local(recv.t, [room]))[room]
                    assert st.state is KVPoll.FAILED, (room, st)
                    assert reason in (st.reason or ""), (room, st.reason)
                bad_rooms = [*bad_writes, bad_slot]
                sent = dict(zip(bad_rooms, await sender.call("wait", bad_rooms, WAIT_S)))
                for room, (state, reason) in sent.items():
                    assert state == KVPoll.FAILED, (room, state, reason)
                    assert reason, room
                # a write that came after an abort says why the room was released
                assert "its metadata row was corrupt" in sent[late][1], sent[late]
                assert "its metadata row was corrupt" not in sent[unknown][1], sent[unknown]
                # nothing landed outside what was granted, and nothing at all for rooms
                # whose every op was bad
                allowed: dict[int, set[int]] = {rid: set() for rid in layout.region_ids()}
                for room in (good, mixed, bad_slot):  # rooms with at least one valid page op
                    pages, slot = grants[room]
                    for rid in layout.kv_region_ids():
                        allowed[rid].update(pages)
                    if room == good:
                        allowed[METADATA_REGION_ID].add(slot)
                for rid in layout.region_ids():
                    ib = layout.item_bytes(rid)
                    for item in range(layout.region_nbytes(rid) // ib):
                        if item in allowed[rid]:
                            continue
                        assert torch.equal(recv.flats[rid][item * ib : (item + 1) * ib],
                                           before[rid][item * ib : (item + 1) * ib]), (
                            f"bytes landed in region {rid} item {item}, which no accepted write targeted"
                        )
        finally:
            await close_transport(recv.t)


# The checks whose outcome does not depend on where the KV bytes live or how many
# sockets carry them (registry and descriptors, peer death and the fail_peer hook, close):
# variants that change only that leave them out.
NON_DATA_CHECKS = (
    "test_registry_and_descriptor",
    "test_sender_killed_mid_transfer_fails_receiver_rooms",
    "test_receiver_killed_mid_transfer_fails_sender_rooms",
    "test_fail_peer_hook_on_sender",
    "test_fail_peer_hook_on_receiver",
    "test_close_leaves_nothing_behind",
)


class CudaTransportConformance(TransportConformance):
    """The data checks with KV regions in GPU memory (``device = "cuda"``; metadata rows
    stay in host memory). Set ``peer_device = "cpu"`` to prove that a GPU-memory side and
    a host-memory side work together. Skipped, with the reason, where torch sees no CUDA
    device; they run wherever it does."""

    pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    device = "cuda"
    leave_out = NON_DATA_CHECKS


__all__ = ["FAIL_DEADLINE_S", "MEASURED", "NON_DATA_CHECKS", "CudaTransportConformance", "TransportConformance"]
