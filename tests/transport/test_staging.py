"""The staging pipeline (pinned buffers between device regions and a socket): its
pieces, copies, ordering, overlap and back-pressure, on CPU tensors with injected copies."""

from __future__ import annotations

import asyncio
import random
from typing import Callable

import numpy as np
import pytest
import torch

from pdgrpc.device import ChunkReady, poll_until
from pdgrpc.transport.devcopy import gather_into, scatter_from
from pdgrpc.transport.staging import Piece, StagedReceive, StagingPool, split_pieces, stage_out


def _bytes_of(pieces: list[Piece]) -> list[tuple[int, int]]:
    """Every (region, byte offset) the pieces cover, in order."""
    return [(int(r), o + i) for p in pieces for r, o, n in zip(p.regions, p.offsets, p.lengths) for i in range(int(n))]


def _ops(rng: random.Random, n_regions: int, pages: int, page_bytes: int, count: int) -> tuple[np.ndarray, ...]:
    regions, offsets, lengths = [], [], []
    for r in range(n_regions):
        for p in rng.sample(range(pages), count):
            regions.append(r)
            offsets.append(p * page_bytes)
            lengths.append(page_bytes)
    return np.array(regions), np.array(offsets), np.array(lengths)


@pytest.mark.parametrize("piece_bytes", [1, 7, 64, 100, 4096, 1 << 20])
def test_split_pieces_keeps_every_byte_in_order(piece_bytes: int) -> None:
    regions, offsets, lengths = np.array([0, 0, 1, 2]), np.array([0, 300, 64, 5]), np.array([100, 50, 200, 33])
    pieces = list(split_pieces(regions, offsets, lengths, piece_bytes))
    assert all(0 < p.nbytes <= piece_bytes for p in pieces)
    assert all(p.nbytes == piece_bytes for p in pieces[:-1])  # only the last piece is short
    want = [(int(r), int(o) + i) for r, o, n in zip(regions, offsets, lengths) for i in range(int(n))]
    assert _bytes_of(pieces) == want


def test_split_pieces_of_nothing() -> None:
    assert list(split_pieces(np.array([], dtype=np.int64), np.array([], dtype=np.int64), np.array([], dtype=np.int64), 8)) == []


@pytest.mark.parametrize(("page_bytes", "count"), [(256, 40), (96, 3), (24, 30)])  # row copies, few ranges, odd alignment
def test_gather_then_scatter_round_trips(page_bytes: int, count: int) -> None:
    rng = random.Random(page_bytes)
    pages = 64
    src = {r: torch.randint(0, 256, (pages * page_bytes,), dtype=torch.uint8) for r in range(3)}
    dst = {r: torch.zeros(pages * page_bytes, dtype=torch.uint8) for r in range(3)}
    regions, offsets, lengths = _ops(rng, 3, pages, page_bytes, count)
    d_offsets = offsets[::-1].copy()  # the destination pages, in another order
    buf = torch.zeros(5000, dtype=torch.uint8)
    src_pieces = list(split_pieces(regions, offsets, lengths, 5000))
    dst_pieces = list(split_pieces(regions, d_offsets, lengths, 5000))
    for sp, dp in zip(src_pieces, dst_pieces):
        assert gather_into(src, sp, buf).done()
        assert scatter_from(dst, dp, buf).done()
    for r, o, d, n in zip(regions, offsets, d_offsets, lengths):
        assert torch.equal(dst[int(r)][d : d + n], src[int(r)][o : o + n])


class Gate(ChunkReady):
    """A copy that finishes when the test says so."""

    def __init__(self) -> None:
        self.ev = asyncio.Event()

    def done(self) -> bool:
        return self.ev.is_set()

    async def wait(self) -> None:
        await self.ev.wait()

    def synchronize(self) -> None:
        self.ev.set()


async def _until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    async def loop() -> None:
        while not cond():
            await asyncio.sleep(0.001)

    await asyncio.wait_for(loop(), timeout)


