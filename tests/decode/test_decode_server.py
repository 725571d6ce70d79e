"""``python -m pdgrpc.decode`` as a real process on 127.0.0.1, against a fake prefill
(real bootstrap + handshake services, real tcp transport, KV from a local reference engine).

Every test ends by reading the decode's own GetStats until nothing is held (bounded wait);
the process serves metrics too, and each test checks over HTTP how its requests were
counted (finished, refused, aborted under which reason).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import AsyncIterator, Iterator

import grpc
import pytest

from pdgrpc.decode.cli import build_parser
from pdgrpc.engine.base import SamplingParams
from pdgrpc.engine.colocated import generate
from pdgrpc.engine.reference import ReferenceEngine
from pdgrpc.kvpoll import KVPoll
from tests.scrape import Scrape, scrape
from pdgrpc.serving.flags import engine_config_from_args
from pdgrpc.serving.metadata import metadata_layout
from pdgrpc.serving.room_proof import draw_secret
from pdgrpc.v1 import bootstrap_pb2 as bpb
from pdgrpc.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2
from tests.decode.fake_prefill import FakePrefill, Prompt
from tests.eventually import eventually, eventually_async
from tests.fuzz_messages import fuzz
from tests.prefill.harness import sampling_to_proto

ENGINE_FLAGS = ["--model-size", "tiny", "--page-size", "16", "--num-pages", "256", "--max-prompt-tokens", "512", "--max-seq-len", "1024"]
DECODE_FLAGS = [
    *ENGINE_FLAGS, "--transport", "tcp", "--num-slots", "8",
    "--bootstrap-timeout", "1.5", "--resolve-timeout", "10", "--abort-lease", "60", "--dp-rank-query-interval", "0.05",
    "--max-decodes-per-client", "6", "--local-prefill-chunk", "8",
    # The tests hold calls and pages as they please; tests/security/test_pool_pinning.py the share.
    "--max-decode-share", "1",
    # Every request's pages go back when it ends: the tests count pages in use.
    "--no-decode-prefix-cache",
]
STARTUP_S = 60.0
SETTLE_S = 15.0


@contextlib.contextmanager
def decode_process(log_path: Path, flags: list[str]) -> Iterator[str]:
    """A decode server process with ``flags``; yields its address."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdgrpc.decode", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", *flags],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:

        def listening() -> str | None:
            text = log_path.read_text(errors="replace")
            m = re.search(r"pdgrpc decode listening on (\S+:\d+)", text)
            if m is None and proc.poll() is not None:
                pytest.fail(f"decode server did not start (exit {proc.poll()}):\n{text}")
            return m.group(1) if m else None

        yield eventually(listening, STARTUP_S, 0.1, lambda: f"decode server did not start:\n{log_path.read_text(errors='replace')}")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def decode_proc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """The decode server process; yields (address, log path)."""
    log_path = tmp_path_factory.mktemp("decode") / "decode.log"
    with decode_process(log_path, DECODE_FLAGS) as address:
        yield address, str(log_path)


@pytest.fixture(scope="module")
def metrics_address(decode_proc: tuple[str, str]) -> str:
    """The decode process's metrics endpoint (port 0: read from its log line)."""

    def logged() -> re.Match[str] | None:
        return re.search(r"pdgrpc decode metrics on http://(\S+:\d+)/metrics", open(decode_proc[1], errors="replace").read())

    return eventually(logged, STARTUP_S, 0.05, "the decode never logged its metrics endpoint").group(1)


@pytest.fixture
def outcomes(metrics_address: str) -> "Outcomes":
    return Outcomes(metrics_address)


