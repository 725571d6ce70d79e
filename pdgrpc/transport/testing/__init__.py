"""The transport conformance suite: what a backend must do to be a pdgrpc transport.

A plugin author proves a backend by subclassing :class:`TransportConformance` in a test
module and naming the backend (a registered name or ``"module:Class"``)::

    from pdgrpc.transport.testing import TransportConformance

    class TestMyBackend(TransportConformance):
        backend = "mybackend"
        options = {}            # keyword options for registry.create

It needs ``pytest`` and ``pytest-asyncio``. Every test puts the sender and the receiver
in **separate OS processes**: the test process holds one side, a
:class:`~pdgrpc.transport.peerproc.PeerProcess` (spawned interpreter) the other.

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

Measured failure-detection times are appended to :data:`MEASURED` (printed by pytest's
``-s``), so CI logs show how close to the deadline a backend runs.
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
from typing import Any, ClassVar, Sequence

import pytest
import torch

from pdgrpc.errors import PeerFailure, TransportError
from pdgrpc.kvpoll import KVPoll
from pdgrpc.transport import registry
from pdgrpc.transport.base import Descriptor, RoomGrant, Transport
from pdgrpc.transport.pages import METADATA_REGION_ID, metadata_op, page_ops, region_pairs
from pdgrpc.transport.peerproc import ROOM_FIELD_BYTES, Layout, PeerProcess, digest, resource_counts

FAIL_DEADLINE_S = 2.0  # a dead peer's in-flight rooms must be FAILED this soon
WAIT_S = 60.0  # bound on any wait for something that should happen (not a speed target)
MEASURED: list[tuple[str, str, float]] = []  # (backend, what, seconds)


class _Local:
    """This process's side: a transport over a freshly built layout."""

    def __init__(self, backend: str, options: dict[str, Any], layout: Layout, seed: int | None) -> None:
        self.layout = layout
        self.seed = seed
        self.regions, self.flats = layout.build(seed)
        self.t: Transport = registry.create(backend, **options)
        self.descriptor = b""

    async def start(self) -> "_Local":
        self.descriptor = await self.t.register(self.regions)
        return self

    def page_bytes(self, region_id: int, page: int) -> torch.Tensor:
        ib = self.layout.item_bytes(region_id)
        return self.flats[region_id][page * ib : (page + 1) * ib]

    def row(self, slot: int) -> torch.Tensor:
        return self.page_bytes(METADATA_REGION_ID, slot)

    def snapshot(self) -> dict[int, torch.Tensor]:
        return {r: f.clone() for r, f in self.flats.items()}


@functools.lru_cache(maxsize=64)
def _source(layout: Layout, region_id: int, seed: int) -> torch.Tensor:
    """A seeded region's content (cached: checks compare many pages of few regions)."""
    return layout.source_bytes(region_id, seed)


def _expected_row(layout: Layout, seed: int, src_slot: int, room: int) -> torch.Tensor:
    rb = layout.row_bytes
    row = layout.source_bytes(METADATA_REGION_ID, seed)[src_slot * rb : (src_slot + 1) * rb].clone()
    row[-ROOM_FIELD_BYTES:] = torch.tensor([room], dtype=torch.int64).view(torch.uint8)
    return row


def _row_room(row: torch.Tensor) -> int:
    return int(row[-ROOM_FIELD_BYTES:].clone().view(torch.int64)[0])


