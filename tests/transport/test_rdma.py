"""rdma-specific checks, beyond the conformance suite (which tests/transport/
test_conformance.py runs against ``rdma`` with sender and receiver in separate
processes): the descriptor carries a real UCX worker address and untrusted addresses
never reach UCX; a restarted peer gets a new endpoint and the old one is never used;
a hung peer (SIGSTOP: socket open, no heartbeats) fails its rooms and its pending UCX
requests are cancelled; missing ucxx gives the install hint; close leaves no OS thread,
task or descriptor behind."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
import time

import pytest

from pdgrpc.errors import ConfigError, PeerFailure, TransportUnavailable
from pdgrpc.kvpoll import KVPoll
from pdgrpc.transport import registry
from pdgrpc.transport.base import BadDescriptor, Descriptor, RoomGrant
from pdgrpc.transport.pages import METADATA_REGION_ID, metadata_op, page_ops, region_pairs
from pdgrpc.transport.testing.peer import Layout, PeerProcess, digest

pytest.importorskip("libucx", reason="the rdma backend needs the UCX libraries of the ucx extra: pip install 'pdgrpc[ucx]'")

SEED = 99
WAIT_S = 30.0  # bound for things that must happen (not a speed target)


async def _local(layout: Layout, seed: int | None):  # -> (transport, regions, flats, descriptor)
    regions, flats = layout.build(seed)
    t = registry.create("rdma")
    desc = await t.register(regions)
    return t, regions, flats, desc


async def _until(cond, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(0.005)


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_descriptor_carries_worker_address_and_bad_addresses_never_reach_ucx() -> None:
    layout = Layout(layers=1, pages=4, slots=2)
    a, _, _, desc_a = await _local(layout, None)
    b, _, _, desc_b = await _local(layout, None)
    try:
        da, db = Descriptor.from_bytes(desc_a), Descriptor.from_bytes(desc_b)
        assert da.backend == "rdma"
        assert da.endpoint == a.worker_address and len(da.endpoint) >= 16
        assert da.endpoint != db.endpoint  # one UCX worker per transport instance
        host, _, port = da.liveness.rpartition(":")
        assert host == "127.0.0.1" and int(port) > 0
        # Tampered worker addresses are refused with a pdgrpc error; UCX (which aborts
        # the process on a malformed address) never sees them.
        for bad in (b"garbage", bytes(64), db.endpoint[:-1] + bytes([db.endpoint[-1] ^ 1])):
            forged = Descriptor("rdma", db.instance_id, bad, db.regions, db.liveness).to_bytes()
            with pytest.raises(BadDescriptor):
                await a.connect(forged)
        with pytest.raises(BadDescriptor):  # no liveness address: a dead peer could not be noticed
            await a.connect(Descriptor("rdma", db.instance_id, db.endpoint, db.regions, "").to_bytes())
        # the genuine descriptor still connects afterwards
        peer = await a.connect(desc_b)
        assert peer.instance_id == db.instance_id
    finally:
        await a.close()
        await b.close()


async def test_unknown_option_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="bogus"):
        registry.create("rdma", bogus=1)


def test_missing_ucx_libraries_raise_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdgrpc.transport import ucx_api

    monkeypatch.setitem(sys.modules, "libucx", None)  # import now fails
    ucx_api.api.cache_clear()  # the next use loads libucp again, and finds libucx gone
    with pytest.raises(TransportUnavailable, match=r"pip install 'pdgrpc\[ucx\]'"):
        registry.create("rdma")


async def test_restarted_peer_gets_a_new_endpoint_and_the_old_one_is_never_used() -> None:
    layout = Layout(layers=2, pages=16, slots=4)
    send, regions, _, _ = await _local(layout, SEED)
    try:
        first = PeerProcess("rdma", layout=layout)
        await first.start()
        try:
            old_peer = await send.connect(first.descriptor)
            await first.call("advertise", 11, [0, 1], 0)
            pairs = region_pairs(regions, old_peer.descriptor.regions)
            meta = metadata_op(regions[-1], 0, old_peer.descriptor.region(METADATA_REGION_ID), 0)
            await send.write(old_peer, 11, page_ops(pairs, [2, 3], [0, 1]), metadata=meta)
            assert (await send.wait(11, WAIT_S)).state is KVPoll.SUCCESS
            first.kill()
            await first.wait_dead()
        finally:
            await first.stop()
        # The liveness channel notices the death; the cached connection is dropped.
        await send.write(old_peer, 12, page_ops(pairs, [0], [0]))
        await _until(lambda: send.poll(12) is KVPoll.FAILED)
        async with PeerProcess("rdma", layout=layout) as second:
            new_peer = await send.connect(second.descriptor)
            assert new_peer.instance_id != old_peer.instance_id
            assert new_peer.descriptor.endpoint != old_peer.descriptor.endpoint
            # writing to the old peer never reaches the new process: the room fails
            await send.write(old_peer, 13, page_ops(pairs, [4], [4]))
            assert send.status(13).state is KVPoll.FAILED and "no live connection" in (send.status(13).reason or "")
            with pytest.raises(PeerFailure):
                await send.connect(first.descriptor)
            # the new endpoint works, bit-exact
            await second.call("advertise", 14, [5, 6], 1)
            meta = metadata_op(regions[-1], 1, new_peer.descriptor.region(METADATA_REGION_ID), 1)
            await send.write(new_peer, 14, page_ops(pairs, [7, 8], [5, 6]), metadata=meta)
            assert (await send.wait(14, WAIT_S)).state is KVPoll.SUCCESS
            pb = layout.page_bytes
            src = layout.source_bytes(1, SEED)
            assert await second.call("digest", 1, 5 * pb, 7 * pb) == digest(src[7 * pb : 9 * pb])
    finally:
        await send.close()


async def test_hung_peer_fails_rooms_and_cancels_pending_ucx_requests() -> None:
    """SIGSTOP keeps the peer's sockets open, so only missed heartbeats reveal it; the
    sender's rendezvous sends into the frozen process stay pending until cancelled."""
    layout = Layout(layers=4, pages=64, page_shape=(16, 8, 64), slots=4)  # 16 KiB pages
    regions, _ = layout.build(SEED)
    send = registry.create("rdma", liveness_interval=0.25, liveness_lease=1.5)  # a short lease: faster test
    await send.register(regions)
    recv = PeerProcess("rdma", layout=layout)
    await recv.start()
    try:
        peer = await send.connect(recv.descriptor)
        assert send.pending_requests == 0
        await recv.call("advertise", 21, list(range(64)), 0)
        os.kill(recv.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        pairs = region_pairs(regions, peer.descriptor.regions)
        await send.write(peer, 21, page_ops(pairs, range(64), range(64)))
        assert send.pending_requests > 0  # nothing completes while the receiver is frozen
        await _until(lambda: send.poll(21) is KVPoll.FAILED)
        took = time.monotonic() - stopped_at
        assert "heartbeat" in (send.status(21).reason or ""), send.status(21)
        await _until(lambda: send.pending_requests == 0)  # the UCX requests were cancelled
        print(f"hung peer noticed {took:.2f} s after SIGSTOP")
    finally:
        recv.kill()
        await recv.wait_dead()
        await recv.stop()
        await send.close()


async def test_drain_waits_for_sends_in_flight_and_times_out_on_a_frozen_peer() -> None:
    """A prefill acknowledges an abort only after drain(room): while the receiver cannot
    take the bytes (frozen), drain reports False at its timeout; once it runs again and the
    sends completed, drain is True -- nothing of the room can land after that."""
    layout = Layout(layers=4, pages=64, page_shape=(16, 8, 64), slots=4)  # 16 KiB pages
    regions, _ = layout.build(SEED)
    send = registry.create("rdma", liveness_lease=30.0)  # the freeze must not fail the peer
    await send.register(regions)
    recv = PeerProcess("rdma", layout=layout)
    await recv.start()
    try:
        peer = await send.connect(recv.descriptor)
        await recv.call("advertise", 31, list(range(64)), 0)
        os.kill(recv.pid, signal.SIGSTOP)
        pairs = region_pairs(regions, peer.descriptor.regions)
        await send.write(peer, 31, page_ops(pairs, range(64), range(64)))
        assert send.pending_requests > 0
        started = time.monotonic()
        assert await send.drain(31, 0.5) is False
        assert time.monotonic() - started >= 0.45
        os.kill(recv.pid, signal.SIGCONT)
        assert await send.drain(31, WAIT_S) is True
        assert send.pending_requests == 0
        assert await send.drain(999, 0.1) is True  # a room it never wrote: nothing to wait for
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(recv.pid, signal.SIGCONT)
        await recv.stop()
        await send.close()


async def test_close_leaves_no_os_thread_task_or_fd() -> None:
    """Two transports talking in one process (UCX loops back through its own worker
    addresses), then closed: the OS thread count (UCX would start native threads,
    invisible to ``threading``), asyncio tasks and file descriptors are as before."""
    layout = Layout(layers=1, pages=8, slots=2)
    # warm up once: imports and UCX's one-time process state are not a leak
    t, *_ = await _local(layout, None)
    await t.close()
    before = (_os_threads(), threading.active_count(), _fds(), len(asyncio.all_tasks()))
    for _ in range(2):
        recv, _, recv_flats, recv_desc = await _local(layout, None)
        send, regions, _, _ = await _local(layout, SEED)
        peer = await send.connect(recv_desc)
        recv.advertise(RoomGrant.of(31, [2, 3], 1))
        pairs = region_pairs(regions, peer.descriptor.regions)
        meta = metadata_op(regions[-1], 0, peer.descriptor.region(METADATA_REGION_ID), 1)
        await send.write(peer, 31, page_ops(pairs, [4, 5], [2, 3]), metadata=meta)
        assert (await recv.wait(31, WAIT_S)).state is KVPoll.SUCCESS
        assert (await send.wait(31, WAIT_S)).state is KVPoll.SUCCESS
        pb = layout.page_bytes
        assert digest(recv_flats[0][2 * pb : 4 * pb]) == digest(layout.source_bytes(0, SEED)[4 * pb : 6 * pb])
        await send.close()
        await recv.close()
    await asyncio.sleep(0.05)
    after = (_os_threads(), threading.active_count(), _fds(), len(asyncio.all_tasks()))
    assert after == before, f"(os threads, py threads, fds, tasks) before {before}, after {after}"


async def test_huge_offsets_are_rejected_and_nothing_lands() -> None:
    """Offsets and lengths at the edge of the 64-bit op table: the sender refuses what
    it cannot encode, the receiver rejects what falls outside its region, and no bounds
    check wraps around."""
    from pdgrpc.transport.base import WriteOp

    layout = Layout(layers=1, pages=8, slots=2)
    send, regions, _, _ = await _local(layout, SEED)
    try:
        async with PeerProcess("rdma", layout=layout) as recv:
            peer = await send.connect(recv.descriptor)
            pb = layout.page_bytes
            zeros = await recv.call("digest", 0)
            for room, op in {40: WriteOp(0, 0, 0, 2**64 - pb, pb), 41: WriteOp(0, 0, 0, 0, 2**64 - 1),
                             42: WriteOp(0, 0, 0, 0, 8 * pb + 1)}.items():
                with pytest.raises(ConfigError):  # not encodable, or past the sender's own region
                    await send.write(peer, room, [op])
            for room, op in {43: WriteOp(0, 0, 0, 2**63 - pb, pb), 44: WriteOp(0, 0, 0, 2**63 - 1, pb),
                             45: WriteOp(0, 0, 0, 8 * pb - 1, 2)}.items():
                await recv.call("advertise", room, list(range(8)), 0)  # every page granted
                await send.write(peer, room, [op])
                st = await send.wait(room, WAIT_S)
                assert st.state is KVPoll.FAILED and "outside region" in (st.reason or ""), (room, st)
                [(state, reason)] = await recv.call("status", [room])
                assert state == KVPoll.FAILED and "outside region" in reason
            assert await recv.call("digest", 0) == zeros  # not one byte landed
    finally:
        await send.close()


async def test_new_instance_behind_a_cached_address_invalidates_the_connection() -> None:
    """A descriptor naming another instance id at the worker address / liveness port of
    a cached connection means the peer restarted there: the cached connection is
    failed (its rooms with it), never reused, and the new id must prove itself."""
    layout = Layout(layers=1, pages=8, slots=2)
    send, regions, _, _ = await _local(layout, SEED)
    recv, _, _, recv_desc = await _local(layout, None)
    try:
        d = Descriptor.from_bytes(recv_desc)
        peer = await send.connect(recv_desc)
        recv.advertise(RoomGrant.of(51, [0], 0))
        await send.write(peer, 51, page_ops(region_pairs(regions, d.regions), [1], [0]))  # no row: stays open
        assert send.poll(51) is KVPoll.TRANSFERRING
        restarted = Descriptor("rdma", "f" * 32, d.endpoint, d.regions, d.liveness).to_bytes()
        with pytest.raises(PeerFailure):  # the live process there answers as the old id
            await send.connect(restarted)
        st = send.status(51)
        assert st.state is KVPoll.FAILED and "restarted" in (st.reason or ""), st
        again = await send.connect(recv_desc)  # the genuine instance: a fresh connection
        recv.advertise(RoomGrant.of(52, [1], 1))
        meta = metadata_op(regions[-1], 0, d.region(METADATA_REGION_ID), 1)
        await send.write(again, 52, page_ops(region_pairs(regions, d.regions), [2], [1]), metadata=meta)
        assert (await send.wait(52, WAIT_S)).state is KVPoll.SUCCESS
    finally:
        await send.close()
        await recv.close()