class Outcomes:
    """How the requests of one test were counted: the change of pdgrpc_requests_total by
    state and pdgrpc_aborts_total by reason since the fixture was made (scraped over HTTP)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.before = self._read(scrape(address))

    @staticmethod
    def _read(s: Scrape) -> dict[str, float]:
        out = {}
        for name, label in (("pdgrpc_requests", "state"), ("pdgrpc_aborts", "reason")):
            for x in s.families[name].samples:
                if x.name.endswith("_total") and x.labels["role"] == "decode":
                    out[x.labels[label] if label == "state" else f"aborted:{x.labels[label]}"] = x.value
        return out

    async def changed(self) -> dict[str, float]:
        s = await asyncio.to_thread(scrape, self.address)
        for gauge in ("pdgrpc_metadata_slots_in_use", "pdgrpc_kv_pages_in_use", "pdgrpc_kv_pages_quarantined"):
            assert s.value(gauge, role="decode") == 0, gauge  # the live gauges agree with GetStats
        now = self._read(s)
        return {k: v - self.before.get(k, 0) for k, v in now.items() if v != self.before.get(k, 0)}


@pytest.fixture(scope="module")
def engine() -> ReferenceEngine:
    """The same engine the decode process builds from the same flags."""
    return ReferenceEngine(engine_config_from_args(build_parser().parse_args(ENGINE_FLAGS)))


@pytest.fixture
async def stub(decode_proc: tuple[str, str]) -> AsyncIterator[decode_pb2_grpc.DecodeServiceStub]:
    async with grpc.aio.insecure_channel(decode_proc[0]) as channel:
        yield decode_pb2_grpc.DecodeServiceStub(channel)


@pytest.fixture
async def prefill(engine: ReferenceEngine) -> AsyncIterator[FakePrefill]:
    p = await FakePrefill(engine).start()
    try:
        yield p
    finally:
        await p.stop()


_next_room = iter(range(1_000_001, 2_000_000, 7919))


def make_request(prefill: FakePrefill, prompt: str, max_new: int, sampling: SamplingParams = SamplingParams(), **kw: object) -> decode_pb2.DecodeRequest:
    """Tell the fake prefill about the request (as a router would) and build the Decode call."""
    room = next(_next_room)
    ids = tuple(prefill.engine.tokenizer.encode(prompt))
    prefill.prompts[room] = Prompt(ids, sampling)
    kw.setdefault("room_secret", draw_secret())
    return decode_pb2.DecodeRequest(
        bootstrap_room=room, request_id=f"r{room}", input_ids=ids, sampling=sampling_to_proto(sampling, max_new),
        prefill_bootstrap_address=prefill.address, **kw,  # type: ignore[arg-type]
    )


async def collect(stub: decode_pb2_grpc.DecodeServiceStub, req: decode_pb2.DecodeRequest) -> list[decode_pb2.DecodeResponse]:
    return [m async for m in stub.Decode(req, timeout=60)]


async def assert_nothing_held(stub: decode_pb2_grpc.DecodeServiceStub) -> None:
    """Poll GetStats (bounded) until the decode holds nothing; fail showing what it holds."""
    held: dict[str, int] = {}

    async def nothing_held() -> prefill_pb2.GetStatsResponse | None:
        r = await stub.GetStats(prefill_pb2.GetStatsRequest(), timeout=5)
        held.clear()
        held.update({f: getattr(r.stats, f) for f in ("active_requests", "slots_in_use", "pages_in_use", "pages_quarantined", "transport_rooms")})
        return None if any(held.values()) else r

    s = (await eventually_async(nothing_held, SETTLE_S, 0.05, lambda: f"decode still holds {held}")).stats
    assert s.slots_total == 8 and s.pages_total == 256


PROMPTS = [
    ("hi", 12, SamplingParams()),  # below one page
    ("x" * 31, 20, SamplingParams(temperature=0.8, seed=7)),  # 32 tokens with BOS: exactly two pages
    ("The quick brown fox jumps over the lazy dog. " * 3, 17, SamplingParams(temperature=1.0, top_k=40, seed=123, top_logprobs=5)),
    ("pdgrpc " * 20, 1, SamplingParams()),  # only the prefill's token
]


async def test_tokens_equal_colocated_generation(
    stub: decode_pb2_grpc.DecodeServiceStub, prefill: FakePrefill, outcomes: Outcomes, metrics_address: str
) -> None:
    before = scrape(metrics_address)
    reqs = [make_request(prefill, text, n, s) for text, n, s in PROMPTS]
    expected = [generate(prefill.engine, [tuple(r.input_ids)], n, s)[0] for r, (_, n, s) in zip(reqs, PROMPTS)]
    results = await asyncio.gather(*(collect(stub, r) for r in reqs))
    for req, msgs, want in zip(reqs, results, expected):
        got = [t for m in msgs for t in m.token_ids]
        assert got == list(want.token_ids), f"room {req.bootstrap_room}"
        assert msgs[-1].finish_reason == want.finish_reason
        # The first logprob came through the metadata row, the rest from decode's own steps.
        assert [lp for m in msgs for lp in m.logprobs] == [t.logprob for t in want.tokens]
        tops = [(tuple(t.token_ids), tuple(t.logprobs)) for m in msgs for t in m.top_logprobs]
        assert tops == [(t.top_ids, t.top_logprobs) for t in want.tokens]
        page_bytes = 2 * 2 * 2 * 16 * 32 * 4  # K+V x 2 layers x 2 KV heads x 16 tokens x dim 32 x float32
        pages = -(-len(req.input_ids) // 16)
        assert msgs[0].bytes_transferred >= pages * page_bytes
        assert msgs[0].transfer_seconds > 0
        # The data plane's share (first KV byte -> commit) is part of handshake -> commit.
        assert 0 < msgs[0].data_plane_seconds <= msgs[0].transfer_seconds
        assert all(not m.finish_reason for m in msgs[:-1])
    await assert_nothing_held(stub)
    assert await outcomes.changed() == {"finished": len(PROMPTS)}
    # Every token past the prefill's first came from a decode step; the batch sizes say how
    # many requests shared each step.
    after = scrape(metrics_address)
    steps, stepped = (after.value(f"pdgrpc_decode_batch_size_{x}", role="decode")
                      - before.value(f"pdgrpc_decode_batch_size_{x}", role="decode") for x in ("count", "sum"))
    assert stepped == sum(len(w.token_ids) - 1 for w in expected)
    assert max(len(w.token_ids) for w in expected) - 1 <= steps <= stepped


async def test_a_local_prefill_computes_the_prompt_here_with_colocated_tokens(
    stub: decode_pb2_grpc.DecodeServiceStub, engine: ReferenceEngine, outcomes: Outcomes, metrics_address: str
) -> None:
    """local_prefill: no prefill anywhere (no bootstrap address), the prompt computed in
    chunks of 8 tokens between the steps of the others; the same tokens and logprobs. The
    decode counts the prompt tokens it computed: the prompts less what its cache held."""
    counted = ("pdgrpc_local_prefill_computed_tokens_total", "pdgrpc_decode_reused_tokens_total")
    before = scrape(metrics_address)
    reqs = []
    for text, n, s in PROMPTS:
        ids = tuple(engine.tokenizer.encode(text))
        room = next(_next_room)
        reqs.append(decode_pb2.DecodeRequest(
            bootstrap_room=room, request_id=f"r{room}", input_ids=ids, sampling=sampling_to_proto(s, n),
            room_secret=draw_secret(), local_prefill=True,
        ))
    expected = [generate(engine, [tuple(r.input_ids)], n, s)[0] for r, (_, n, s) in zip(reqs, PROMPTS)]
    results = await asyncio.gather(*(collect(stub, r) for r in reqs))
    for req, msgs, want in zip(reqs, results, expected):
        assert [t for m in msgs for t in m.token_ids] == list(want.token_ids), f"room {req.bootstrap_room}"
        assert [lp for m in msgs for lp in m.logprobs] == [t.logprob for t in want.tokens]
        assert msgs[-1].finish_reason == want.finish_reason
        assert msgs[0].bytes_transferred == 0
    await assert_nothing_held(stub)
    assert await outcomes.changed() == {"finished": len(PROMPTS)}
    after = scrape(metrics_address)
    computed, reused = (after.value(n, role="decode") - before.value(n, role="decode") for n in counted)
    assert computed > 0 and computed == sum(len(r.input_ids) for r in reqs) - reused


async def test_a_local_prefill_cancelled_while_computing_frees_everything(
    stub: decode_pb2_grpc.DecodeServiceStub, engine: ReferenceEngine, outcomes: Outcomes
) -> None:
    ids = tuple(engine.tokenizer.encode("a long prompt to compute eight tokens at a time " * 10))  # 64 chunks
    room = next(_next_room)
    req = decode_pb2.DecodeRequest(
        bootstrap_room=room, request_id=f"r{room}", input_ids=ids, sampling=sampling_to_proto(SamplingParams(), 4),
        room_secret=draw_secret(), local_prefill=True,
    )
    call = stub.Decode(req, timeout=60)

    async def computing() -> bool:
        s = (await stub.GetStats(prefill_pb2.GetStatsRequest(), timeout=5)).stats
        return s.active_requests == 1 and s.pages_in_use >= len(ids) // 16

    await eventually_async(computing, 10, 0.005, "the local prefill never held its pages")
    call.cancel()
    await assert_nothing_held(stub)
    assert await outcomes.changed() == {"aborted": 1, "aborted:cancelled": 1}


async def test_corrupted_room_aborts_without_tokens(stub: decode_pb2_grpc.DecodeServiceStub, prefill: FakePrefill, outcomes: Outcomes) -> None:
    prefill.mode = "corrupt"
    req = make_request(prefill, "corrupt me", 8)
    got: list[decode_pb2.DecodeResponse] = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for m in stub.Decode(req, timeout=30):
            got.append(m)
    assert err.value.code() == grpc.StatusCode.ABORTED
    assert "bootstrap_room mismatch" in err.value.details()
    assert str(req.bootstrap_room + 1) in err.value.details()
    assert got == []  # not even the first token from the corrupt row
    await asyncio.wait_for(prefill.workers[0].got_abort.wait(), 10)
    assert prefill.workers[0].aborts[0].bootstrap_room == req.bootstrap_room
    await assert_nothing_held(stub)
    assert await outcomes.changed() == {"aborted": 1, "aborted:metadata_corruption": 1}


async def test_unanswered_handshake_is_deadline_exceeded(stub: decode_pb2_grpc.DecodeServiceStub, prefill: FakePrefill, outcomes: Outcomes) -> None:
    prefill.mode = "hang"
    req = make_request(prefill, "nobody answers", 8)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub, req)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "BOOTSTRAPPING" in err.value.details() and "bootstrap" in err.value.details()
    # The handshake may have reached the worker: decode tells it to stop, and reuses the
    # pages once it acknowledged.
    await asyncio.wait_for(prefill.workers[0].got_abort.wait(), 10)
    await assert_nothing_held(stub)
    assert await outcomes.changed() == {"aborted": 1, "aborted:bootstrap_timeout": 1}


async def test_client_cancel_sends_abort_room_and_frees_everything(stub: decode_pb2_grpc.DecodeServiceStub, prefill: FakePrefill, outcomes: Outcomes) -> None:
    prefill.mode = "hold"  # handshake accepted, KV never comes
    req = make_request(prefill, "cancel me", 8)
    call = stub.Decode(req, timeout=60)
    await asyncio.wait_for(prefill.workers[0].got_handshake.wait(), 10)
    s = (await stub.GetStats(prefill_pb2.GetStatsRequest(), timeout=5)).stats
    assert s.active_requests == 1 and s.slots_in_use == 1 and s.pages_in_use >= 1 and s.transport_rooms == 1
    call.cancel()
    await asyncio.wait_for(prefill.workers[0].got_abort.wait(), 10)
    assert prefill.workers[0].aborts[0].bootstrap_room == req.bootstrap_room
    assert "cancel" in prefill.workers[0].aborts[0].reason
    await assert_nothing_held(stub)
    assert await outcomes.changed() == {"aborted": 1, "aborted:cancelled": 1}


async def test_a_write_after_the_abort_is_refused_naming_the_abort(stub: decode_pb2_grpc.DecodeServiceStub, prefill: FakePrefill) -> None:
    # A prefill (or one of its TP ranks) whose write comes a moment after the decode
    # aborted the room learns why the room ended, not only that it is gone: that is the
    # reason the prefill reports, and the client reads.
    prefill.mode = "late"
    req = make_request(prefill, "abort me first", 8)
    call = stub.Decode(req, timeout=60)
    await asyncio.wait_for(prefill.workers[0].got_handshake.wait(), 10)
    call.cancel()
    await asyncio.wait_for(prefill.workers[0].got_abort.wait(), 10)
    worker = prefill.workers[0]
    await eventually_async(lambda: req.bootstrap_room in worker.sent, 10, what="the fake prefill never sent the room")
    st = worker.sent[req.bootstrap_room]
    assert st.state is KVPoll.FAILED, st
    assert "released because" in (st.reason or "") and "cancelled" in (st.reason or ""), st.reason
    await assert_nothing_held(stub)


async def test_dp_rank_resolved_through_query_missing_then_found(stub: decode_pb2_grpc.DecodeServiceStub, engine: ReferenceEngine) -> None:
    p = await FakePrefill(engine, dp_size=2, method=bpb.LOAD_BALANCE_METHOD_ROUND_ROBIN).start()
    try:
        req = make_request(p, "which rank?", 6)
        want = generate(engine, [tuple(req.input_ids)], 6)[0]
        task = asyncio.ensure_future(collect(stub, req))
        # Bootstrap has no entry yet: decode asks, hears "missing", and waits.
        while not any(req.bootstrap_room in missing for _, missing in p.recorder.queries):
            p.recorder.queried.clear()
            await asyncio.wait_for(p.recorder.queried.wait(), 10)
        assert not task.done()
        assert not p.workers[0].handshakes and not p.workers[1].handshakes
        await p.register_rank(req.bootstrap_room, 1)
        msgs = await asyncio.wait_for(task, 30)
        assert [t for m in msgs for t in m.token_ids] == list(want.token_ids)
        assert [h.bootstrap_room for h in p.workers[1].handshakes] == [req.bootstrap_room]
        assert p.workers[0].handshakes == []
        asked, missing = p.recorder.queries[-1]  # the query that found it
        assert req.bootstrap_room in asked and req.bootstrap_room not in missing
        await assert_nothing_held(stub)
    finally:
        await p.stop()


async def test_routed_dp_rank_skips_the_query(stub: decode_pb2_grpc.DecodeServiceStub, engine: ReferenceEngine) -> None:
    p = await FakePrefill(engine, dp_size=2, method=bpb.LOAD_BALANCE_METHOD_ROUND_ROBIN).start()
    try:
        req = make_request(p, "pinned", 4, routed_dp_rank=0)  # never registered with bootstrap
        msgs = await collect(stub, req)
        assert [t for m in msgs for t in m.token_ids] == list(generate(engine, [tuple(req.input_ids)], 4)[0].token_ids)
        assert [h.bootstrap_room for h in p.workers[0].handshakes] == [req.bootstrap_room]
        bad = make_request(p, "pinned", 4, routed_dp_rank=2)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "routed_dp_rank" in err.value.details()
        await assert_nothing_held(stub)
    finally:
        await p.stop()


async def test_bad_requests_are_refused_naming_the_field(stub: decode_pb2_grpc.DecodeServiceStub, engine: ReferenceEngine, outcomes: Outcomes) -> None:
    p = await FakePrefill(engine, compat_hash=b"\x01" * 32).start()
    try:
        empty = make_request(p, "x", 4)
        del empty.input_ids[:]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, empty)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "input_ids" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, make_request(p, "other model", 4))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "compatibility hash" in err.value.details() and "01" * 32 in err.value.details()
        assert f"serving {engine.model_id}" in err.value.details()  # the model this decode serves
        await assert_nothing_held(stub)
        assert await outcomes.changed() == {"refused": 2}  # turned away before taking anything
    finally:
        await p.stop()


async def test_a_prefill_address_longer_than_any_host_port_is_refused_naming_it(
    stub: decode_pb2_grpc.DecodeServiceStub, prefill: FakePrefill, outcomes: Outcomes
) -> None:
    """The decode dials the address, logs it and keeps a channel for it: a megabyte one
    is refused before anything is taken, and the longest real one still serves."""
    long = make_request(prefill, "x", 4)
    long.prefill_bootstrap_address = "h" * 1_000_000 + ":1"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub, long)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("prefill_bootstrap_address: 1000002 characters, over the limit of")
    assert await outcomes.changed() == {"refused": 1}
    await assert_nothing_held(stub)


@pytest.mark.parametrize("address", ["not an address", "127.0.0.1:0", "127.0.0.1", ":50051"])
async def test_a_prefill_address_that_is_not_host_port_is_refused_naming_it(
    stub: decode_pb2_grpc.DecodeServiceStub, prefill: FakePrefill, outcomes: Outcomes, address: str
) -> None:
    """No bootstrap can answer at such an address: refused before anything is taken,
    rather than waited on until the caller's deadline."""
    bad = make_request(prefill, "x", 4)
    bad.prefill_bootstrap_address = address
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub, bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == f"prefill_bootstrap_address: {address!r} is not HOST:PORT"
    assert await outcomes.changed() == {"refused": 1}
    await assert_nothing_held(stub)


