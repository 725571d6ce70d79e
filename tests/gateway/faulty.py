"""A fault-injecting transport the smg tests load by name (``--transport
tests.gateway.faulty:FailsLongPromptsTcp``) on the prefills and the decodes alike, so
that both report the same transport to smg (which refuses a pair that differs).

It sends a room's first writes as usual until the room has sent :attr:`MIN_PAGES` KV
pages or more; that write sends only its first ops and the room then fails on the sender
(``injected transfer fault``), as a transfer that breaks mid-way does. So a prompt of
``MIN_PAGES`` pages or more fails on the prefill leg after the decode's handshake, with
some of its bytes already at the decode, and shorter prompts are untouched. Receiving is
untouched too: the decode learns of the failure only from the prefill.
"""

from __future__ import annotations

import logging
from typing import Sequence

from pdgrpc.transport import registry
from pdgrpc.transport.base import MemoryRegion, Peer, RegionKind, WriteOp
from tests.transport.faults import FaultyTransport

log = logging.getLogger("pdgrpc.transport.testing.faults")

# Prompts of this many pages (page size 16: 128 tokens) or more fail mid-transfer.
MIN_PAGES = 8


class FailsLongPromptsTcp(FaultyTransport):
    BACKEND = "tcp"

    def __init__(self, *, host: str = "127.0.0.1", tp_rank: int = 0) -> None:
        super().__init__(registry.create(self.BACKEND, host=host))
        self._page_bytes = 1
        self._pages: dict[int, int] = {}  # room -> KV pages sent so far
        self.hits: set[int] = set()

    async def register(self, regions: Sequence[MemoryRegion]) -> bytes:
        kv = [r for r in regions if r.kind is RegionKind.KV]
        # One page of every KV region: what a page of the prompt costs on the wire.
        self._page_bytes = max(1, sum(r.tensor[0].numel() * r.tensor.element_size() for r in kv))
        return await super().register(regions)

    async def write(self, peer: Peer, room: int, ops: Sequence[WriteOp], *, metadata: WriteOp | None = None) -> None:
        if room in self.hits:
            return
        pages = self._pages.get(room, 0) + sum(op.length for op in ops) // self._page_bytes
        self._pages[room] = pages
        if pages < MIN_PAGES:
            await self._inner.write(peer, room, ops, metadata=metadata)
            return
        await self._inner.write(peer, room, list(ops)[: max(1, len(ops) // 2)])
        self.hits.add(room)
        log.warning("pdgrpc transport test faults: room %d failed mid-transfer after %d pages", room, pages)
        self.rooms.fail(room, f"injected transfer fault: a prompt of {pages} pages (>= {MIN_PAGES})")

    def release(self, room: int) -> None:
        self._pages.pop(room, None)
        self.hits.discard(room)
        super().release(room)


class FailsLongPromptsRdma(FailsLongPromptsTcp):
    BACKEND = "rdma"
