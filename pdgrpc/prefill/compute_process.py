"""A prefill worker's forward pass in a process of its own: ``--compute-in process``.

Why
---
The worker serves gRPC, the controller link and the transport on its asyncio loop; with
the compute on a thread of the same process, every bit of the loop's work during a prompt
stops the reference model's (mostly Python) forward pass for as long as it runs. In a
process of its own the compute shares no interpreter with the loop, so neither waits
for the other's GIL.

How
---
The KV pool lives in one ``memfd`` that both processes map: the worker's engine (pages,
layout, validation; it computes nothing) and the transport use the worker's mapping,
the child's engine (same config, same seed: the same weights) computes into its own.
Nothing is copied. One message per prompt goes to the child (its ids, pages and
sampling, the chunk size and when to post); the child computes chunk after chunk,
taking turns between prompts chunk by chunk as the compute thread does, and posts a
chunk back only when the worker has something to do with it (``min_write_bytes`` of
completed pages, or the last chunk: :class:`~pdgrpc.state.chunk_posting.ChunkPosting`).
One round trip per chunk would leave the child idle during each.

Messages are pickled, each preceded by its length (``<I``), over a Unix socketpair:

* worker -> child: ``("prefill", job, request, chunk_tokens, min_pages, page_size, start)``,
  ``("cancel", job)``;
* child -> worker: ``("post", job, end, token, seconds, error)``, ``("stopped", job)``
  once the child will not touch the job's pages again.

Failure: a child that dies fails the jobs in flight with :class:`ComputeProcessLost`
and calls ``on_lost`` once (the worker then exits non-zero, so its controller sees a dead
rank). The child exits when its socket closes and is killed by the kernel if the worker
dies (``PR_SET_PDEATHSIG``). Only for a worker without a TP group: the gloo group and its
all-reduce live in the worker process.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import gc
import logging
import mmap
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

import torch

from pdgrpc.engine.base import KVBuffers, PrefillRequest, SampledToken
from pdgrpc.engine.errors import EngineError
from pdgrpc.engine.layout import KVLayout
from pdgrpc.engine.malloc import keep_freed_memory
from pdgrpc.engine.reference import ReferenceEngine
from pdgrpc.metrics.catalog import ServerAbortReason
from pdgrpc.prefill.compute import ChunkPost, Compute, ComputeJob, uncancellable
from pdgrpc.prefill.errors import RequestFailed
from pdgrpc.prefill.statuses import Refusal, ending
from pdgrpc.prefill.compute_child import Child, spawn
from pdgrpc.serving.threads import lower_process_priority
from pdgrpc.state.chunk_posting import ChunkPosting

__all__ = ["ComputeProcess", "ComputeProcessLost", "ProcessCompute", "pool_bytes", "shared_kv_pool"]

log = logging.getLogger("pdgrpc.prefill")

_LEN = struct.Struct("<I")
_ALIGN = 2 << 20  # each K/V region starts on a 2 MiB boundary
_START_TIMEOUT_S = 300.0  # importing torch and drawing the weights, on a loaded host

Post = Callable[[int, "SampledToken | None", float, "BaseException | None"], None]


class ComputeProcessLost(EngineError):
    """The compute process is gone (exited, killed, or its socket broke)."""


def _region_bytes(layout: KVLayout) -> int:
    n = layout.element_size
    for d in layout.pool_shape:
        n *= d
    return n


def pool_bytes(layout: KVLayout) -> int:
    """The size of the shared memory that holds ``layout``'s pool (:func:`shared_kv_pool`)."""
    return -(-_region_bytes(layout) // _ALIGN) * _ALIGN * 2 * layout.num_layers


def shared_kv_pool(layout: KVLayout, fd: int, huge_pages: bool = False) -> tuple[KVBuffers, mmap.mmap]:
    """The pool's tensors over the shared memory ``fd``: ``k[0..L)`` then ``v[0..L)``,
    each region 2 MiB-aligned. Keep the returned mapping alive as long as the tensors.
    ``huge_pages`` (``--kv-huge-pages``) asks for transparent huge pages, which Linux
    gives shared memory only where ``/sys/kernel/mm/transparent_hugepage/shmem_enabled``
    allows it (``advise`` or ``always``).

    Either way the mapping is resident when this returns: the pool's memory is allocated
    and mapped in this process now, as ``torch.zeros`` does a private pool's, not faulted
    in page by page inside the compute of the prompts that first use it (with huge pages,
    by touching it once advised: populating first would give ordinary pages)."""
    total = pool_bytes(layout)
    populate = 0 if huge_pages else getattr(mmap, "MAP_POPULATE", 0)
    region = mmap.mmap(fd, total, flags=mmap.MAP_SHARED | populate, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # not for shared memory here: ordinary pages
            pass
    whole = torch.frombuffer(region, dtype=torch.uint8)
    per, nbytes = total // (2 * layout.num_layers), _region_bytes(layout)
    views = [whole[i * per : i * per + nbytes].view(layout.dtype).view(layout.pool_shape) for i in range(2 * layout.num_layers)]
    if not populate:
        for t in views:
            t.zero_()  # the memory is zero already: this only faults it in
    return KVBuffers(k=tuple(views[: layout.num_layers]), v=tuple(views[layout.num_layers :])), region


def _frame(msg: Any) -> bytes:
    body = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(body)) + body


@dataclasses.dataclass
class _Job:
    post: Post
    stopped: Callable[[], None]


class ComputeProcess:
    """The child process and the worker's end of its socket (asyncio).

    ``await ComputeProcess.start(config, ...)`` starts the child, which builds a
    ``ReferenceEngine(config)`` over the shared pool; :attr:`kv` is that pool for the
    worker's own engine (``ReferenceEngine(config, kv_pool=cp.kv)``)."""

    def __init__(self, layout: KVLayout, name: str) -> None:
        self.layout = layout
        self.name = name
        self.on_lost: Callable[[str], None] | None = None
        self.lost: str | None = None  # why the child is gone; None while it serves
        self._jobs: dict[int, _Job] = {}
        self._next_job = 1
        self._buf = bytearray()
        self._sock: socket.socket | None = None
        self._map: mmap.mmap | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.kv: KVBuffers

    @classmethod
    async def start(
        cls, config: Any, *, name: str, nice: int = 0, malloc_keep_bytes: int = 0, child: Child | None = None,
    ) -> "ComputeProcess":
        """``child``: the process :func:`~pdgrpc.prefill.compute_child.spawn` started for it
        (started here without one); closed here when the start fails."""
        if config.tp_size != 1:
            if child is not None:
                child.discard()
            raise EngineError("a compute process serves only a TP-1 engine (the TP group lives in the worker)")
        self = cls(config.kv_layout(), name)
        if child is None:
            child = spawn(name)
        self.proc, self._sock = child.proc, child.sock
        try:
            memfd = os.memfd_create(f"pdgrpc-kv-{name}", os.MFD_CLOEXEC)
            try:
                os.ftruncate(memfd, pool_bytes(self.layout))
                self.kv, self._map = shared_kv_pool(self.layout, memfd, config.kv_huge_pages)
                hello = asyncio.to_thread(self._hello, config, nice, malloc_keep_bytes, memfd)
                await asyncio.wait_for(hello, _START_TIMEOUT_S)
            finally:
                os.close(memfd)  # the child has its own; our mapping keeps the memory alive
        except BaseException as exc:
            self.close()
            if isinstance(exc, (asyncio.TimeoutError, OSError, EOFError)):
                raise ComputeProcessLost(f"{name}: compute process did not start: {exc!r} (exit code {self.proc.poll()})") from None
            raise
        self._sock.setblocking(False)
        asyncio.get_running_loop().add_reader(self._sock.fileno(), self._on_readable)
        log.info("%s: compute process %d ready (KV pool %.1f MiB shared)", name, self.proc.pid, pool_bytes(self.layout) / 2**20)
        return self

    def _hello(self, config: Any, nice: int, keep: int, memfd: int) -> None:
        assert self._sock is not None
        frame = _frame(("init", config, self.layout, nice, keep))
        # The pool's memory rides on the frame's first bytes (SCM_RIGHTS): the child
        # was started before the pool existed.
        sent = socket.send_fds(self._sock, [frame[: _LEN.size]], [memfd])
        self._sock.sendall(frame[sent:])
        reply = _read_frame(self._sock)
        if reply[0] != "ready":
            raise EngineError(f"{self.name}: compute process failed to start: {reply[1]}")

    # ---- jobs ---------------------------------------------------------------------------

    def submit(self, request: PrefillRequest, chunk_tokens: int, min_pages: int, page_size: int,
               post: Post, stopped: Callable[[], None], start: int = 0) -> int:
        """Compute ``request`` chunk by chunk from token ``start``; ``post(end, token, seconds, error)`` for the
        chunks the worker acts on, ``stopped()`` once the child is done with its pages.
        Returns the job id (for :meth:`cancel`). Raises :class:`ComputeProcessLost`."""
        if self.lost is not None:
            raise ComputeProcessLost(self.lost)
        job = self._next_job
        self._next_job += 1
        self._jobs[job] = _Job(post, stopped)
        self._send(("prefill", job, request, chunk_tokens, min_pages, page_size, start))
        return job

    def cancel(self, job: int) -> None:
        """Stop ``job`` after the chunk in progress; ``stopped`` follows."""
        if job in self._jobs and self.lost is None:
            self._send(("cancel", job))

    def _send(self, msg: Any) -> None:
        assert self._sock is not None
        data = _frame(msg)
        try:
            # A few KiB into a socket buffer the child drains between chunks: a full
            # buffer would mean the child hung, so wait for it briefly, not forever.
            self._sock.settimeout(10.0)
            self._sock.sendall(data)
        except OSError as exc:
            self._fail(f"{self.name}: sending to compute process {self._pid()} failed: {exc!r}")
        finally:
            if self._sock.fileno() >= 0:
                self._sock.setblocking(False)

    def _on_readable(self) -> None:
        assert self._sock is not None
        try:
            data = self._sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            data = b""
            why = repr(exc)
        else:
            why = "its socket closed"
        if not data:
            self._fail(f"{self.name}: compute process {self._pid()} is gone ({why}; exit code {self._exit_code()})")
            return
        self._buf += data
        while len(self._buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(self._buf)
            if len(self._buf) < _LEN.size + n:
                break
            msg = pickle.loads(bytes(self._buf[_LEN.size : _LEN.size + n]))
            del self._buf[: _LEN.size + n]
            self._dispatch(msg)

    def _dispatch(self, msg: tuple[Any, ...]) -> None:
        if msg[0] == "post":
            _, job, end, token, secs, err = msg
            j = self._jobs.get(job)
            if j is not None:
                j.post(end, token, secs, err)
        elif msg[0] == "stopped":
            j = self._jobs.pop(msg[1], None)
            if j is not None:
                j.stopped()

    def _pid(self) -> int:
        return self.proc.pid if self.proc is not None else -1

    def _exit_code(self) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(0.5)
        except subprocess.TimeoutExpired:
            return None

    def _fail(self, why: str) -> None:
        if self.lost is not None:
            return
        self.lost = why
        log.error("%s", why)
        self._unwatch()
        jobs, self._jobs = self._jobs, {}
        for j in jobs.values():
            j.post(-1, None, 0.0, ComputeProcessLost(why))
            j.stopped()
        if self.on_lost is not None:
            self.on_lost(why)

    def _unwatch(self) -> None:
        if self._sock is not None and self._sock.fileno() >= 0:
            try:
                asyncio.get_running_loop().remove_reader(self._sock.fileno())
            except RuntimeError:  # no loop running (start-up failed)
                pass

    def close(self, timeout: float = 5.0) -> None:
        """Stop the child: EOF on its socket, SIGKILL after ``timeout``. Blocks while the
        child exits (it finishes the chunk in progress): on a running loop, use
        :meth:`aclose`."""
        self._close_socket()
        self._reap(timeout)

    async def aclose(self, timeout: float = 5.0) -> None:
        """:meth:`close` without blocking the loop."""
        self._close_socket()
        await asyncio.to_thread(self._reap, timeout)

    def _close_socket(self) -> None:
        if self.lost is None:
            self.lost = f"{self.name}: compute process closed"
        self._unwatch()
        if self._sock is not None:
            self._sock.close()

    def _reap(self, timeout: float) -> None:
        if self.proc is not None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclasses.dataclass(eq=False)
class _ProcessJob(ComputeJob):
    job: int = 0  # the child's job id
    stopped: "asyncio.Future[None] | None" = None  # resolves once the child is done with the pages


class ProcessCompute(Compute):
    """``--compute-in process``: the :class:`Compute` over a started :class:`ComputeProcess`.
    Its last write is planned while the child computes (the loop's Python is then off the
    compute's path)."""

    plans_final_write = True

    def __init__(self, cproc: ComputeProcess, chunk_size: int, min_pages: int, page_size: int) -> None:
        super().__init__()
        self.cproc, self.chunk_size, self.min_pages, self.page_size = cproc, chunk_size, min_pages, page_size

    async def start(self) -> None:
        self.cproc.on_lost = self._break

    def begin(self, room: int, request: PrefillRequest, start: int = 0) -> ComputeJob:
        n = len(request.token_ids)
        job = _ProcessJob(room, stopped=asyncio.get_running_loop().create_future())
        stopped = job.stopped
        assert stopped is not None

        def post(end: int, token: SampledToken | None, secs: float, err: BaseException | None) -> None:
            if err is None and end == n:
                job.computed_all = True
            if isinstance(err, ComputeProcessLost):
                err = ending(Refusal.GONE, f"room {room}: {err}", ServerAbortReason.INTERNAL_ERROR)
            job.deliver(ChunkPost(n if end < 0 else end, token, secs, err))

        def child_stopped() -> None:
            if not stopped.done():
                stopped.set_result(None)

        try:
            job.job = self.cproc.submit(request, self.chunk_size, self.min_pages, self.page_size, post, child_stopped, start)
        except ComputeProcessLost as exc:
            stopped.set_result(None)
            raise ending(Refusal.GONE, f"room {room}: {exc}") from None
        return job

    async def finish(self, room: int, job: ComputeJob | None) -> None:
        if isinstance(job, _ProcessJob) and job.stopped is not None:
            if job.job and not job.stopped.done():
                self.cproc.cancel(job.job)  # it stops after the chunk in progress
            await uncancellable(job.stopped)

    async def close(self) -> None:
        await self.cproc.aclose()


def _read_frame(sock: socket.socket) -> Any:
    head = _read_exact(sock, _LEN.size)
    return pickle.loads(_read_exact(sock, _LEN.unpack(head)[0]))


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise EOFError("socket closed")
        buf += part
    return bytes(buf)


# ---- the child ------------------------------------------------------------------------


@dataclasses.dataclass
class _ChildJob:
    job: int
    request: PrefillRequest
    chunk: int
    min_pages: int
    page_size: int
    start: int = 0

    def __post_init__(self) -> None:
        self.posting = ChunkPosting(len(self.request.token_ids), self.page_size, self.min_pages)


def _read_init(sock: socket.socket) -> tuple[Any, int]:
    """The first frame and the file descriptor of the KV pool's memory that comes with it."""
    head, fds, _, _ = socket.recv_fds(sock, _LEN.size, 1)
    if not head:
        raise EOFError("socket closed")
    if len(fds) != 1:
        raise EngineError(f"the first message came with {len(fds)} file descriptors, not the KV pool's one")
    head += _read_exact(sock, _LEN.size - len(head))
    return pickle.loads(_read_exact(sock, _LEN.unpack(head)[0])), fds[0]


def _serve(sock: socket.socket) -> int:
    try:
        (_, config, layout, nice, keep), kv_fd = _read_init(sock)
    except EOFError:
        return 0
    try:
        if keep:
            keep_freed_memory(keep)
        lower_process_priority(nice)
        kv, _map = shared_kv_pool(layout, kv_fd, config.kv_huge_pages)
        os.close(kv_fd)
        engine = ReferenceEngine(config, kv_pool=kv)
    except BaseException as exc:
        sock.sendall(_frame(("fail", repr(exc))))
        return 1
    gc.freeze()  # the engine and modules live as long as the child: no collection scans them again
    sock.sendall(_frame(("ready", None)))
    jobs: collections.deque[_ChildJob] = collections.deque()
    buf = bytearray()
    while True:
        # Commands first (new prompts, cancels); block only when there is nothing to compute.
        if not jobs or select.select([sock], [], [], 0)[0]:
            data = sock.recv(1 << 16)
            if not data:  # the worker closed the socket (or died): done
                return 0
            buf += data
            while len(buf) >= _LEN.size:
                (n,) = _LEN.unpack_from(buf)
                if len(buf) < _LEN.size + n:
                    break
                msg = pickle.loads(bytes(buf[_LEN.size : _LEN.size + n]))
                del buf[: _LEN.size + n]
                if msg[0] == "prefill":
                    jobs.append(_ChildJob(*msg[1:]))
                elif msg[0] == "cancel":
                    for j in [j for j in jobs if j.job == msg[1]]:
                        jobs.remove(j)
                        sock.sendall(_frame(("stopped", j.job)))
            continue
        j = jobs[0]
        n = len(j.request.token_ids)
        end = min(n, j.start + j.chunk)
        t = time.perf_counter()
        try:
            token: SampledToken | None = engine.prefill_chunk(j.request, j.start, end)
        except Exception as exc:
            err: BaseException = exc
            try:
                pickle.dumps(exc)
            except Exception:
                err = EngineError(f"{type(exc).__name__}: {exc}")
            jobs.popleft()
            sock.sendall(_frame(("post", j.job, end, None, j.posting.failed(), err)) + _frame(("stopped", j.job)))
            continue
        due = j.posting.computed(end, time.perf_counter() - t)
        out = b"" if due is None else _frame(("post", j.job, end, token, due, None))
        jobs.popleft()
        if end == n:
            out += _frame(("stopped", j.job))
        else:
            j.start = end
            jobs.append(j)  # behind the other prompts' next chunks: first come, first served
        if out:
            sock.sendall(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="A prefill worker's compute process (started by the worker; not run by hand).")
    p.add_argument("--sock-fd", type=int, required=True)
    p.add_argument("--name", default="compute")
    ns = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker decides when we stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return _serve(socket.socket(fileno=ns.sock_fd))


if __name__ == "__main__":
    sys.exit(main())