async def test_a_decode_without_its_room_secret_is_refused(stub: decode_pb2_grpc.DecodeServiceStub, prefill: FakePrefill, outcomes: Outcomes) -> None:
    """Issue 16: a Decode with no room_secret (or a short one) would send an unsigned
    handshake, so anyone could drive the decode at any prefill; it is refused, naming the
    field, before it takes a page or a slot. The router's path (a secret) is served."""
    for secret in (b"", b"short"):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, make_request(prefill, "no secret", 4, room_secret=secret))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert "room_secret" in err.value.details()
    assert not prefill.workers[0].handshakes  # nothing reached the prefill
    assert await outcomes.changed() == {"refused": 2}
    req = make_request(prefill, "with a secret", 4)
    msgs = await collect(stub, req)
    assert [t for m in msgs for t in m.token_ids] == list(generate(prefill.engine, [tuple(req.input_ids)], 4)[0].token_ids)
    await assert_nothing_held(stub)


@pytest.mark.parametrize("room", [0, 2**63, 2**64 - 1])
async def test_a_room_out_of_range_is_refused_naming_it(
    stub: decode_pb2_grpc.DecodeServiceStub, prefill: FakePrefill, outcomes: Outcomes, room: int
) -> None:
    """A room the metadata row cannot hold (or 0, "not written") is refused at the Decode
    call, before it takes a page or reaches the prefill; the next request is served."""
    bad = make_request(prefill, "a bad room", 4)
    bad.bootstrap_room = room
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub, bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == f"bootstrap_room must be in [1, 2**63), got {room}"
    assert not prefill.workers[0].handshakes
    await assert_nothing_held(stub)
    assert await outcomes.changed() == {"refused": 1}
    req = make_request(prefill, "a good room", 4)
    msgs = await collect(stub, req)
    assert [t for m in msgs for t in m.token_ids] == list(generate(prefill.engine, [tuple(req.input_ids)], 4)[0].token_ids)


