"""Where an engine's weights and KV pool live (``--device cpu|cuda[:N]``), and when a
prefill chunk's pages may be sent.

:func:`resolve_device` checks the flag at start-up: ``--device cuda`` on a machine where
``torch.cuda`` is unavailable is a :class:`~pdgrpc.errors.ConfigError` naming the flag (a
server exits non-zero with that line), never a crash in the first forward pass.

:class:`ChunkReady` is the "the GPU finished writing this chunk's pages" signal. An engine
records one after each ``prefill_chunk`` on the thread that computed it
(:meth:`~pdgrpc.engine.base.Engine.chunk_ready`); the prefill driver awaits it on the event
loop before it hands the chunk's pages to the transport. On the CPU the compute is done
when ``prefill_chunk`` returns, so :data:`READY` is a no-op. On a GPU,
:class:`CudaChunkReady` records a CUDA event on the compute stream and the waiter polls
``event.query()`` with short sleeps: the serving thread never blocks on a device-wide
synchronize, and other rooms' transfers go on while one chunk's kernels finish.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Iterator

import torch

from pdgrpc.errors import ConfigError

__all__ = ["READY", "ChunkReady", "CudaChunkReady", "call_when", "chunk_ready_on", "poll_until", "resolve_device"]

_POLL_FIRST_S = 50e-6  # first sleep between event queries; doubles up to _POLL_MAX_S
_POLL_MAX_S = 1e-3


def resolve_device(spec: str, flag: str = "--device") -> torch.device:
    """The torch device ``spec`` names (``cpu``, ``cuda``, ``cuda:N``), checked against
    this machine; raises :class:`ConfigError` naming ``flag`` when it cannot be used."""
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"{flag} {spec!r}: {exc}") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ConfigError(f"{flag} {spec!r}: pdgrpc supports cpu and cuda[:N] devices, not {device.type!r}")
    if not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise ConfigError(
            f"{flag} {spec!r}: torch.cuda is not available ({why}, torch {torch.__version__}); "
            f"run with {flag} cpu or on a machine with an NVIDIA GPU and a CUDA build of torch"
        )
    count = torch.cuda.device_count()
    index = 0 if device.index is None else device.index
    if not 0 <= index < count:
        raise ConfigError(f"{flag} {spec!r}: this machine has {count} CUDA device(s) (cuda:0 .. cuda:{count - 1})")
    return torch.device("cuda", index)


class ChunkReady:
    """Resolves once the device finished the work recorded before it. This base is the
    CPU case: already done."""

    def done(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Block this thread until the work is done."""

    async def wait(self) -> None:
        return None


READY = ChunkReady()
"""The CPU's chunk-ready signal: nothing to wait for."""


class CudaChunkReady(ChunkReady):
    """A CUDA event recorded on ``stream`` (default: the current stream of the event's
    device) right after a chunk's kernels were queued."""

    __slots__ = ("event",)

    def __init__(self, device: torch.device, stream: Any = None) -> None:
        self.event = torch.cuda.Event()
        with torch.cuda.device(device):
            self.event.record(stream if stream is not None else torch.cuda.current_stream(device))

    def done(self) -> bool:
        return bool(self.event.query())

    def synchronize(self) -> None:
        """Block this thread until this event (not the device) completed."""
        self.event.synchronize()

    async def wait(self) -> None:
        await poll_until(self.event.query)


def _delays() -> Iterator[float]:
    """The pauses between two queries of a completion: from ``_POLL_FIRST_S``, doubling
    up to ``_POLL_MAX_S``."""
    delay = _POLL_FIRST_S
    while True:
        yield delay
        delay = min(2 * delay, _POLL_MAX_S)


async def poll_until(done: Callable[[], bool]) -> None:
    """Return once ``done()`` is true, asking again after each of :func:`_delays`: the
    event loop serves everything else meanwhile. Not bounded here: a recorded CUDA event
    always completes (or the device is lost, which fails the process)."""
    delays = _delays()
    while not done():
        await asyncio.sleep(next(delays))


def call_when(done: Callable[[], bool], fn: Callable[[], None]) -> None:
    """Call ``fn()`` once ``done()`` is true: at once when it is, else from this thread's
    event loop, asking again after each of :func:`_delays` (for a completion callback,
    which cannot await). Without a running loop (a completion run while a transport
    closes) it asks in place until ``done()``."""
    if done():
        fn()
        return
    delays = _delays()
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        while not done():
            time.sleep(next(delays))
        fn()
        return

    def check() -> None:
        if done():
            fn()
        else:
            loop.call_later(next(delays), check)

    loop.call_later(next(delays), check)


def chunk_ready_on(device: torch.device) -> ChunkReady:
    """The chunk-ready signal for work queued so far on ``device``'s current stream."""
    return CudaChunkReady(device) if device.type == "cuda" else READY
