"""Two real UCX workers in this process, talking over UCX's shared-memory transports:
the fixture of the ``ucx`` worker tests (batches, quiet windows)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from typing import Any

import numpy as np

from pdgrpc.transport.ucx import UcxWorker


class CountingApi:
    """The worker's UCX API with ``worker_arm`` (how often it asked to be woken) and
    ``worker_progress`` counted."""

    def __init__(self, api: Any) -> None:
        self._api, self.arms, self.progress = api, 0, 0

    def worker_arm(self, worker: int) -> int:
        self.arms += 1
        return int(self._api.worker_arm(worker))

    def worker_progress(self, worker: int) -> int:
        self.progress += 1
        return int(self._api.worker_progress(worker))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._api, name)


class Pair:
    """A sender worker ``tx`` with endpoint ``ep`` to a receiver worker ``rx``, which
    has endpoint ``back`` to ``tx``. ``tx_functions``: the libucp calls ``tx`` makes
    (a wrapper that counts them)."""

    def __init__(self, *, tx_functions: Any = None, quiet_sends: bool = True) -> None:
        self.tx = UcxWorker(functions=tx_functions, quiet_sends=quiet_sends)
        self.rx = UcxWorker()

    async def __aenter__(self) -> "Pair":
        self.tx.start()
        self.rx.start()
        self.ep = self.tx.endpoint(self.rx.address)
        self.back = self.rx.endpoint(self.tx.address)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.tx.close()
        await self.rx.close()


def runs_of(bufs: list[np.ndarray]) -> list[tuple[int, int]]:
    """``(address, nbytes)`` of each buffer."""
    return [(b.ctypes.data, b.nbytes) for b in bufs]


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.001)
