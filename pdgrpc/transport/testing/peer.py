"""Run one side of a transfer in a separate OS process, driven from an asyncio test.

The conformance suite (:mod:`pdgrpc.transport.testing`) and the transport benchmark
use this to put sender and receiver in different processes, which is what real
deployments do and what the failure tests need (a peer can be SIGKILLed).

:class:`PeerProcess` starts a process forked from multiprocessing's fork server (a
clean single-threaded interpreter with torch and this module imported once: no
inherited event loop, threads or sockets, and the parent's environment as of the
start) that builds a KV-shaped memory :class:`Layout`, creates the backend
by name, registers the layout and serves commands over a pipe. Every call is bounded by
a timeout; the parent never blocks its event loop (the pipe is watched with
``add_reader``, no helper thread). The child uses uvloop when it is installed.

Source memory is filled from a seed with a deterministic generator, so the parent can
recompute what a receiver must hold without shipping payloads through the pipe.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import itertools
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import os
import signal
import threading
import time
import traceback
from typing import Any, Awaitable, Callable, Sequence

import torch

from pdgrpc.errors import PeerFailure, TransportError
from pdgrpc.transport import peerauth, registry
from pdgrpc.transport.base import Descriptor, MemoryRegion, Peer, RoomGrant, Transport, WriteOp
from pdgrpc.transport.pages import METADATA_REGION_ID, kv_regions, metadata_op, metadata_region, page_ops, region_pairs
from pdgrpc.host_memory import host_zeros

ROOM_FIELD_BYTES = 8  # the last 8 bytes of a metadata row hold the room id (like bootstrap_room)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A KV pool like a server's: ``layers`` x (K, V) tensors of ``[pages, *page_shape]``
    plus ``slots`` metadata rows of ``row_bytes`` bytes."""

    layers: int = 4
    pages: int = 64
    page_shape: tuple[int, ...] = (16, 2, 64)  # tokens per page, KV heads, head dim
    dtype: str = "float16"
    slots: int = 16
    row_bytes: int = 256
    huge_pages: bool = True  # regions in transparent huge pages (host_memory.host_zeros)
    device: str = "cpu"  # where the KV regions live ("cuda": GPU memory); metadata rows stay on the host

    @property
    def page_bytes(self) -> int:
        n = 1
        for d in self.page_shape:
            n *= d
        return n * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @property
    def kv_bytes(self) -> int:
        return 2 * self.layers * self.pages * self.page_bytes

    def kv_region_ids(self) -> list[int]:
        return list(range(2 * self.layers))

    def region_ids(self) -> list[int]:
        return self.kv_region_ids() + [METADATA_REGION_ID]

    def region_nbytes(self, region_id: int) -> int:
        return self.slots * self.row_bytes if region_id == METADATA_REGION_ID else self.pages * self.page_bytes

    def item_bytes(self, region_id: int) -> int:
        return self.row_bytes if region_id == METADATA_REGION_ID else self.page_bytes

    def source_bytes(self, region_id: int, seed: int) -> torch.Tensor:
        """The deterministic content of a seeded region, as flat uint8."""
        g = torch.Generator().manual_seed(seed * 100_003 + region_id)
        return torch.randint(0, 256, (self.region_nbytes(region_id),), dtype=torch.uint8, generator=g)

    def build(self, seed: int | None) -> tuple[list[MemoryRegion], dict[int, torch.Tensor]]:
        """Regions and their flat uint8 views; filled from ``seed`` or zeroed."""
        dt = getattr(torch, self.dtype)
        flats: dict[int, torch.Tensor] = {}

        def make(region_id: int) -> torch.Tensor:
            n = self.region_nbytes(region_id)
            if self.device != "cpu" and region_id != METADATA_REGION_ID:
                flat = torch.zeros(n, dtype=torch.uint8, device=self.device)
            else:
                flat = host_zeros((n,), torch.uint8) if self.huge_pages else torch.zeros(n, dtype=torch.uint8)
            if seed is not None:
                flat.copy_(self.source_bytes(region_id, seed))
            flats[region_id] = flat
            return flat

        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []
        for layer in range(self.layers):
            for kv, out in ((0, ks), (1, vs)):
                out.append(make(2 * layer + kv).view(dt).view(self.pages, *self.page_shape))
        rows = make(METADATA_REGION_ID).view(self.slots, self.row_bytes)
        return kv_regions(ks, vs) + [metadata_region(rows)], flats


