"""Helpers shared by the bootstrap tests (imported as ``bootstrap_helpers``)."""

from __future__ import annotations

import socket

from pdgrpc.v1 import bootstrap_pb2 as pb


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def parallel_info(dp: int = 2, tp: int = 1, **over: object) -> pb.ParallelInfo:
    fields = dict(
        tp_size=tp, dp_size=dp, pp_size=1, page_size=16, kv_dtype="bfloat16", kv_layout="layer_kv_page_head_dim",
        compatibility_hash=b"\xc0\xff\xee", load_balance_method=pb.LOAD_BALANCE_METHOD_ROUND_ROBIN,
    )
    fields.update(over)
    return pb.ParallelInfo(**fields)  # type: ignore[arg-type]


def worker(dp: int, tp: int = 0, address: str = "") -> pb.WorkerInfo:
    return pb.WorkerInfo(dp_rank=dp, tp_rank=tp, transfer_address=address or f"10.0.0.{dp}:{7000 + tp}", transport="fake", transport_endpoint=b"ep")


def free_port() -> int:
    """A TCP port nobody listens on right now (a race, but a short one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