class TransportConformance:
    """Subclass and set :attr:`backend` (and :attr:`options`) to run the suite."""

    backend: ClassVar[str] = ""
    options: ClassVar[dict[str, Any]] = {}
    seed: ClassVar[int] = 1234

    # ------------------------------------------------------------------ helpers
    def _backend(self) -> str:
        if not self.backend:
            pytest.skip("TransportConformance subclass did not set `backend`")
        return self.backend

    def _moves_bytes(self) -> bool:
        return registry.load(self._backend()).moves_bytes

    def _require_bytes(self) -> None:
        if not self._moves_bytes():
            pytest.skip(f"backend {self.backend!r} moves no bytes (moves_bytes = False); data checks do not apply")

    async def _local(self, layout: Layout, seed: int | None) -> _Local:
        return await _Local(self._backend(), dict(self.options), layout, seed).start()

    def _peer(self, layout: Layout, seed: int | None) -> PeerProcess:
        return PeerProcess(self._backend(), layout=layout, seed=seed, options=dict(self.options))

    def _check_pages(self, local: _Local, src_pages: Sequence[int], dst_pages: Sequence[int]) -> None:
        lay = local.layout
        for rid in lay.kv_region_ids():
            src = _source(lay, rid, self.seed)
            ib = lay.item_bytes(rid)
            for s, d in zip(src_pages, dst_pages):
                got = local.page_bytes(rid, d)
                assert torch.equal(got, src[s * ib : (s + 1) * ib]), (
                    f"region {rid}: destination page {d} does not hold source page {s}"
                )

    @staticmethod
    async def _wait_local(t: Transport, rooms: Sequence[int], timeout: float = WAIT_S) -> dict[int, Any]:
        deadline = time.monotonic() + timeout
        out = {}
        for r in rooms:
            out[r] = await t.wait(r, max(0.0, deadline - time.monotonic()))
        return out

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
            await _close(a.t)
            await _close(b.t)

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
                    assert torch.equal(recv.row(slot), _expected_row(layout, self.seed, slot, room))
                self._check_pages(recv, c_src, c_dst)
                # pages nobody was granted are untouched
                granted = {p for dst in grants.values() for p in dst}
                for rid in layout.kv_region_ids():
                    for p in set(range(layout.pages)) - granted:
                        assert not recv.page_bytes(rid, p).any(), f"page {p} of region {rid} was written"
        finally:
            await _close(recv.t)

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
                assert torch.equal(recv.row(2), _expected_row(layout, self.seed, 1, 77))
        finally:
            await _close(recv.t)

    async def test_metadata_row_lands_last(self) -> None:
        """Whenever a room's row is visible, all of that room's pages are already there."""
        self._require_bytes()
        layout = Layout(layers=8, pages=256, slots=32)
        recv = await self._local(layout, None)
        rooms = {1000 + i: (list(range(i * 8, i * 8 + 8)), i) for i in range(32)}
        expected = {rid: _source(layout, rid, self.seed) for rid in layout.kv_region_ids()}
        violations: list[str] = []
        seen_rows = 0

        def check() -> None:
            nonlocal seen_rows
            for room, (pages, slot) in rooms.items():
                if _row_room(recv.row(slot)) != room:
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
            await _close(recv.t)

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
                        assert _row_room(recv.row(slot)) == room
        finally:
            await _close(recv.t)

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
            await _close(recv.t)

    # ------------------------------------------------------------------ failures
    async def test_sender_killed_mid_transfer_fails_receiver_rooms(self) -> None:
        layout = Layout(layers=4, pages=64, slots=8)
        recv = await self._local(layout, None)
        try:
            sender = self._peer(layout, self.seed)
            await sender.start()
            try:
                await sender.call("connect", recv.descriptor)
                rooms = [301, 302, 303]
                for i, room in enumerate(rooms):
                    recv.t.advertise(RoomGrant.of(room, range(i * 8, i * 8 + 8), slot=i))
                for i, room in enumerate(rooms):  # pages but no metadata row: still in flight
                    await sender.call("write_pages", sender_peer(recv), room, list(range(8)),
                                      list(range(i * 8, i * 8 + 8)), None)
                if self._moves_bytes():
                    await _until(lambda: all(recv.t.poll(r) is KVPoll.TRANSFERRING for r in rooms))
                    killed_at = time.monotonic()
                    sender.kill()
                    await sender.wait_dead()
                    await _until(lambda: all(recv.t.poll(r) is KVPoll.FAILED for r in rooms), FAIL_DEADLINE_S * 5)
                    took = time.monotonic() - killed_at
                    MEASURED.append((self.backend, "receiver notices killed sender", took))
                    assert took <= FAIL_DEADLINE_S, f"rooms failed {took:.2f} s after the sender was killed"
                    assert all(recv.t.status(r).reason for r in rooms)
                else:
                    sender.kill()
                    await sender.wait_dead()
            finally:
                await sender.stop()
            # a fresh sender process works against the same receiver
            async with self._peer(layout, self.seed) as fresh:
                await fresh.call("connect", recv.descriptor)
                recv.t.advertise(RoomGrant.of(310, [40, 41], slot=5))
                await fresh.call("write_pages", sender_peer(recv), 310, [1, 2], [40, 41], (5, 5))
                st = (await self._wait_local(recv.t, [310]))[310]
                assert st.state is KVPoll.SUCCESS, st
                if self._moves_bytes():
                    self._check_pages(recv, [1, 2], [40, 41])
        finally:
            await _close(recv.t)

    async def test_receiver_killed_mid_transfer_fails_sender_rooms(self) -> None:
        self._require_bytes()  # a backend without a connection has no peer to lose
        layout = Layout(layers=4, pages=64, slots=8)
        send = await self._local(layout, self.seed)
        try:
            recv = self._peer(layout, None)
            await recv.start()
            try:
                peer = await send.t.connect(recv.descriptor)
                pairs = region_pairs(send.regions, peer.descriptor.regions)
                rooms = [401, 402]
                for i, room in enumerate(rooms):
                    await recv.call("advertise", room, list(range(i * 8, i * 8 + 8)), i)
                    await send.t.write(peer, room, page_ops(pairs, range(8), range(i * 8, i * 8 + 8)))
                    assert send.t.poll(room) is KVPoll.TRANSFERRING
                killed_at = time.monotonic()
                recv.kill()
                await recv.wait_dead()
                await _until(lambda: all(send.t.poll(r) is KVPoll.FAILED for r in rooms), FAIL_DEADLINE_S * 5)
                took = time.monotonic() - killed_at
                MEASURED.append((self.backend, "sender notices killed receiver", took))
                assert took <= FAIL_DEADLINE_S, f"rooms failed {took:.2f} s after the receiver was killed"
                assert all(send.t.status(r).reason for r in rooms)
                dead_descriptor = recv.descriptor
            finally:
                await recv.stop()
            # the dead peer's connection is never reused: connecting again either fails
            # or yields a room that fails, never a silent success
            try:
                again = await asyncio.wait_for(send.t.connect(dead_descriptor), WAIT_S)
            except PeerFailure:
                pass
            else:
                await send.t.write(again, 409, page_ops(pairs, [0], [0]),
                                   metadata=metadata_op(send.regions[-1], 0, again.descriptor.require_region(METADATA_REGION_ID), 0))
                st = (await self._wait_local(send.t, [409], FAIL_DEADLINE_S * 5))[409]
                assert st.state is KVPoll.FAILED, f"a write to a dead peer ended {st}"
            # a fresh receiver process works
            async with self._peer(layout, None) as fresh:
                peer = await send.t.connect(fresh.descriptor)
                await fresh.call("advertise", 410, [5, 6], 2)
                await send.t.write(peer, 410, page_ops(pairs, [20, 21], [5, 6]),
                                   metadata=metadata_op(send.regions[-1], 2, peer.descriptor.require_region(METADATA_REGION_ID), 2))
                assert (await self._wait_local(send.t, [410]))[410].state is KVPoll.SUCCESS
                [(state, reason)] = await fresh.call("wait", [410], WAIT_S)
                assert state == KVPoll.SUCCESS, reason
                if self._moves_bytes():
                    pb = layout.page_bytes
                    src = layout.source_bytes(0, self.seed)
                    assert await fresh.call("digest", 0, 5 * pb, 7 * pb) == digest(src[20 * pb : 22 * pb])
        finally:
            await _close(send.t)

    async def test_fail_peer_hook_on_sender(self) -> None:
        """The control plane's liveness verdict fails that peer's rooms at once and the
        next connect builds a fresh connection that works."""
        layout = Layout(layers=2, pages=32, slots=8)
        send = await self._local(layout, self.seed)
        try:
            async with self._peer(layout, None) as recv:
                peer = await send.t.connect(recv.descriptor)
                pairs = region_pairs(send.regions, peer.descriptor.regions)
                await recv.call("advertise", 501, [0, 1], 0)
                await send.t.write(peer, 501, page_ops(pairs, [0, 1], [0, 1]))
                send.t.fail_peer(peer.instance_id, "bootstrap lease expired")
                st = send.t.status(501)
                assert st.state is KVPoll.FAILED and "lease expired" in (st.reason or ""), st
                peer2 = await send.t.connect(recv.descriptor)
                await recv.call("advertise", 502, [4, 5], 1)
                await send.t.write(peer2, 502, page_ops(pairs, [7, 8], [4, 5]),
                                   metadata=metadata_op(send.regions[-1], 1, peer2.descriptor.require_region(METADATA_REGION_ID), 1))
                assert (await self._wait_local(send.t, [502]))[502].state is KVPoll.SUCCESS
                [(state, reason)] = await recv.call("wait", [502], WAIT_S)
                assert state == KVPoll.SUCCESS, reason
                if self._moves_bytes():
                    pb = layout.page_bytes
                    src = layout.source_bytes(1, self.seed)
                    assert await recv.call("digest", 1, 4 * pb, 6 * pb) == digest(src[7 * pb : 9 * pb])
        finally:
            await _close(send.t)

    async def test_fail_peer_hook_on_receiver(self) -> None:
        """A receiver told that its sender is gone fails the rooms that sender was
        writing, and leaves rooms of other senders alone."""
        self._require_bytes()
        layout = Layout(layers=2, pages=32, slots=8)
        recv = await self._local(layout, None)
        try:
            async with self._peer(layout, self.seed) as a, self._peer(layout, self.seed) as b:
                for s in (a, b):
                    await s.call("connect", recv.descriptor)
                recv.t.advertise(RoomGrant.of(511, [0, 1], 0))
                recv.t.advertise(RoomGrant.of(512, [2, 3], 1))
                await a.call("write_pages", sender_peer(recv), 511, [0, 1], [0, 1], None)
                await b.call("write_pages", sender_peer(recv), 512, [2, 3], [2, 3], None)
                await _until(lambda: all(recv.t.poll(r) is KVPoll.TRANSFERRING for r in (511, 512)))
                recv.t.fail_peer(a.instance_id, "prefill lease expired")
                st = recv.t.status(511)
                assert st.state is KVPoll.FAILED and "lease expired" in (st.reason or ""), st
                assert recv.t.poll(512) is KVPoll.TRANSFERRING
                await b.call("write_pages", sender_peer(recv), 512, [], [], (1, 1))
                assert (await self._wait_local(recv.t, [512]))[512].state is KVPoll.SUCCESS
        finally:
            await _close(recv.t)

    # ------------------------------------------------------------------ volume & hygiene
    @pytest.mark.timeout(300)
    async def test_large_transfer_bit_exact(self) -> None:
        """>= 256 MiB in one room (pages of 64 KiB, 4 layers x K/V), bit-exact."""
        self._require_bytes()
        layout = Layout(layers=4, pages=512, page_shape=(16, 16, 128), slots=2)
        assert layout.kv_bytes >= 256 << 20
        recv = await self._local(layout, None)
        try:
            async with self._peer(layout, self.seed) as sender:
                await sender.call("connect", recv.descriptor)
                pages = list(range(layout.pages))
                recv.t.advertise(RoomGrant.of(601, pages, slot=1))
                await sender.call("write_pages", sender_peer(recv), 601, pages, pages, (0, 1), timeout=120)
                st = (await self._wait_local(recv.t, [601], 240))[601]
                assert st.state is KVPoll.SUCCESS, st
                for rid in layout.kv_region_ids():
                    assert digest(recv.flats[rid]) == await sender.call("digest", rid), f"region {rid} differs"
        finally:
            await _close(recv.t)

    async def test_nothing_lands_after_release_and_drain(self) -> None:
        """The receiver releases a room in the middle of a large transfer (an abort); once
        the sender's ``drain(room)`` returned True, not one more byte of it lands."""
        self._require_bytes()
        layout = Layout(layers=8, pages=512, slots=4)  # 32 MiB: still in flight at release
        recv = await self._local(layout, None)
        room, pages = 4242, list(range(layout.pages))
        try:
            async with self._peer(layout, self.seed) as sender:
                await sender.call("connect", recv.descriptor)
                recv.t.advertise(RoomGrant.of(room, pages, 0))
                await sender.call("write_pages", sender_peer(recv), room, pages, pages, None)
                recv.t.release(room)
                assert await sender.call("drain", room, 30.0) is True
                before = recv.snapshot()
                await asyncio.sleep(0.3)  # this loop keeps serving the transport meanwhile
                after = recv.snapshot()
                assert all(torch.equal(before[rid], after[rid]) for rid in before), "bytes landed after drain"
                await sender.call("release", room)
        finally:
            await _close(recv.t)

    async def test_close_leaves_nothing_behind(self) -> None:
        layout = Layout(layers=2, pages=16, slots=4)
        async with self._peer(layout, None) as recv:
            before = resource_counts()
            send = await self._local(layout, self.seed)
            peer = await send.t.connect(recv.descriptor)
            pairs = region_pairs(send.regions, peer.descriptor.regions)
            await recv.call("advertise", 701, [0, 1], 0)
            await recv.call("advertise", 702, [2], 1)  # left open: close must fail it
            await send.t.write(peer, 701, page_ops(pairs, [0, 1], [0, 1]),
                               metadata=metadata_op(send.regions[-1], 0, peer.descriptor.require_region(METADATA_REGION_ID), 0))
            assert (await self._wait_local(send.t, [701]))[701].state is KVPoll.SUCCESS
            await send.t.write(peer, 702, page_ops(pairs, [3], [2]))  # no metadata: still open
            await _close(send.t)
            assert send.t.poll(702) is KVPoll.FAILED
            await asyncio.sleep(0.05)
            after = resource_counts()
            assert after == before, f"leaked after close (before {before}, after {after})"
            leaked = await recv.call("close")
            assert leaked == {"tasks": 0, "threads": 0, "fds": 0}, f"peer process leaked {leaked}"
            [(state, _)] = await recv.call("status", [702])
            # close fails every room still open (fake's rooms were already done)
            assert state == (KVPoll.FAILED if self._moves_bytes() else KVPoll.SUCCESS)


def sender_peer(recv: _Local) -> str:
    """The instance id a sender process uses to address ``recv`` (after connect)."""
    return recv.t.instance_id


async def _close(t: Transport, timeout: float = 30.0) -> None:
    """Close a transport, bounded: a backend whose close hangs fails the test."""
    try:
        await asyncio.wait_for(t.close(), timeout)
    except asyncio.TimeoutError:
        raise AssertionError(f"{type(t).__name__}.close() did not finish within {timeout} s") from None


async def _until(cond: Any, timeout: float = WAIT_S, step: float = 0.002) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(step)


__all__ = ["FAIL_DEADLINE_S", "MEASURED", "TransportConformance"]