async def test_write_outside_the_grant_fails_the_transfer(stub: decode_pb2_grpc.DecodeServiceStub, prefill: FakePrefill, outcomes: Outcomes) -> None:
    prefill.mode = "stray"
    req = make_request(prefill, "writes into someone else's pages", 8)
    got: list[decode_pb2.DecodeResponse] = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for m in stub.Decode(req, timeout=30):
            got.append(m)
    assert err.value.code() == grpc.StatusCode.ABORTED
    assert "transfer failed" in err.value.details() and "unauthorized write" in err.value.details()
    assert got == []
    await asyncio.wait_for(prefill.workers[0].got_abort.wait(), 10)
    await assert_nothing_held(stub)
    assert await outcomes.changed() == {"aborted": 1, "aborted:transfer_failed": 1}


async def test_restarted_prefill_worker_is_not_reused(stub: decode_pb2_grpc.DecodeServiceStub, prefill: FakePrefill) -> None:
    first = make_request(prefill, "before the restart", 3)
    assert [t for m in await collect(stub, first) for t in m.token_ids]
    old = prefill.workers[0]
    new = await prefill.restart_worker(0)
    assert prefill.generation[0] == 2
    req = make_request(prefill, "after the restart", 5)
    msgs = await collect(stub, req)
    want = generate(prefill.engine, [tuple(req.input_ids)], 5)[0]
    assert [t for m in msgs for t in m.token_ids] == list(want.token_ids)
    assert [h.bootstrap_room for h in new.handshakes] == [req.bootstrap_room]
    assert [h.bootstrap_room for h in old.handshakes] == [first.bootstrap_room]
    await assert_nothing_held(stub)


