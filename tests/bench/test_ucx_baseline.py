"""The raw ucxx baseline of ``bench transport --backend rdma`` times the transfer alone:
its receive is posted before the sender starts, no memset of the receive buffer runs
inside the sender's span (where it raced the sender's start and made the baseline
bimodal, issue 19), and its bytes check still catches a transfer that moved too little.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from pdgrpc.bench.ucx_baseline import RawUcx, run_baselines
from pdgrpc.errors import TransportError

pytestmark = pytest.mark.timeout(120)

needs_ucxx = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None,
                                reason="the raw UCX baseline needs the ucx extra: pip install 'pdgrpc[ucx]'")


class _Pipe:
    """One side of a RawUcx child's pipe, answering like the child and logging the order."""

    def __init__(self, role: str, log: list[tuple[str, Any]]) -> None:
        self.role, self.log, self.answers = role, log, []

    def send(self, cmd: Any) -> None:
        self.log.append((self.role, cmd))
        if self.role == "recv":
            self.answers += ["posted", True] if cmd[0] == "once" else [True]
        else:
            self.answers.append(0.001)

    def poll(self, timeout: float) -> bool:
        return bool(self.answers)

    def recv(self) -> Any:
        return self.answers.pop(0)


def _driven() -> tuple[RawUcx, dict[str, _Pipe], list[tuple[str, Any]]]:
    log: list[tuple[str, Any]] = []
    pipes = {"send": _Pipe("send", log), "recv": _Pipe("recv", log)}
    return RawUcx(1 << 20, timeout_s=1.0, pipes=pipes), pipes, log


def test_the_sender_starts_only_once_the_receiver_has_posted_its_receive() -> None:
    raw, pipes, log = _driven()
    pipes["recv"].answers = []
    orig = pipes["recv"].send

    def recv_send(cmd: Any) -> None:
        orig(cmd)
        # the sender has not been told to go before the receiver said "posted"
        assert ("send", ("once", 8)) not in log

    pipes["recv"].send = recv_send  # type: ignore[method-assign]
    assert raw.once(8) == 0.001
    assert log == [("recv", ("once", 8)), ("send", ("once", 8))]


def test_the_check_zeroes_outside_the_timed_iterations_and_moves_once_more() -> None:
    raw, _, log = _driven()
    raw.once(8)
    raw.check(8)
    assert [c for _, c in log] == [("once", 8), ("once", 8), ("zero", 8), ("once", 8), ("once", 8), ("compare", 8)]
    assert all(c != ("zero", 8) for _, c in log[:2])  # no memset with a timed iteration


def test_a_receiver_that_does_not_post_is_reported() -> None:
    raw, pipes, _ = _driven()
    pipes["recv"].answers = ["something else"]
    pipes["recv"].send = lambda cmd: None  # type: ignore[method-assign]
    with pytest.raises(TransportError, match="instead of posting its receive"):
        raw.once(8)


@needs_ucxx
def test_a_check_transfer_that_moves_too_little_is_caught() -> None:
    """Real processes: the timed iterations leave the whole pattern in the receive
    buffer, so only the check's own zeroing makes a short final transfer show."""
    nbytes = 1 << 20
    raw = RawUcx(nbytes)
    try:
        for _ in range(3):
            raw.once(nbytes)
        raw.check(nbytes)  # a full transfer passes
        raw.once = lambda n: RawUcx.once(raw, n // 2)  # type: ignore[method-assign]
        with pytest.raises(TransportError, match="differ from those sent"):
            raw.check(nbytes)
    finally:
        raw.close()


@needs_ucxx
def test_run_baselines_reports_every_size() -> None:
    results = run_baselines([4096, 1 << 20], iterations=2, warmup=0)
    assert [r.nbytes for r in results] == [4096, 1 << 20]
    assert all(r.gbps > 0 and len(r.latencies_s) == 2 for r in results)
