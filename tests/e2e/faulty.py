"""Fault-injecting transports the e2e tests load by name, through the registry's
``module:Class`` spelling (``--transport tests.e2e.faulty:SlowCorruptingRank1``): the
servers know nothing about faults. Each class picks its inner backend and faults in its
constructor, which takes what :func:`pdgrpc.serving.create_transport` passes (``host``,
``tp_rank``)."""

from __future__ import annotations

import logging

from pdgrpc.transport import registry
from pdgrpc.transport.tcp import TcpTransport
from pdgrpc.transport.testing.faults import FaultyTransport
from pdgrpc.transport.testing.transfer_faults import FailingTransfers

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
    (seed :attr:`SEED`; see :mod:`pdgrpc.transport.testing.transfer_faults`)."""

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