@pytest.mark.parametrize(
    "before",
    [
        pytest.param({"dp_size": 2, "method": bpb.LOAD_BALANCE_METHOD_ROUND_ROBIN}, id="was-dp2-round-robin"),
        pytest.param({"compat_hash": b"\x01" * 32}, id="was-incompatible"),
    ],
)
async def test_a_prefill_restarted_at_the_same_address_is_asked_again(
    stub: decode_pb2_grpc.DecodeServiceStub, engine: ReferenceEngine, before: dict[str, object]
) -> None:
    """A prefill instance restarts at the same bootstrap address with other parallel info
    (CI flake: a later test's fake prefill got an earlier one's port). The decode used to
    keep the first instance's info for good: it queried dp ranks the new instance never
    registers (every request timed out resolving), or refused every request as
    incompatible. The first request to the new instance must be served."""
    old = await FakePrefill(engine, **before).start()  # type: ignore[arg-type]
    port = old.bootstrap.port if old.bootstrap is not None else 0
    try:
        first = make_request(old, "to the old instance", 3, routed_dp_rank=0)
        try:
            await collect(stub, first)  # the decode caches the old instance's info (refused when incompatible)
        except grpc.aio.AioRpcError as exc:
            assert "compatibility hash mismatch" in (exc.details() or ""), exc
    finally:
        await old.stop()
    new = await FakePrefill(engine, port=port).start()
    try:
        assert new.address == old.address
        req = make_request(new, "to the new instance", 5)
        msgs = await asyncio.wait_for(collect(stub, req), 30)
        assert [t for m in msgs for t in m.token_ids] == list(generate(engine, [tuple(req.input_ids)], 5)[0].token_ids)
        assert [h.bootstrap_room for h in new.workers[0].handshakes] == [req.bootstrap_room]
        await assert_nothing_held(stub)
    finally:
        await new.stop()