def _pieces(n: int, size: int = 10) -> list[Piece]:
    return [Piece(np.array([0]), np.array([i * size]), np.array([size])) for i in range(n)]


def _pool(count: int) -> StagingPool:
    return StagingPool(count, 64, alloc=lambda n: torch.zeros(n, dtype=torch.uint8))


def test_stage_out_overlaps_copy_with_send_and_keeps_order() -> None:
    """The copy of piece k+1 starts before piece k is sent; pieces go out in order even
    when a later copy finishes first."""
    log: list[str] = []
    gates: list[Gate] = []

    def copy_out(piece: Piece, buf: torch.Tensor) -> ChunkReady:
        k = int(piece.offsets[0]) // 10
        log.append(f"copy {k}")
        buf[:10] = k
        gates.append(Gate())
        return gates[-1]

    def send(piece: Piece, view: memoryview, release: Callable[[], None]) -> None:
        log.append(f"send {int(piece.offsets[0]) // 10} {view[0]}")
        release()

    async def main() -> int:
        task = asyncio.create_task(stage_out(_pieces(4), _pool(3), copy_out, send))
        await _until(lambda: len(gates) == 3)  # three copies started (one per buffer), none finished
        await asyncio.sleep(0.01)
        gates[2].ev.set()  # later copies finish first: still nothing may go out before piece 0
        gates[1].ev.set()
        await asyncio.sleep(0.01)
        assert not [e for e in log if e.startswith("send")], log
        gates[0].ev.set()
        await _until(lambda: len(gates) == 4)
        gates[3].ev.set()
        return await asyncio.wait_for(task, 5)

    assert asyncio.run(main()) == 40
    sends = [e for e in log if e.startswith("send")]
    assert sends == ["send 0 0", "send 1 1", "send 2 2", "send 3 3"]
    assert log.index("copy 2") < log.index("send 0 0")  # copies ran ahead of the socket


def test_stage_out_back_pressure_bounds_staged_bytes() -> None:
    """A socket that does not take bytes stops the copies at the pool size."""
    copies = 0
    held: list[Callable[[], None]] = []

    def copy_out(piece: Piece, buf: torch.Tensor) -> ChunkReady:
        nonlocal copies
        copies += 1
        g = Gate()
        g.ev.set()
        return g

    def send(piece: Piece, view: memoryview, release: Callable[[], None]) -> None:
        held.append(release)

    async def main() -> None:
        pool = _pool(2)
        task = asyncio.create_task(stage_out(_pieces(6), pool, copy_out, send))
        await _until(lambda: len(held) == 2)
        await asyncio.sleep(0.02)
        assert copies == 2 and not task.done()  # stuck: the socket holds both buffers
        for _ in range(4):
            held.pop(0)()  # the socket takes one piece: exactly one more copy starts
            await _until(lambda: len(held) == 2)
        await asyncio.wait_for(task, 5)
        assert copies == 6 and pool.high_water == 2 and pool.free_count == 0

    asyncio.run(main())


def test_staged_receive_lands_only_after_every_copy() -> None:
    """Bytes count as landed once the last device copy finished; buffers are reused only
    after their copy; the data arrives whole."""
    dst = {0: torch.zeros(100, dtype=torch.uint8)}
    payload = torch.arange(100, dtype=torch.uint8)
    gates: list[Gate] = []

    def copy_in(piece: Piece, buf: torch.Tensor) -> ChunkReady:
        scatter_from(dst, piece, buf)  # the bytes move now; "finished" when the gate opens
        gates.append(Gate())
        return gates[-1]

    pieces = list(split_pieces(np.array([0]), np.array([0]), np.array([100]), 16))
    pool = _pool(2)
    rx = StagedReceive(pieces, pool, copy_in)
    got = 0
    while not rx.all_received:
        view = rx.next_buffer()  # with both buffers copying, waits for the oldest copy (Gate.synchronize)
        view[:] = payload[got : got + len(view)].numpy().tobytes()
        got += len(view)
        rx.piece_received()
    assert len(gates) == 7 and pool.high_water == 2
    assert rx.reap_all() is False  # copies still running: not landed yet
    for g in gates:
        g.ev.set()
    assert rx.reap_all() is True
    assert torch.equal(dst[0], payload) and pool.free_count == 2


