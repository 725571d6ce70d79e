"""What one prefill worker is told at start: its place in the dp/tp group, chunking, its
bounds (counts) and its deadlines (seconds).

``python -m pdgrpc.prefill.worker_main`` builds it from its flags; a
:class:`~pdgrpc.prefill.worker.PrefillWorker` reads it.
"""

from __future__ import annotations

import argparse
import dataclasses

from pdgrpc.argtypes import check_rank
from pdgrpc.state.config import SenderDeadlines

__all__ = ["READY", "WorkerConfig", "worker_name"]

# The first word of the line a worker prints to stdout once it serves; its controller,
# which reads the line, imports no worker module (and so no torch).
READY = "PDGRPC_WORKER_READY"


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    dp_rank: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    tp_room_wait_s: float = 5.0  # TP follower: a chunk command waiting for its room's Prefill RPC
    lost_rooms: int = 4096  # TP follower: rooms remembered as computed without us (count)
    chunk_size: int = 512  # prompt tokens per prefill chunk
    # Completed pages are held back until at least this many KV bytes are pending (or the
    # prompt is done): every write has a fixed cost (messages, peer wake-ups) that costs
    # more than the overlap with compute wins for small pieces.
    min_write_bytes: int = 1 << 20
    handshake_timeout_s: float = 30.0  # Prefill RPC waiting for the decode's handshake
    compute_timeout_s: float = 600.0  # waiting for the next computed chunk (queue + compute)
    transfer_timeout_s: float = 60.0  # last chunk computed -> decode's acknowledgement
    page_wait_s: float = 30.0  # waiting for free KV pages when the pool is short
    abort_wait_s: float = 60.0  # AbortRoom waiting for the room's driver to stop
    drain_timeout_s: float = 5.0  # a failed room's queued sends, before its pages are freed
    early_handshakes: int = 4096  # handshakes kept before their Prefill RPC (count)
    early_handshake_ttl_s: float = 60.0  # and for how long (seconds)
    early_handshakes_per_peer: int = 1024  # of early_handshakes, from one peer (count; peer = caller's mTLS identity, else its host)
    early_handshake_bytes: int = 1 << 30  # what early handshakes hold: descriptors, signed messages, reasons (bytes)
    early_handshake_bytes_per_peer: int = 256 << 20  # of early_handshake_bytes, from one peer (bytes)
    compute_nice: int = 0  # added to the compute thread's nice value (pdgrpc.serving.threads)
    prefix_cache: bool = True  # reuse the KV of full pages earlier prompts computed

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.min_write_bytes < 0:
            raise ValueError(f"min_write_bytes must be >= 0, got {self.min_write_bytes}")
        check_rank(self.tp_rank, self.tp_size, "tp_rank", "tp_size")

    @property
    def deadlines(self) -> SenderDeadlines:
        return SenderDeadlines(self.handshake_timeout_s, self.compute_timeout_s, self.transfer_timeout_s)


def worker_name(ns: argparse.Namespace) -> str:
    return f"dp{ns.dp_rank}" if ns.tp_size == 1 else f"dp{ns.dp_rank}.tp{ns.tp_rank}"