async def test_a_room_waiting_for_its_dp_rank_fails_when_its_prefill_restarts(
    stub: decode_pb2_grpc.DecodeServiceStub, engine: ReferenceEngine, outcomes: Outcomes
) -> None:
    """The prefill a request was sent to restarts (same address) while the decode waits
    for the room's dp rank: the request's prefill is lost, so the decode ends it at once
    with UNAVAILABLE naming the restart (the caller sends it again) instead of waiting
    out its deadline; the next request goes to the new instance."""
    old = await FakePrefill(engine, dp_size=2, method=bpb.LOAD_BALANCE_METHOD_ROUND_ROBIN).start()
    try:
        lost = make_request(old, "sent before the restart", 4)
        task = asyncio.ensure_future(collect(stub, lost))
        while not any(lost.bootstrap_room in missing for _, missing in old.recorder.queries):
            old.recorder.queried.clear()
            await asyncio.wait_for(old.recorder.queried.wait(), 10)
    finally:
        await old.stop()
    new = await FakePrefill(engine, dp_size=2, method=bpb.LOAD_BALANCE_METHOD_ROUND_ROBIN, port=old.bootstrap.port if old.bootstrap else 0).start()
    try:
        new.prompts.update(old.prompts)  # even had it been told about the room, its first prefill is gone
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(task, 9)  # under the 10 s resolve deadline
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "restarted after this request was admitted" in err.value.details(), err.value.details()
        assert not new.workers[0].handshakes and not new.workers[1].handshakes
        req = make_request(new, "sent after the restart", 5, routed_dp_rank=1)
        msgs = await collect(stub, req)
        assert [t for m in msgs for t in m.token_ids] == list(generate(engine, [tuple(req.input_ids)], 5)[0].token_ids)
        await assert_nothing_held(stub)
        assert await outcomes.changed() == {"aborted": 1, "aborted:prefill_error": 1, "finished": 1}
    finally:
        await new.stop()


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ({"output_id": 1000}, "output_id 1000"),
        ({"output_token_logprob_value": float("nan")}, "output_token_logprob_value nan"),
        ({"top_logprobs_indices": (5000,) * 20}, "top_logprobs_indices"),
    ],
)
async def test_a_bad_metadata_row_fails_only_its_request(
    stub: decode_pb2_grpc.DecodeServiceStub, prefill: FakePrefill, outcomes: Outcomes, override: dict[str, object], named: str
) -> None:
    """Audit: a row with output_id=1000 (outside the vocabulary) was committed and the next
    decode step failed every request in its batch. The row is checked before commit: the
    bad request alone is aborted, naming the field, and the others finish correctly."""
    good = [make_request(prefill, text, n, s) for text, n, s in PROMPTS[:3]]
    bad = make_request(prefill, "a prefill writes garbage", 8)
    prefill.row_overrides[bad.bootstrap_room] = override
    expected = [generate(prefill.engine, [tuple(r.input_ids)], n, s)[0] for r, (_, n, s) in zip(good, PROMPTS)]
    results = await asyncio.gather(*(collect(stub, r) for r in [*good, bad]), return_exceptions=True)
    for req, msgs, want in zip(good, results, expected):
        assert not isinstance(msgs, BaseException), f"room {req.bootstrap_room}: {msgs}"
        assert [t for m in msgs for t in m.token_ids] == list(want.token_ids)
    err = results[-1]
    assert isinstance(err, grpc.aio.AioRpcError), err
    assert err.code() == grpc.StatusCode.ABORTED
    assert "metadata row" in err.details() and named in err.details(), err.details()
    await assert_nothing_held(stub)
    assert await outcomes.changed() == {"finished": 3, "aborted": 1, "aborted:metadata_corruption": 1}


