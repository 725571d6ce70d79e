"""The conformance suite's failure, volume and hygiene checks (a base of
:class:`~pdgrpc.transport.testing.TransportConformance`)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from pdgrpc.errors import PeerFailure
from pdgrpc.kvpoll import KVPoll
from pdgrpc.transport.base import Peer, RoomGrant, Transport
from pdgrpc.transport.pages import METADATA_REGION_ID, metadata_op, page_ops, region_pairs
from pdgrpc.transport.testing.peer import Layout, PeerProcess, digest, resource_counts
from pdgrpc.transport.testing._support import (
    FAIL_DEADLINE_S, MEASURED, WAIT_S, ConformanceBase, Local, close_transport, sender_peer, until,
)


class FailureChecks(ConformanceBase):
    async def _kill_then_rooms_fail(self, proc: PeerProcess, killed: str, t: Transport, side: str,
                                    rooms: list[int]) -> None:
        """SIGKILL the ``killed`` side's process; ``t``'s in-flight ``rooms`` must all be
        FAILED, each with a reason and typed as a lost peer (``peer_lost``: the decode
        counts it ``peer_failure``), within :data:`FAIL_DEADLINE_S` (the time is recorded
        in :data:`MEASURED`)."""
        killed_at = time.monotonic()
        proc.kill()
        await proc.wait_dead()
        await until(lambda: all(t.poll(r) is KVPoll.FAILED for r in rooms), FAIL_DEADLINE_S * 5)
        took = time.monotonic() - killed_at
        MEASURED.append((self.backend, f"{side} notices killed {killed}", took))
        assert took <= FAIL_DEADLINE_S, f"rooms failed {took:.2f} s after the {killed} was killed"
        assert all(t.status(r).reason for r in rooms)
        assert all(t.status(r).peer_lost for r in rooms), [t.status(r) for r in rooms]

    async def _check_room_lands(self, send: Local, peer: Peer, recv: PeerProcess, room: int,
                                src: list[int], dst: list[int], slot: int, region: int) -> None:
        """``room`` written from this process to the receiver process ``recv`` (through
        ``peer``): pages ``src`` into ``dst`` and row ``slot`` into slot ``slot``. Both
        sides end it SUCCESS, and ``region``'s destination pages hold the source pages."""
        pairs = region_pairs(send.regions, peer.descriptor.regions)
        await recv.call("advertise", room, dst, slot)
        await send.t.write(peer, room, page_ops(pairs, src, dst),
                           metadata=metadata_op(send.regions[-1], slot, peer.descriptor.require_region(METADATA_REGION_ID), slot))
        assert (await self._wait_local(send.t, [room]))[room].state is KVPoll.SUCCESS
        [(state, reason)] = await recv.call("wait", [room], WAIT_S)
        assert state == KVPoll.SUCCESS, reason
        if self._moves_bytes():
            pb = send.layout.page_bytes
            source = send.layout.source_bytes(region, self.seed)
            for s, d in zip(src, dst):
                assert await recv.call("digest", region, d * pb, (d + 1) * pb) == digest(source[s * pb : (s + 1) * pb])

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
                    await until(lambda: all(recv.t.poll(r) is KVPoll.TRANSFERRING for r in rooms))
                    await self._kill_then_rooms_fail(sender, "sender", recv.t, "receiver", rooms)
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
            await close_transport(recv.t)

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
                await self._kill_then_rooms_fail(recv, "receiver", send.t, "sender", rooms)
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
                await self._check_room_lands(send, await send.t.connect(fresh.descriptor), fresh, 410, [20, 21], [5, 6], 2, 0)
        finally:
            await close_transport(send.t)

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
                assert st.state is KVPoll.FAILED and "lease expired" in (st.reason or "") and st.peer_lost, st
                await self._check_room_lands(send, await send.t.connect(recv.descriptor), recv, 502, [7, 8], [4, 5], 1, 1)
        finally:
            await close_transport(send.t)

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
                await until(lambda: all(recv.t.poll(r) is KVPoll.TRANSFERRING for r in (511, 512)))
                recv.t.fail_peer(a.instance_id, "prefill lease expired")
                st = recv.t.status(511)
                assert st.state is KVPoll.FAILED and "lease expired" in (st.reason or "") and st.peer_lost, st
                assert recv.t.poll(512) is KVPoll.TRANSFERRING
                await b.call("write_pages", sender_peer(recv), 512, [], [], (1, 1))
                assert (await self._wait_local(recv.t, [512]))[512].state is KVPoll.SUCCESS
        finally:
            await close_transport(recv.t)

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
            await close_transport(recv.t)

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
            await close_transport(recv.t)

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
            await close_transport(send.t)
            assert send.t.poll(702) is KVPoll.FAILED
            await asyncio.sleep(0.05)
            after = resource_counts()
            assert after == before, f"leaked after close (before {before}, after {after})"
            leaked = await recv.call("close")
            assert leaked == {"tasks": 0, "threads": 0, "fds": 0}, f"peer process leaked {leaked}"
            [(state, _)] = await recv.call("status", [702])
            # close fails every room still open (fake's rooms were already done)
            assert state == (KVPoll.FAILED if self._moves_bytes() else KVPoll.SUCCESS)
