"""Fault-injecting transports the e2e tests load by name, through the registry's
``module:Class`` spelling (``--transport tests.e2e.faulty:SlowCorruptingRank1``): the
servers know nothing about faults. Each class picks its inner backend and faults in its
constructor, which takes what :func:`pdgrpc.serving.flags.create_transport` passes (``host``,
``tp_rank``)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Sequence

from pdgrpc.transport import registry
from pdgrpc.transport.base import Peer, Transport, WriteOp
from pdgrpc.transport.tcp import TcpTransport
from tests.transport.faults import FaultyTransport
from tests.transport.transfer_faults import FailingTransfers

log = logging.getLogger("pdgrpc.transport.testing.faults")


class SlowCorruptingRank1(FaultyTransport):
    """tcp; on TP rank 1 only, every metadata row is seen 0.2 s late and the third
    advertised room's row gets a wrong ``bootstrap_room``."""

    FAULTS = {"delay_metadata_s": 0.2, "corrupt_nth_room": 3}

    def __init__(self, *, host: str = "127.0.0.1", tp_rank: int = 0) -> None:
        faults = self.FAULTS if tp_rank == 1 else {}
        super().__init__(TcpTransport(host=host), **faults)  # type: ignore[arg-type]
        if faults:
            log.warning("pdgrpc transport test faults active: %s on tp rank %d", faults, tp_rank)


class FailsFivePercent(FailingTransfers):
    """tcp; fails about 5% of the rooms this instance sends, at seeded random points
    (seed :attr:`SEED`; see :mod:`tests.transport.transfer_faults`)."""

    SEED = 16
    PROBABILITY = 0.05

    BACKEND = "tcp"

    def __init__(self, *, host: str = "127.0.0.1", tp_rank: int = 0) -> None:
        super().__init__(registry.create(self.BACKEND, host=host), seed=self.SEED, probability=self.PROBABILITY)
        log.warning("pdgrpc transport test faults active: %.0f%% of %s transfers fail, seed %d",
                    100 * self.PROBABILITY, self.BACKEND, self.SEED)


class FailsFivePercentRdma(FailsFivePercent):
    """:class:`FailsFivePercent` over rdma."""

    BACKEND = "rdma"


class _SlowSender(FaultyTransport):
    """A sender whose transfers stall in the middle: a write that carries the metadata
    row sends its pages at once, logs ``slow sender: room=R pages sent, row held``, and
    sends the row ``ROW_DELAY_S`` later. A test that sees the line knows the decode has
    the room's first bytes but not its row, and can kill a process right there.
    Receiving is untouched."""

    ROW_DELAY_S = 1.5
    # A replacement worker (any but the first built where $PDGRPC_TEST_MARKER_DIR points)
    # starts this much later, as a real model's load would: the test then tells "freed
    # because the peer died" from "freed because the replacement registered".
    RESTART_DELAY_S = 2.0

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        marker_dir = os.environ.get("PDGRPC_TEST_MARKER_DIR")
        if marker_dir:
            marker = os.path.join(marker_dir, "slow-sender-started")
            if os.path.exists(marker):
                log.warning("slow sender: a replacement; starting %.1f s late", self.RESTART_DELAY_S)
                time.sleep(self.RESTART_DELAY_S)
            else:
                open(marker, "w").close()

    async def write(self, peer: Peer, room: int, ops: Sequence[WriteOp], *, metadata: WriteOp | None = None) -> None:
        if metadata is None or not ops:
            await super().write(peer, room, ops, metadata=metadata)
            return
        await super().write(peer, room, ops)
        log.warning("slow sender: room=%d pages sent, row held", room)
        await asyncio.sleep(self.ROW_DELAY_S)
        await super().write(peer, room, (), metadata=metadata)


# Test leases: a stopped peer is lost after LEASE_S of silence (default 5 s).
LEASE_S = 1.5
HEARTBEAT_S = 0.25


def _tcp(host: str) -> Transport:
    return TcpTransport(host=host, heartbeat_interval=HEARTBEAT_S, heartbeat_lease=LEASE_S)


def _rdma(host: str) -> Transport:
    from pdgrpc.transport.rdma import RdmaTransport

    return RdmaTransport(host=host, liveness_interval=HEARTBEAT_S, liveness_lease=LEASE_S)


class SlowSenderTcp(_SlowSender):
    """:class:`_SlowSender` over tcp with the test lease."""

    def __init__(self, *, host: str = "127.0.0.1") -> None:
        super().__init__(_tcp(host))


class SlowSenderRdma(_SlowSender):
    """:class:`_SlowSender` over rdma (UCX) with the test lease."""

    def __init__(self, *, host: str = "127.0.0.1") -> None:
        super().__init__(_rdma(host))


class ShortLeaseTcp(FaultyTransport):
    """tcp with the test lease, nothing else changed."""

    def __init__(self, *, host: str = "127.0.0.1") -> None:
        super().__init__(_tcp(host))


class ShortLeaseRdma(FaultyTransport):
    """rdma with the test lease, nothing else changed."""

    def __init__(self, *, host: str = "127.0.0.1") -> None:
        super().__init__(_rdma(host))