async def test_one_client_cannot_hold_more_than_its_share_of_decode_calls(
    stub: decode_pb2_grpc.DecodeServiceStub, prefill: FakePrefill, outcomes: Outcomes
) -> None:
    """Audit: 8 direct Decode calls with no prefill behind them pinned all 1024 pages for up
    to the 600 s waiting timeout. One client may hold --max-decodes-per-client calls (6
    here); one more is refused naming the limit, and a slot frees as soon as one ends."""
    prefill.mode = "hold"  # handshake accepted, KV never comes
    before = sum(len(w.handshakes) for w in prefill.workers)
    held = [stub.Decode(make_request(prefill, f"hold {i}", 4), timeout=60) for i in range(6)]

    async def admitted() -> bool:
        return (await stub.GetStats(prefill_pb2.GetStatsRequest(), timeout=5)).stats.active_requests == 6

    await eventually_async(admitted, 15, 0.05, "6 held Decode calls admitted")
    # Each held call's handshake must have been answered "hold" before the mode turns back
    # to "ok" below; one answered later would be served and end as finished.
    await eventually_async(
        lambda: sum(len(w.handshakes) for w in prefill.workers) - before == 6, 15, 0.05, "6 handshakes held"
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub, make_request(prefill, "one too many", 4))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limit 6 per client, --max-decodes-per-client" in err.value.details()
    held.pop().cancel()
    prefill.mode = "ok"

    async def served() -> list[decode_pb2.DecodeResponse] | None:
        try:
            return await collect(stub, make_request(prefill, "after one ended", 4))
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
            return None

    assert await eventually_async(served, 15, 0.05, "a Decode call admitted once one ended")
    for call in held:
        call.cancel()
    await assert_nothing_held(stub)
    changed = await outcomes.changed()
    assert changed.get("finished") == 1 and changed.get("aborted:cancelled") == 6 and changed.get("refused", 0) >= 1, changed


