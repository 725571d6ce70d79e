"""Raw UCX baseline for the ``rdma`` transport benchmark: plain ``ucxx`` tag send/recv.

What it measures
----------------
Two freshly spawned OS processes, a *sender* and a *receiver*, each with its own UCX
context. They swap UCX **worker addresses** through a pipe (the same way the ``rdma``
backend carries them in its handshake descriptor) and create endpoints with
``create_endpoint_from_worker_address(..., endpoint_error_handling=False)``, which lets
UCX pick shared memory (sysv/posix eager, cma zero-copy rendezvous) on one host and RDMA
verbs between hosts. Both run ucxx's public asyncio API in ``blocking`` progress mode.

One iteration: the receiver posts its ``recv`` and says so; only then is the sender
told to go: it ``send``s ``nbytes`` with ``force_tag=True`` and waits for an 8-byte
acknowledgement that the receiver sends once its ``recv`` has completed. The
iteration's latency is send-start → ack-received, so it is the same "write until the
receiver has the bytes and the sender knows it" span that a transport benchmark times
for its backend (whose receiver has likewise advertised its room before the clock
starts). Throughput is ``nbytes / median latency`` in GB/s (10**9 bytes per second).

Nothing but the transfer runs inside that span: a memset of the buffer before each
``recv`` would race the sender's start and make the baseline bimodal. :meth:`RawUcx.check`
instead zeroes the buffer, runs one more, untimed iteration into it and compares the
bytes, so a baseline that moved nothing still cannot report a number.

Nothing here imports ``ucxx`` in the calling process: the two children do all the UCX
work, so the caller may already run its own UCX worker (or none).

API
---
:class:`RawUcx` — the pair kept alive, one iteration per :meth:`RawUcx.once` (a benchmark
alternates these with its backend's iterations); :func:`run_baselines` — several sizes
with one pair of processes.
``python -m pdgrpc.bench.ucx_baseline --mib 4 64 256`` prints the numbers.

Environment: UCX settings come from the environment as usual (``UCX_TLS`` etc.); nothing
is forced here, so a user's ``UCX_TLS`` always applies.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import multiprocessing
import multiprocessing.connection
import os
import statistics
import sys
import time
from typing import Any, Mapping, Protocol, Sequence

from pdgrpc.errors import TransportError, TransportUnavailable

__all__ = ["BaselineResult", "RawUcx", "run_baselines"]

INSTALL_HINT = "pip install 'pdgrpc[ucx]'"
_DATA_TAG = 0x5044_4752_0000_0001  # arbitrary fixed tags: only these two processes use them
_ACK_TAG = 0x5044_4752_0000_0002
_CHUNK = 16 << 20  # bytes compared at a time, so a check of 384 MiB builds no GiB of pattern


@dataclasses.dataclass(frozen=True)
class BaselineResult:
    """Raw ucxx numbers for one transfer size."""

    nbytes: int
    gbps: float  # nbytes / latency_s / 1e9
    latency_s: float  # median over the timed iterations
    latencies_s: tuple[float, ...]  # every timed iteration, in order


def _require_ucxx() -> None:
    if importlib.util.find_spec("ucxx") is None:
        raise TransportUnavailable(f"the raw UCX baseline needs ucxx, which is not installed: {INSTALL_HINT}")


def _pattern(nbytes: int, start: int = 0) -> Any:
    """Bytes ``[start, start + nbytes)`` of the sent pattern."""
    import numpy as np

    # A byte pattern that differs at every offset modulo 251, so a shifted or truncated
    # transfer cannot compare equal.
    return (np.arange(start, start + nbytes, dtype=np.uint64) % 251).astype(np.uint8)


def _child(role: str, conn: multiprocessing.connection.Connection, max_bytes: int) -> None:
    """Body of the sender (``role == "send"``) and receiver (``"recv"``) processes: one
    iteration per ``("once", nbytes)`` command (the receiver answers ``"posted"`` once
    its receive is up, then ``True`` when the bytes are in), and on the receiver a
    memset per ``("zero", nbytes)`` and a comparison with the sent pattern per
    ``("compare", nbytes)``."""
    import asyncio

    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import numpy as np
    import ucxx

    async def main() -> None:
        ucxx.init(progress_mode="blocking")
        conn.send(ucxx.get_worker_address().tobytes())
        peer = ucxx.get_ucx_address_from_buffer(conn.recv())
        ep = await ucxx.create_endpoint_from_worker_address(peer, endpoint_error_handling=False)
        buf = np.zeros(max_bytes, dtype=np.uint8)
        if role == "send":
            for at in range(0, max_bytes, _CHUNK):
                buf[at:at + _CHUNK] = _pattern(min(_CHUNK, max_bytes - at), at)
        ack = np.zeros(8, dtype=np.uint8)
        conn.send("ready")
        # The next command is read blocking, holding the loop: ucxx's progress would
        # otherwise keep a core busy between iterations, taking it from the backend
        # whose iterations alternate with these.
        while (cmd := conn.recv()) is not None:
            what, nbytes = cmd
            view = buf[:nbytes]
            if what == "zero":
                view[:] = 0
                conn.send(True)
            elif what == "compare":
                conn.send(all(np.array_equal(view[at:at + _CHUNK], _pattern(min(_CHUNK, nbytes - at), at))
                              for at in range(0, nbytes, _CHUNK)))
            elif role == "send":
                t0 = time.perf_counter()
                await asyncio.gather(
                    ep.send(view, tag=_DATA_TAG, force_tag=True),
                    ep.recv(ack, tag=_ACK_TAG, force_tag=True),
                )
                conn.send(time.perf_counter() - t0)
            else:
                received = asyncio.ensure_future(ep.recv(view, tag=_DATA_TAG, force_tag=True))
                await asyncio.sleep(0)  # the task's first step posts the receive
                conn.send("posted")
                await received
                await ep.send(ack, tag=_ACK_TAG, force_tag=True)
                conn.send(True)
        await ep.close()

    try:
        asyncio.run(main())
    except BaseException as exc:  # reported to the parent, which raises a pdgrpc error
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        ucxx.reset()


class Pipe(Protocol):
    """One end of a child's pipe, as :class:`RawUcx` drives it."""

    def send(self, obj: Any) -> None: ...

    def poll(self, timeout: float) -> bool: ...

    def recv(self) -> Any: ...

    def close(self) -> None: ...