def resource_counts() -> dict[str, int]:
    """What a closed transport must give back: asyncio tasks (besides the caller),
    Python threads, open file descriptors."""
    try:
        tasks = len([t for t in asyncio.all_tasks() if t is not asyncio.current_task()])
    except RuntimeError:
        tasks = 0
    try:
        fds = len(os.listdir("/proc/self/fd"))
    except OSError:
        fds = -1
    return {"tasks": tasks, "threads": threading.active_count(), "fds": fds}


def digest(view: memoryview | torch.Tensor) -> str:
    if isinstance(view, torch.Tensor):
        view = view.contiguous().view(torch.uint8).reshape(-1).cpu().numpy().data  # ndarray.data == memoryview(ndarray), which numpy types only for 3.12+
    return hashlib.sha256(view).hexdigest()


# ----------------------------------------------------------------------------- child


class _PeerServer:
    def __init__(self, conn: multiprocessing.connection.Connection, backend: str, options: dict[str, Any],
                 layout: Layout, seed: int | None) -> None:
        self.conn = conn
        self.backend = backend
        self.options = options
        self.layout = layout
        self.seed = seed
        self.transport: Transport | None = None
        self.peers: dict[str, Peer] = {}
        self.done = asyncio.Event()
        self.baseline: dict[str, int] = {}
        self.announced: list[Callable[[], Awaitable[None]]] = []  # prepared sends never sent

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.regions, self.flats = self.layout.build(self.seed)
        self.baseline = resource_counts()
        self.transport = registry.create(self.backend, **self.options)
        desc = await self.transport.register(self.regions)
        # The parent spawned this process: it may hand out this receiver's credentials.
        self.conn.send(("ready", desc, self.transport.instance_id, self.transport.auth_key))
        tasks: set[asyncio.Task[None]] = set()
        loop.add_reader(self.conn.fileno(), self._on_command, tasks)
        # uvloop's add_reader makes the fd non-blocking; Connection.recv/send of a message
        # larger than the pipe buffer then fails half way (BlockingIOError), which read as
        # "parent gone". Blocking again: a message is always read and written whole.
        os.set_blocking(self.conn.fileno(), True)
        try:
            await self.done.wait()
        finally:
            loop.remove_reader(self.conn.fileno())
            for t in tasks:
                t.cancel()

    def _on_command(self, tasks: set[asyncio.Task[None]]) -> None:
        try:
            while self.conn.poll():
                call_id, method, args = self.conn.recv()
                t = asyncio.ensure_future(self._dispatch(call_id, method, args))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
        except (EOFError, OSError):
            self.done.set()  # parent went away

    async def _dispatch(self, call_id: int, method: str, args: tuple[Any, ...]) -> None:
        try:
            result = await getattr(self, "cmd_" + method)(*args)
            reply = (call_id, True, result)
        except BaseException as exc:  # reported to the parent, which re-raises
            reply = (call_id, False, (type(exc).__name__, str(exc), traceback.format_exc()))
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(reply)

    # commands ------------------------------------------------------------------
    @property
    def t(self) -> Transport:
        assert self.transport is not None
        return self.transport

    async def cmd_connect(self, descriptor: bytes, credential: bytes = b"") -> str:
        if credential:
            self.t.set_credential(Descriptor.from_bytes(descriptor).instance_id, credential)
        peer = await self.t.connect(descriptor)
        self.peers[peer.instance_id] = peer
        return peer.instance_id

    async def cmd_advertise(self, room: int, pages: Sequence[int], slot: int | None) -> None:
        self.t.advertise(RoomGrant.of(room, pages, slot))

    def _stamp(self, src_slot: int, room: int) -> None:
        row = self.flats[METADATA_REGION_ID].view(self.layout.slots, self.layout.row_bytes)[src_slot]
        row[-ROOM_FIELD_BYTES:] = torch.tensor([room], dtype=torch.int64).view(torch.uint8)

    async def cmd_write_pages(self, peer_id: str, room: int, src_pages: Sequence[int], dst_pages: Sequence[int],
                              meta: tuple[int, int] | None) -> int:
        """Write pages (all KV regions) and optionally the metadata row ``meta=(src_slot,
        dst_slot)``, stamping the room id into the source row first. Returns #ops."""
        peer = self.peers[peer_id]
        ops = page_ops(region_pairs(self.regions, peer.descriptor.regions), src_pages, dst_pages)
        mop = None
        if meta is not None:
            self._stamp(meta[0], room)
            mop = metadata_op(self.regions[-1], meta[0], peer.descriptor.require_region(METADATA_REGION_ID), meta[1])
        await self.t.write(peer, room, ops, metadata=mop)
        return len(ops)

    async def cmd_prepare_then_write(self, peer_id: str, room: int, src_pages: Sequence[int], dst_pages: Sequence[int],
                                     meta: tuple[int, int]) -> int:
        """``write_pages`` through ``prepare_write``: prepared while the source row still
        holds another room's id, the room's id stamped in only before the send (a
        prepared write must read the row when it is sent). Returns #ops."""
        peer = self.peers[peer_id]
        ops = page_ops(region_pairs(self.regions, peer.descriptor.regions), src_pages, dst_pages)
        self._stamp(meta[0], room + 1)
        mop = metadata_op(self.regions[-1], meta[0], peer.descriptor.require_region(METADATA_REGION_ID), meta[1])
        send = self.t.prepare_write(peer, room, ops, metadata=mop)
        await asyncio.sleep(0.01)  # "the compute": the loop runs meanwhile
        self._stamp(meta[0], room)
        await send()
        return len(ops)

    async def cmd_announce_pages(self, peer_id: str, room: int, src_pages: Sequence[int], dst_pages: Sequence[int]) -> int:
        """Announce a write of pages through ``prepare_write`` (the receiver posts its
        receives) and never send it, as a sender that dies before its bytes go out.
        Returns #ops."""
        peer = self.peers[peer_id]
        ops = page_ops(region_pairs(self.regions, peer.descriptor.regions), src_pages, dst_pages)
        self.announced.append(self.t.prepare_write(peer, room, ops))
        return len(ops)

    async def cmd_write_pages_many(self, peer_id: str, writes: Sequence[tuple[Any, ...]]) -> int:
        """Several ``write_pages`` in order, in one command (keeps the pipe quiet when
        a test interleaves hundreds of rooms). ``writes``: ``(room, src, dst, meta)``."""
        n = 0
        for room, src, dst, meta in writes:
            n += await self.cmd_write_pages(peer_id, room, src, dst, meta)
        return n

    async def cmd_write_ops(self, peer_id: str, room: int, ops: Sequence[tuple[int, int, int, int, int]],
                            meta: tuple[int, int, int, int, int] | None) -> None:
        await self.t.write(self.peers[peer_id], room, [WriteOp(*o) for o in ops],
                           metadata=None if meta is None else WriteOp(*meta))

    async def cmd_status(self, rooms: Sequence[int]) -> list[tuple[int, str | None]]:
        out = []
        for r in rooms:
            st = self.t.status(r)
            out.append((int(st.state), st.reason))
        return out

    async def cmd_wait(self, rooms: Sequence[int], timeout: float) -> list[tuple[int, str | None]]:
        deadline = time.monotonic() + timeout
        for r in rooms:
            await self.t.wait(r, max(0.0, deadline - time.monotonic()))
        return await self.cmd_status(rooms)

    async def cmd_transfer_started(self, room: int) -> float | None:
        return self.t.transfer_started(room)

    async def cmd_receives_posted(self, room: int) -> int | None:
        """How many data receives the transport has posted for ``room`` (None: the
        backend does not say; see ``RdmaTransport.receives_posted``)."""
        count = getattr(self.t, "receives_posted", None)
        return None if count is None else int(count(room))

    async def cmd_release(self, room: int) -> None:
        self.t.release(room)

    async def cmd_drain(self, room: int, timeout: float) -> bool:
        return await self.t.drain(room, timeout)

    async def cmd_fail_peer(self, instance_id: str, reason: str) -> None:
        self.t.fail_peer(instance_id, reason)

    async def cmd_digest(self, region_id: int, start: int = 0, end: int | None = None) -> str:
        return digest(self.flats[region_id][start:end])

    async def cmd_digest_pages(self, region_ids: Sequence[int], pages: Sequence[int]) -> str:
        """Digest of the listed pages (items) of each region, regions then pages in order.
        Computed in a thread: hundreds of MiB take seconds on a busy host, and the loop
        must keep answering the transport's liveness heartbeats meanwhile."""
        parts = [self.flats[r].view(-1, self.layout.item_bytes(r))[list(pages)].reshape(-1) for r in region_ids]
        return await asyncio.to_thread(lambda: digest(torch.cat(parts)))

    async def cmd_read(self, region_id: int, start: int, end: int) -> bytes:
        return bytes(self.flats[region_id][start:end].cpu().numpy().data)

    async def cmd_close(self) -> dict[str, int]:
        await self.t.close()
        await asyncio.sleep(0.05)  # let cancelled callbacks run
        after = resource_counts()
        after["tasks"] -= 1  # this command's own task
        return {k: after[k] - self.baseline[k] for k in after}

    async def cmd_exit(self) -> None:
        self.done.set()


