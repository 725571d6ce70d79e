"""A prefill's bootstrap that fails every QueryDpRanks while rooms wait on it: the decode
asks again every few milliseconds, and logs it once (then a line per 10 s with the
count), not once per failed call; the first answer after says how many calls failed.
A room whose dp rank deadline passes meanwhile names the failure, not "found no entry"."""

from __future__ import annotations

import logging

import pytest

from pdgrpc.decode.job import SchedulerConfig
from pdgrpc.decode.scheduler import DecodeScheduler
from pdgrpc.decode.service import start_decode_server
from pdgrpc.engine.reference import ReferenceEngine
from pdgrpc.serving.failure_log import FailureLog
from pdgrpc.state import DecodeDeadlines
from pdgrpc.transport.tcp import TcpTransport
from pdgrpc.v1 import bootstrap_pb2 as bpb
from tests.decode.fake_prefill import FakePrefill
from tests.decode.test_deadlines import CFG, expect_deadline, wait_idle

pytestmark = pytest.mark.timeout(60)


def _lines(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if text in r.getMessage()]


async def test_a_failing_bootstrap_is_logged_once_not_per_call(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pdgrpc.decode")
    server = await start_decode_server(DecodeScheduler(
        ReferenceEngine(CFG), TcpTransport(), 4, SchedulerConfig(deadlines=DecodeDeadlines(resolve_dp_rank_s=1.0))))
    prefill = await FakePrefill(ReferenceEngine(CFG), dp_size=2, method=bpb.LOAD_BALANCE_METHOD_SHORTEST_QUEUE).start()
    try:
        prefill.recorder.failing = True
        # the deadline names what went wrong: the query failed, not "found no entry"
        await expect_deadline(server, prefill, ("RESOLVING_DP_RANK", "last error: QueryDpRanks on",
                                                "UNAVAILABLE: bootstrap is going down"))
        assert prefill.recorder.failed >= 3  # asked again and again for the whole second
        failed = _lines(caplog, f"QueryDpRanks to {prefill.address} failed")
        assert len(failed) == 1 and failed[0].levelno == logging.WARNING
        assert "bootstrap is going down" in failed[0].getMessage()
        assert not _lines(caplog, "still failing")  # the next line is due after 10 s
        await wait_idle(server)
        # The bootstrap answers again: one line says how many calls failed meanwhile.
        prefill.recorder.failing = False
        # a room the prefill never registers: answered, so no stale error in the message
        await expect_deadline(server, prefill, ("RESOLVING_DP_RANK", "QueryDpRanks found no entry"))
        [back] = _lines(caplog, f"QueryDpRanks to {prefill.address} answers again")
        assert f"after {prefill.recorder.failed} failed calls" in back.getMessage()
    finally:
        await prefill.stop()
        await server.stop(grace=0)


def test_repeats_come_as_one_line_per_interval_with_their_count(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.failure_log")
    caplog.set_level(logging.INFO, logger="test.failure_log")
    fl = FailureLog(log, "QueryDpRanks", every_s=10.0)
    for i in range(30):  # 30 failures over 15 s
        fl.failed("a:1", f"error {i}", now=100.0 + i * 0.5)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == ("QueryDpRanks to a:1 failed (asked again next interval; repeats are logged every 10 s): "
                        "error 0")
    assert lines[1] == "QueryDpRanks to a:1 still failing: 20 more failures in 10 s, the last: error 20"
    assert len(lines) == 2
    fl.failed("b:2", "other", now=101.0)  # another peer: its own first line
    fl.succeeded("a:1")
    fl.succeeded("a:1")  # nothing failing any more: no second line
    assert [r.getMessage() for r in caplog.records][2:] == [
        "QueryDpRanks to b:2 failed (asked again next interval; repeats are logged every 10 s): other",
        "QueryDpRanks to a:1 answers again after 30 failed calls",
    ]


def test_failing_peers_kept_are_bounded(caplog: pytest.LogCaptureFixture) -> None:
    """Only the peers that failed last are kept: a forgotten one answering again logs nothing."""
    caplog.set_level(logging.INFO, logger="test.failure_log")
    fl = FailureLog(logging.getLogger("test.failure_log"), "X", max_peers=3)
    for i in range(10):
        fl.failed(f"p{i}", "e", now=0.0)
    caplog.clear()
    for i in range(10):
        fl.succeeded(f"p{i}")
    assert [r.getMessage() for r in caplog.records] == [f"X to p{i} answers again after 1 failed calls" for i in (7, 8, 9)]
