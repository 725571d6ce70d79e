"""Two rdma transports in this process, one registered to receive and one connected to
it: the fixture of the rdma receiver's tests (forged input, idle sweeps)."""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator

from pdgrpc.transport import registry
from pdgrpc.transport.testing.peer import Layout

LAYOUT = Layout(layers=2, pages=16, slots=4)


@contextlib.asynccontextmanager
async def paired() -> AsyncIterator[tuple[Any, Any, Any, Any, bytes, Any]]:
    """A connected rdma pair, closed on the way out: (recv, send, send_regions, peer,
    recv descriptor, recv_regions)."""
    recv_regions, _ = LAYOUT.build(None)
    send_regions, _ = LAYOUT.build(7)
    # a long lease: whatever is closed in these tests is closed for a reason, not for silence
    recv, send = registry.create("rdma", liveness_lease=30.0), registry.create("rdma", liveness_lease=30.0)
    try:
        desc = await recv.register(recv_regions)
        await send.register(send_regions)
        peer = await send.connect(desc)
        yield recv, send, send_regions, peer, desc, recv_regions
    finally:
        await send.close()
        await recv.close()