def test_abandoned_receive_returns_its_buffers_once_their_copies_finish() -> None:
    """A room released mid-frame: the buffer being read comes back at once, one still
    copying into the device only when that copy finished (never reused under it)."""
    gate = Gate()
    pieces = _pieces(3, size=16)
    pool = _pool(2)
    rx = StagedReceive(pieces, pool, lambda piece, buf: gate)
    rx.next_buffer()
    rx.piece_received()  # piece 0 is copying
    rx.next_buffer()  # piece 1 is being read when the room is released
    rx.abandon()
    assert pool.try_acquire() is not None  # the buffer piece 1 was read into
    assert pool.try_acquire() is None  # piece 0's is still under its copy
    gate.ev.set()
    assert pool.try_acquire() is not None


def test_next_frame_waits_for_the_copies_of_earlier_frames() -> None:
    """Frames follow each other on one connection faster than the device copies finish:
    a frame whose buffers are all held by earlier frames' copies waits for the oldest
    of them (they share the connection's pool) instead of losing the connection, and
    every frame lands whole."""
    dst = {0: torch.zeros(64, dtype=torch.uint8)}
    payload = torch.arange(64, dtype=torch.uint8)
    gates: list[Gate] = []

    def copy_in(piece: Piece, buf: torch.Tensor) -> ChunkReady:
        scatter_from(dst, piece, buf)
        gates.append(Gate())
        return gates[-1]

    pool = _pool(2)
    frames = [StagedReceive([Piece(np.array([0]), np.array([16 * k]), np.array([16]))], pool, copy_in)
              for k in range(4)]  # one piece each, bytes 16k..16k+16
    for k, rx in enumerate(frames):
        view = rx.next_buffer()  # frames 2 and 3 find both buffers under earlier copies
        view[:] = payload[16 * k : 16 * k + 16].numpy().tobytes()
        rx.piece_received()
    assert [g.done() for g in gates] == [True, True, False, False]  # the oldest copies were waited for
    assert pool.high_water == 2
    for g in gates:
        g.ev.set()
    assert all(rx.reap_all() for rx in frames)
    assert torch.equal(dst[0], payload) and pool.free_count == 2


class _FinishesWhileWatched(ChunkReady):
    """A device copy that is running for its first ``looks`` queries and done after:
    it finishes while someone is looking at it."""

    def __init__(self, looks: int) -> None:
        self.looks = looks

    def done(self) -> bool:
        self.looks -= 1
        return self.looks < 0


def test_a_copy_that_finishes_while_the_pool_sweeps_gives_its_buffer_back() -> None:
    pool = StagingPool(count=2, piece_bytes=8, alloc=lambda n: torch.empty(n, dtype=torch.uint8))
    i = pool.try_acquire()
    assert i is not None
    pool.release_after(i, _FinishesWhileWatched(looks=2))  # running when handed over and at the sweep's first look
    pool.free_count  # a sweep, during which the copy finishes
    assert pool.free_count == 2  # its buffer is free, never lost


class _Copy(ChunkReady):
    """A device copy that finishes when the test says."""

    def __init__(self) -> None:
        self.finished = False

    def done(self) -> bool:
        return self.finished

    async def wait(self) -> None:
        await poll_until(self.done)


async def test_acquire_takes_a_buffer_once_the_copy_holding_it_finishes() -> None:
    # A cancelled send leaves its buffers to copies still running; the next send waits for them, not forever.
    pool = StagingPool(count=1, piece_bytes=8, alloc=lambda n: torch.empty(n, dtype=torch.uint8))
    i = pool.try_acquire()
    assert i is not None
    copy = _Copy()
    pool.release_after(i, copy)
    waiting = asyncio.ensure_future(pool.acquire())
    await asyncio.sleep(0.01)
    assert not waiting.done()
    copy.finished = True
    assert await asyncio.wait_for(waiting, 5) == i
