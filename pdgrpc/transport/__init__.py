"""The data plane: pluggable transports that move KV pages and metadata rows from a
prefill process into a decode process's memory.

* :mod:`~pdgrpc.transport.base` -- the plugin contract (who calls which hook, when);
  its data types live in :mod:`~pdgrpc.transport.regions` (regions, write ops),
  :mod:`~pdgrpc.transport.descriptor`, :mod:`~pdgrpc.transport.grant` (what a receiver
  allows one room) and :mod:`~pdgrpc.transport.rooms` (room states);
* :mod:`~pdgrpc.transport.receiver` -- the receiver core every byte-moving backend
  drives: room grants, the grant check, byte accounting, metadata-last commit, refusals;
* :mod:`~pdgrpc.transport.registry` -- backends by name: built-ins (``fake``, ``tcp``,
  ``rdma``), the ``pdgrpc.transports`` entry-point group, ``"module:Class"``;
* :mod:`~pdgrpc.transport.pages` -- page lists -> coalesced write ops;
* :mod:`~pdgrpc.transport.fake`, :mod:`~pdgrpc.transport.tcp`,
  :mod:`~pdgrpc.transport.rdma` -- the built-in backends;
* :mod:`~pdgrpc.transport.liveness` -- heartbeat side channel for backends that cannot
  see a dead peer themselves;
* :mod:`~pdgrpc.transport.testing` -- the conformance suite for backend authors, with
  :mod:`~pdgrpc.transport.testing.peer` (a peer in a separate OS process). Fault-injecting
  wrappers are test harnesses and live in ``tests/transport``.

Importing this package is cheap: no backend (and no UCX) is imported until asked for.
"""

from pdgrpc.transport.registry import create

__all__ = ["create"]
