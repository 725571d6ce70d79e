"""The KV-pool half of an :class:`~pdgrpc.engine.base.Engine` that every built-in engine
shares: one K and one V tensor per layer in a :class:`KVLayout`, pages handed out by a
:class:`FifoPageAllocator`, and limits read from the engine's config. The reference
engine and the checkpoint engine differ in their model and tokenizer, not in this."""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from pdgrpc.engine.base import Engine, KVBuffers
from pdgrpc.engine.layout import KVLayout
from pdgrpc.engine.pages import FifoPageAllocator

__all__ = ["PooledEngine"]


class _Limits(Protocol):
    @property
    def max_prompt_tokens(self) -> int: ...

    @property
    def max_seq_len(self) -> int: ...


class PooledEngine(Engine):
    """Serves the pool-facing part of :class:`Engine` from attributes the subclass's
    constructor sets: ``config`` (its limits), ``_layout``, ``_k``/``_v`` (one tensor per
    layer) and ``_pages``."""

    config: _Limits
    _layout: KVLayout
    _k: list[torch.Tensor]
    _v: list[torch.Tensor]
    _pages: FifoPageAllocator

    @property
    def kv_layout(self) -> KVLayout:
        return self._layout

    def kv_buffers(self) -> KVBuffers:
        return KVBuffers(k=tuple(self._k), v=tuple(self._v))

    @property
    def max_prompt_tokens(self) -> int:
        return self.config.max_prompt_tokens

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    def alloc_pages(self, n: int) -> list[int] | None:
        return self._pages.alloc(n)

    def free_pages(self, pages: Sequence[int]) -> None:
        self._pages.free(pages)

    @property
    def num_free_pages(self) -> int:
        return self._pages.num_free
