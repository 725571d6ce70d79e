"""An in-process all-reduce: TP ranks as threads of one test process."""

from __future__ import annotations

import threading

import torch

from pdgrpc.engine.model import AllReduce
from pdgrpc.errors import ConfigError, EngineError


class LocalAllReduce:
    """In-process all-reduce for ``size`` ranks running as threads.

    ``LocalAllReduce(2).for_rank(r)`` is rank ``r``'s callable. A rank that does not
    arrive within ``timeout`` seconds breaks the barrier: every waiting rank raises
    :class:`~pdgrpc.errors.EngineError` instead of hanging.
    """

    def __init__(self, size: int, timeout: float = 60.0) -> None:
        if size < 1:
            raise ConfigError(f"LocalAllReduce: size must be >= 1, got {size}")
        self.size = size
        self._barrier = threading.Barrier(size, timeout=timeout)
        self._parts: list[torch.Tensor | None] = [None] * size
        self._result: torch.Tensor | None = None

    def for_rank(self, rank: int) -> AllReduce:
        if not 0 <= rank < self.size:
            raise ConfigError(f"LocalAllReduce.for_rank: rank must be in [0, {self.size}), got {rank}")
        return lambda t: self._reduce(rank, t)

    def _wait(self) -> int:
        try:
            return self._barrier.wait()
        except threading.BrokenBarrierError:
            raise EngineError("LocalAllReduce: a rank did not arrive (timeout or failure)") from None

    def _reduce(self, rank: int, t: torch.Tensor) -> torch.Tensor:
        self._parts[rank] = t
        if self._wait() == 0:  # exactly one thread sums, in rank order
            parts = [p for p in self._parts if p is not None]
            self._parts = [None] * self.size  # safe: nobody deposits before the next wait
            if len(parts) != self.size or any(p.shape != parts[0].shape for p in parts):
                self._barrier.abort()
                raise EngineError(f"LocalAllReduce: ranks passed different shapes {[tuple(p.shape) for p in parts]}")
            self._result = torch.stack(parts).sum(dim=0)
        self._wait()
        # The next round's result is written only after every rank deposited again,
        # i.e. after every rank has read this one.
        result = self._result
        assert result is not None
        return result.clone()