class RawUcx:
    """The raw ucxx sender and receiver, kept alive and driven one iteration at a time,
    so a benchmark can alternate their iterations with a backend's: on a shared machine
    load then hits both alike. Raises :class:`~pdgrpc.errors.TransportUnavailable` when
    ucxx is missing and :class:`~pdgrpc.errors.TransportError` if a process fails or
    times out."""

    def __init__(self, max_bytes: int, *, timeout_s: float = 120.0, pipes: Mapping[str, Pipe] | None = None) -> None:
        """``pipes``: drive these ``"send"`` and ``"recv"`` ends, which answer as the
        children do, instead of spawning and pairing two children (a test of the order
        of the commands)."""
        from pdgrpc.errors import ConfigError

        if max_bytes <= 0:
            raise ConfigError(f"max_bytes must be a positive byte count, got {max_bytes}")
        self._timeout_s = timeout_s
        self._procs: dict[str, Any] = {}
        if pipes is not None:
            self._conns: dict[str, Pipe] = dict(pipes)
            return
        _require_ucxx()
        mp = multiprocessing.get_context("spawn")  # never fork: UCX state must not be shared
        self._conns = {}
        for role in ("send", "recv"):
            parent, child = mp.Pipe()
            self._conns[role] = parent
            self._procs[role] = mp.Process(target=_child, args=(role, child, max_bytes), name=f"ucx-baseline-{role}",
                                           daemon=True)
        try:
            for p in self._procs.values():
                p.start()
            addr_send, addr_recv = self._get("send"), self._get("recv")
            self._conns["send"].send(addr_recv)
            self._conns["recv"].send(addr_send)
            self._get("send"), self._get("recv")  # "ready": endpoints up, buffers allocated
        except BaseException:
            self.close()
            raise

    def _get(self, role: str) -> Any:
        conn = self._conns[role]
        if not conn.poll(self._timeout_s):
            raise TransportError(f"raw UCX baseline: the {role} process gave no answer within {self._timeout_s:.0f} s")
        try:
            msg = conn.recv()
        except EOFError:
            raise TransportError(
                f"raw UCX baseline: the {role} process exited early (exit code {self._procs[role].exitcode})") from None
        if isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "error":
            raise TransportError(f"raw UCX baseline: the {role} process failed: {msg[1]}")
        return msg

    def once(self, nbytes: int) -> float:
        """One iteration of ``nbytes``: seconds from the send's start until the
        receiver's acknowledgement reached the sender."""
        self._conns["recv"].send(("once", nbytes))
        if (posted := self._get("recv")) != "posted":
            raise TransportError(f"raw UCX baseline: the receiver answered {posted!r} instead of posting its receive")
        self._conns["send"].send(("once", nbytes))
        latency, _ = self._get("send"), self._get("recv")
        return float(latency)

    def check(self, nbytes: int) -> None:
        """Zero the receiver's first ``nbytes``, move them once more (untimed) and raise
        unless they arrived as sent."""
        self._conns["recv"].send(("zero", nbytes))
        if self._get("recv") is not True:
            raise TransportError("raw UCX baseline: the receiver did not zero its buffer")
        self.once(nbytes)
        self._conns["recv"].send(("compare", nbytes))
        if self._get("recv") is not True:
            raise TransportError(f"raw UCX baseline: the {nbytes} bytes received differ from those sent")

    def close(self) -> None:
        for role, p in self._procs.items():
            if p.pid is not None:
                with contextlib.suppress(OSError):
                    self._conns[role].send(None)
        for p in self._procs.values():
            if p.pid is not None:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join(5)
        for c in self._conns.values():
            c.close()


