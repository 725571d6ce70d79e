"""pdgrpc.serving: shared flags build matching engines; sampling conversion validates."""

from __future__ import annotations

import argparse
import asyncio
import sys
import logging

import pytest

from pdgrpc.engine.base import InvalidRequest
from pdgrpc.engine.reference import ReferenceEngine
from pdgrpc.errors import ConfigError, TransportUnavailable
from pdgrpc.serving.convert import sampling_from_proto
from pdgrpc.serving.flags import add_engine_arguments, add_transport_arguments, create_transport, engine_config_from_args
from pdgrpc.serving.logs import add_logging_arguments, request_event
from pdgrpc.v1 import common_pb2
from tests.prefill.harness import sampling_to_proto


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    add_transport_arguments(p)
    add_logging_arguments(p)
    return p


def test_same_engine_flags_give_same_compat_hash_and_pool_size_is_not_part_of_it() -> None:
    a = ReferenceEngine(engine_config_from_args(_parser().parse_args(["--model-size", "tiny", "--num-pages", "8"])))
    b = ReferenceEngine(engine_config_from_args(_parser().parse_args(["--model-size", "tiny", "--num-pages", "16"])))
    c = ReferenceEngine(engine_config_from_args(_parser().parse_args(["--model-size", "tiny", "--num-pages", "8", "--model-seed", "1"])))
    d = ReferenceEngine(engine_config_from_args(_parser().parse_args(["--model-size", "tiny", "--num-pages", "8", "--page-size", "8"])))
    assert a.compat_hash() == b.compat_hash()
    assert a.compat_hash() != c.compat_hash()  # other weights
    assert a.compat_hash() != d.compat_hash()  # other page size
    assert a.num_pages == 8 and b.num_pages == 16


def test_bad_engine_flags_are_named() -> None:
    ns = _parser().parse_args(["--max-prompt-tokens", "5000", "--max-seq-len", "4096"])
    with pytest.raises(ConfigError, match=r"^--max-prompt-tokens \(5000\) must be < --max-seq-len \(4096\)$"):
        engine_config_from_args(ns)


def test_transport_default_is_rdma_and_unknown_backend_is_a_clear_error() -> None:
    assert _parser().parse_args([]).transport == "rdma"
    with pytest.raises(TransportUnavailable, match="unknown transport 'nope'"):
        create_transport(_parser().parse_args(["--transport", "nope"]))
    t = create_transport(_parser().parse_args(["--transport", "tcp"]))
    assert t.name == "tcp"


def test_sampling_round_trip_and_proto_zero_top_p_means_no_cut() -> None:
    msg = common_pb2.SamplingParams(temperature=0.5, top_k=7, seed=2**64 - 1, top_logprobs=3, ignore_eos=True)
    p = sampling_from_proto(msg)
    assert (p.temperature, p.top_k, p.top_p, p.seed, p.top_logprobs, p.ignore_eos) == (0.5, 7, 1.0, 2**64 - 1, 3, True)
    back = sampling_to_proto(p, max_new_tokens=9)
    assert sampling_from_proto(back) == p and back.max_new_tokens == 9


@pytest.mark.parametrize(
    "msg, field",
    [
        (common_pb2.SamplingParams(temperature=-1.0), "sampling.temperature"),
        (common_pb2.SamplingParams(temperature=float("nan")), "sampling.temperature"),
        (common_pb2.SamplingParams(top_p=1.5), "sampling.top_p"),
        (common_pb2.SamplingParams(top_logprobs=21), "sampling.top_logprobs"),
    ],
)
def test_bad_sampling_names_the_field(msg: common_pb2.SamplingParams, field: str) -> None:
    with pytest.raises(InvalidRequest, match=field):
        sampling_from_proto(msg)


def test_request_event_line_starts_with_room(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        request_event(logging.getLogger("t"), 42, "failed", reason="handshake timed out")
    assert caplog.records[-1].getMessage() == "room=42 failed reason='handshake timed out'"


async def test_deferred_request_events_wait_for_queued_work_and_keep_their_order(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("t")
    seen: list[str] = []
    with caplog.at_level(logging.INFO):
        asyncio.get_running_loop().call_soon(lambda: seen.append(f"send ran; lines so far: {len(caplog.records)}"))
        request_event(log, 1, "admitted", defer=True)
        request_event(log, 1, "dispatched", rank=0, defer=True)
        assert caplog.records == []  # nothing written yet
        await asyncio.sleep(0)
        assert seen == ["send ran; lines so far: 0"]  # the work queued first ran first
        assert [r.getMessage() for r in caplog.records] == ["room=1 admitted", "room=1 dispatched rank=0"]
        # A line logged at once first writes the deferred ones: a process's lines keep their order.
        request_event(log, 2, "admitted", defer=True)
        request_event(log, 2, "failed", reason="too long")
        assert [r.getMessage() for r in caplog.records][2:] == ["room=2 admitted", "room=2 failed reason='too long'"]
        await asyncio.sleep(0)
        assert len(caplog.records) == 4  # not written twice


def test_deferred_lines_left_by_a_loop_that_closed_are_written_by_the_next_one(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("t")

    async def later() -> None:
        request_event(log, 6, "admitted", defer=True)
        await asyncio.sleep(0)

    with caplog.at_level(logging.INFO):
        # A loop that stops before its next turn (a server shutting down) leaves its line unwritten.
        gone = asyncio.new_event_loop()
        gone.call_soon(lambda: (request_event(log, 5, "admitted", defer=True), gone.stop()))
        gone.run_forever()
        gone.close()
        assert caplog.records == []
        asyncio.run(later())
    assert [r.getMessage() for r in caplog.records] == ["room=5 admitted", "room=6 admitted"]


def test_a_deferred_request_event_without_a_loop_is_written_at_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        request_event(logging.getLogger("t"), 3, "admitted", defer=True)
    assert [r.getMessage() for r in caplog.records] == ["room=3 admitted"]


def test_metadata_row_holds_the_most_top_logprobs_a_request_may_ask_for() -> None:
    from pdgrpc.engine.base import MAX_TOP_LOGPROBS, SampledToken
    from pdgrpc.serving.metadata import metadata_layout, row_from_token
    from pdgrpc.state.metadata import MetadataBuffers

    bufs = MetadataBuffers(2, metadata_layout())
    ids = tuple(range(MAX_TOP_LOGPROBS))
    vals = tuple(-float(i) for i in ids)
    tok = SampledToken(token_id=7, logprob=-0.25, top_ids=ids, top_logprobs=vals)
    bufs.write_row(1, row_from_token(tok), room=99)
    row = bufs.read_row(1)
    assert (row.output_id, row.output_token_logprob_value, row.top_logprobs_indices, row.top_logprobs_values) == (7, -0.25, ids, vals)
    assert bufs.room(1) == 99 and bufs.room(0) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux only")
def test_lower_thread_priority_renices_only_the_calling_thread() -> None:
    import os
    import threading

    from pdgrpc.serving.threads import lower_thread_priority

    def nice_of(tid: int) -> int:
        return os.getpriority(os.PRIO_PROCESS, tid)

    me = threading.get_native_id()
    before = nice_of(me)
    seen: dict[str, int] = {}

    def run(n: int, key: str) -> None:
        lower_thread_priority(n)
        seen[key] = nice_of(threading.get_native_id())

    for n, key in ((7, "seven"), (0, "zero"), (40, "capped")):
        t = threading.Thread(target=run, args=(n, key))
        t.start()
        t.join()
    assert seen == {"seven": before + 7, "zero": before, "capped": 19}
    assert nice_of(me) == before  # the caller's thread (the loop's, in a server) is untouched