def test_fuzzed_requests_never_crash_the_decode(decode_proc: tuple[str, str], metrics_address: str) -> None:
    """Fuzzing (issue 16): DecodeService requests, valid and mutated, against the live
    decode: no UNKNOWN or INTERNAL, still SERVING, and nothing held afterwards."""
    with grpc.insecure_channel(decode_proc[0]) as ch:
        fuzz(ch, ["pdgrpc.v1.DecodeService"], max_examples=40)
        stub = decode_pb2_grpc.DecodeServiceStub(ch)

        def idle() -> bool:
            s = stub.GetStats(prefill_pb2.GetStatsRequest(), timeout=5).stats
            return (s.active_requests, s.slots_in_use, s.pages_in_use, s.pages_quarantined, s.transport_rooms) == (0,) * 5

        eventually(idle, SETTLE_S, 0.05, "the decode released everything after fuzzing")
    s = scrape(metrics_address)
    for gauge in ("pdgrpc_metadata_slots_in_use", "pdgrpc_kv_pages_in_use", "pdgrpc_kv_pages_quarantined"):
        assert s.value(gauge, role="decode") == 0, gauge


async def test_a_decode_without_a_prefix_cache_has_no_kv_events(stub: decode_pb2_grpc.DecodeServiceStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        async for _ in stub.SubscribeKvEvents(prefill_pb2.SubscribeKvEventsRequest(), timeout=5):
            pass
    assert ei.value.code() is grpc.StatusCode.UNIMPLEMENTED and "--decode-prefix-cache" in ei.value.details()


async def test_a_prefill_older_than_delta_transfer_gets_every_page(
    tmp_path: Path, engine: ReferenceEngine,
) -> None:
    """Protocol version negotiation: a decode holding a prompt's pages asks a version-1
    prefill (no ``cached_pages``; it writes every page) for no skip, and a version-2 one
    for the pages it lacks. Both serve; the tokens equal colocated generation."""
    page_bytes = 2 * 2 * 2 * 16 * 32 * 4  # K+V x 2 layers x 2 KV heads x 16 tokens x dim 32 x float32
    row_bytes = metadata_layout().row_bytes
    text = "an old prefill and a new decode share a chat " * 2  # 91 tokens with BOS: 5 full pages + 11
    old = await FakePrefill(engine, protocol_version=1).start()
    new = await FakePrefill(engine).start()
    with decode_process(tmp_path / "decode.log", [*DECODE_FLAGS[:-1], "--decode-prefix-cache"]) as address:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = decode_pb2_grpc.DecodeServiceStub(channel)
            try:
                for p, held in ((old, 0), (old, 0), (new, 5)):  # the first leaves 5 full pages cached
                    req = make_request(p, text, 6)
                    want = generate(engine, [tuple(req.input_ids)], 6)[0]
                    msgs = await collect(stub, req)
                    assert [t for m in msgs for t in m.token_ids] == list(want.token_ids), p.protocol_version
                    shake = p.workers[0].handshakes[-1]
                    assert (shake.compatibility_hash, shake.cached_pages) == (p.compat_hash, held)
                    assert msgs[0].bytes_transferred == (6 - held) * page_bytes + row_bytes
            finally:
                await old.stop()
                await new.stop()