def run_baselines(sizes: Sequence[int], iterations: int = 5, *, warmup: int = 1, timeout_s: float = 120.0) -> list[BaselineResult]:
    """Measure raw ucxx send/recv between two processes for each size in ``sizes``.

    Returns one :class:`BaselineResult` per size, in order. Raises
    :class:`~pdgrpc.errors.TransportUnavailable` when ucxx is missing,
    :class:`~pdgrpc.errors.ConfigError` for bad arguments and
    :class:`~pdgrpc.errors.TransportError` if the processes fail, time out, or the
    received bytes differ from the sent ones.
    """
    from pdgrpc.errors import ConfigError

    sizes = [int(s) for s in sizes]
    if not sizes or any(s <= 0 for s in sizes):
        raise ConfigError(f"sizes must be positive byte counts, got {sizes!r}")
    if iterations < 1 or warmup < 0:
        raise ConfigError(f"need iterations >= 1 and warmup >= 0, got {iterations} and {warmup}")
    raw = RawUcx(max(sizes), timeout_s=timeout_s)
    results = []
    try:
        for nbytes in sizes:
            lat = [raw.once(nbytes) for _ in range(warmup + iterations)][warmup:]
            raw.check(nbytes)
            med = statistics.median(lat)
            results.append(BaselineResult(nbytes=nbytes, gbps=nbytes / med / 1e9, latency_s=med, latencies_s=tuple(lat)))
    finally:
        raw.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdgrpc.bench.ucx_baseline", description="Raw ucxx send/recv between two processes (baseline of the rdma transport).")
    parser.add_argument("--mib", type=float, nargs="+", default=[4, 64, 256], help="transfer sizes in MiB")
    parser.add_argument("--iterations", type=int, default=5)
    args = parser.parse_args(argv)
    sizes = [int(m * (1 << 20)) for m in args.mib]
    for r in run_baselines(sizes, args.iterations):
        print(f"{r.nbytes / (1 << 20):8.2f} MiB  {r.gbps:7.2f} GB/s  median latency {r.latency_s * 1e3:8.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