def _child_main(conn: multiprocessing.connection.Connection, backend: str, options: dict[str, Any],
                layout: Layout, seed: int | None, environ: dict[str, str]) -> None:
    # The fork server's environment is the parent's when the server started: take the
    # parent's now, as a freshly spawned process would.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.setdefault("UCX_TLS", "tcp,sm,self")
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    server = _PeerServer(conn, backend, options, layout, seed)
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    try:
        with runner:
            runner.run(server.run())
    except BaseException as exc:
        with contextlib.suppress(Exception):
            conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        raise


# ---------------------------------------------------------------------------- parent


def _context(device: str) -> multiprocessing.context.SpawnContext | multiprocessing.context.ForkServerContext:
    """How a peer process starts. A host-memory peer forks from the fork server, torch
    and this module preloaded there, so it starts without importing them again (the
    server imports them once per test process). A GPU peer is spawned: torch refuses
    CUDA in a child forked from a process that asked about CUDA, and importing the
    testing package asks."""
    if device != "cpu":
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", __name__])
    return ctx


class PeerProcess:
    """A transport peer in its own process. Use as ``async with PeerProcess(...) as p``.

    ``p.descriptor`` / ``p.instance_id`` are the child's; ``await p.call(name, *args)``
    runs a command (see ``_PeerServer.cmd_*``); ``p.kill()`` SIGKILLs it."""

    def __init__(self, backend: str, *, layout: Layout = Layout(), seed: int | None = None,
                 options: dict[str, Any] | None = None, start_timeout: float = 90.0) -> None:
        self.backend = backend
        self.layout = layout
        self.seed = seed
        self.options = dict(options or {})
        self.start_timeout = start_timeout
        self.descriptor = b""
        self.instance_id = ""
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._ready: asyncio.Future[tuple[bytes, str]] | None = None
        self._proc: Any = None
        self._conn: multiprocessing.connection.Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead = False

    async def __aenter__(self) -> "PeerProcess":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    @property
    def pid(self) -> int:
        return int(self._proc.pid)

    async def start(self) -> None:
        ctx = _context(self.layout.device)
        parent, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(
            target=_child_main, args=(child, self.backend, self.options, self.layout, self.seed, dict(os.environ)),
            daemon=True,
        )
        self._proc.start()
        child.close()
        self._conn = parent
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._loop.add_reader(parent.fileno(), self._on_readable)
        os.set_blocking(parent.fileno(), True)  # see the child's side: whole messages only
        try:
            self.descriptor, self.instance_id = await asyncio.wait_for(
                asyncio.shield(self._ready), self.start_timeout
            )
        except BaseException:
            self.kill()
            await self.stop()
            raise

    def _on_readable(self) -> None:
        assert self._conn is not None
        try:
            while self._conn.poll():
                msg = self._conn.recv()
                if msg[0] == "ready":
                    peerauth.remember_key(msg[2], msg[3])
                    if self._ready is not None and not self._ready.done():
                        self._ready.set_result((msg[1], msg[2]))
                elif msg[0] == "error":
                    self._fail_all(PeerFailure(f"peer process failed: {msg[1]}\n{msg[2]}"))
                else:
                    call_id, ok, value = msg
                    fut = self._pending.pop(call_id, None)
                    if fut is None or fut.done():
                        continue
                    if ok:
                        fut.set_result(value)
                    else:
                        name, text, tb = value
                        fut.set_exception(TransportError(f"peer command failed: {name}: {text}\n{tb}"))
        except (EOFError, OSError):
            self._fail_all(PeerFailure(f"peer process {self.pid} exited"))

    def _fail_all(self, exc: BaseException) -> None:
        self._dead = True
        if self._conn is not None and self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._conn.fileno())
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(exc)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(exc)
        self._pending.clear()

    async def call(self, method: str, *args: Any, timeout: float = 60.0) -> Any:
        if self._dead or self._conn is None:
            raise PeerFailure(f"peer process is not running (call {method})")
        assert self._loop is not None
        if method == "connect" and len(args) == 1:
            # A receiver this process spawned or holds: hand its credential along, as the
            # control plane would (pdgrpc.transport.peerauth).
            with contextlib.suppress(Exception):
                args = (args[0], peerauth.known_credential(Descriptor.from_bytes(args[0]).instance_id, self.instance_id))
        call_id = next(self._ids)
        fut = self._loop.create_future()
        self._pending[call_id] = fut
        self._conn.send((call_id, method, args))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._pending.pop(call_id, None)

    def kill(self) -> None:
        """SIGKILL the peer (no cleanup runs in it: sockets are closed by the kernel)."""
        if self._proc is not None and self._proc.is_alive():
            os.kill(self._proc.pid, signal.SIGKILL)

    async def wait_dead(self, timeout: float = 10.0) -> float:
        """Wait until the process is reaped; returns the monotonic time it was seen dead."""
        deadline = time.monotonic() + timeout
        while self._proc.is_alive():
            if time.monotonic() > deadline:
                raise TimeoutError(f"peer process {self.pid} still alive after {timeout} s")
            await asyncio.sleep(0.005)
        return time.monotonic()

    async def stop(self, timeout: float = 10.0) -> None:
        """Ask the child to exit; kill it if it does not; always reap it."""
        if self._proc is None:
            return
        if not self._dead and self._proc.is_alive():
            with contextlib.suppress(Exception):
                await self.call("exit", timeout=timeout)
        deadline = time.monotonic() + timeout
        while self._proc.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self.kill()
        while self._proc.is_alive():
            await asyncio.sleep(0.01)
        self._proc.join(1)
        self._fail_all(PeerFailure("peer process stopped"))
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        with contextlib.suppress(Exception):
            self._proc.close()
        self._proc = None
