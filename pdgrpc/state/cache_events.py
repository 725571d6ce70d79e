"""What a prefix cache tells the outside world: blocks stored, blocks removed, all cleared.

A prefix cache (one per dp rank, over that rank's KV pool) reports every change of the set
of pages it can reuse through a :class:`CacheEvents` sink passed in at construction. The
sink turns them into an event log that gateways (smg's ``SubscribeKvEvents``, vLLM's ZMQ
format) and pdgrpc's router read to route a prompt to where its prefix already sits.

Block hashes are signed 64-bit integers because smg's ``KvBlock.block_hash`` is ``int64``.
A block is one full KV page; ``parent_hash`` is the previous page's block of the same
prefix, ``None`` for a prompt's first page. ``token_ids`` are the page's exact tokens, which
a gateway hashes itself to match prompts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

__all__ = ["CacheEvents", "NoCacheEvents", "StoredBlock"]


@dataclass(frozen=True)
class StoredBlock:
    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]


class CacheEvents(Protocol):
    """Where a prefix cache reports changes. Called on the thread that changes the cache."""

    def stored(self, blocks: Sequence[StoredBlock]) -> None:
        """``blocks`` became reusable, parents before children."""

    def removed(self, block_hashes: Sequence[int]) -> None:
        """``block_hashes`` were evicted and are no longer reusable."""

    def cleared(self) -> None:
        """Every block is gone (a restart, a flush, the cache turned off)."""


class NoCacheEvents:
    """The sink when nobody listens."""

    def stored(self, blocks: Sequence[StoredBlock]) -> None:
        pass

    def removed(self, block_hashes: Sequence[int]) -> None:
        pass

    def cleared(self) -> None:
        pass
