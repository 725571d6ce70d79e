"""A prefill worker's compute process (``--compute-in process``): a real child process over
a KV pool in shared memory. It must compute exactly what the engine computes in-process,
take turns between prompts chunk by chunk, stop a cancelled prompt, and report its own
death to every prompt in flight. The last test kills the compute process of a real
prefill worker."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import signal
from pathlib import Path
from typing import Any, AsyncIterator

import grpc
import pytest
import pytest_asyncio
import torch

from pdgrpc.engine.base import PrefillRequest, SamplingParams
from pdgrpc.engine.errors import InvalidRequest
from pdgrpc.engine.reference import ReferenceEngine
from pdgrpc.errors import ConfigError
from pdgrpc.prefill.compute_process import ComputeProcess, ComputeProcessLost, pool_bytes, shared_kv_pool
from tests.eventually import eventually_async
from tests.prefill.fake_decode import FakeDecode
from tests.prefill.harness import CONFIG, hold_on_dp1, prefill_stub, prompt, run_one
from tests.prefill.procs import ENGINE_FLAGS, PrefillProc, child_pids, pid_alive

pytestmark = pytest.mark.timeout(180)
# The async tests share the module's loop: the compute process fixture lives on it.
ON_MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")


class Posts:
    """Collects a job's posts and its stop."""

    def __init__(self, name: str = "", log: list[tuple[str, int]] | None = None) -> None:
        self.name = name
        self.items: list[tuple[int, Any, float, BaseException | None]] = []
        self.stopped = asyncio.Event()
        self.log = log

    def post(self, end: int, token: Any, secs: float, err: BaseException | None) -> None:
        self.items.append((end, token, secs, err))
        if self.log is not None:
            self.log.append((self.name, end))

    def stop(self) -> None:
        self.stopped.set()

    async def wait(self) -> None:
        await asyncio.wait_for(self.stopped.wait(), 60)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cp() -> AsyncIterator[ComputeProcess]:
    """One compute process for the tests that leave it serving (each waits for its prompts)."""
    c = await ComputeProcess.start(CONFIG, name="test")
    try:
        yield c
    finally:
        await c.aclose()


@pytest_asyncio.fixture(loop_scope="module")
async def own_cp() -> AsyncIterator[ComputeProcess]:
    """A compute process of the test's own, for a test that kills it."""
    c = await ComputeProcess.start(CONFIG, name="test")
    try:
        yield c
    finally:
        await c.aclose()


def _kv(engine: ReferenceEngine, pages: list[int]) -> list[torch.Tensor]:
    b = engine.kv_buffers()
    return [t[pages].clone() for t in b.k + b.v]


def _request(local: ReferenceEngine, n: int, seed: int) -> PrefillRequest:
    """An ``n``-token prompt and pages for it, allocated from the worker's view of the pool."""
    pages = local.alloc_pages(local.pages_needed(n))
    assert pages is not None
    return PrefillRequest(tuple(prompt(n, seed)), tuple(pages))


@ON_MODULE_LOOP
async def test_computes_what_the_engine_computes_in_process(cp: ComputeProcess) -> None:
    local = ReferenceEngine(CONFIG, kv_pool=cp.kv)  # the worker's view of the shared pool
    ref = ReferenceEngine(CONFIG)
    ids = tuple(prompt(50, 7))
    sampling = SamplingParams(temperature=0.8, seed=3)
    pages = local.alloc_pages(local.pages_needed(len(ids)))
    ref_pages = ref.alloc_pages(ref.pages_needed(len(ids)))
    assert pages is not None and ref_pages is not None
    expected = None
    for start in range(0, len(ids), 16):
        expected = ref.prefill_chunk(PrefillRequest(ids, tuple(ref_pages), sampling), start, min(len(ids), start + 16))
    p = Posts()
    # min_pages 0: every chunk is posted, each with its end and only the last with a token.
    cp.submit(PrefillRequest(ids, tuple(pages), sampling), 16, 0, CONFIG.page_size, p.post, p.stop)
    await p.wait()
    assert [(end, err) for end, _, _, err in p.items] == [(16, None), (32, None), (48, None), (50, None)]
    assert [tok is None for _, tok, _, _ in p.items] == [True, True, True, False]
    assert p.items[-1][1] == expected
    assert all(secs > 0 for _, _, secs, _ in p.items)
    # The child wrote the KV into the memory the worker (and its transport) sees.
    for got, want in zip(_kv(local, pages), _kv(ref, ref_pages)):
        assert torch.equal(got, want)


@ON_MODULE_LOOP
async def test_posts_only_what_the_worker_acts_on(cp: ComputeProcess) -> None:
    req = _request(ReferenceEngine(CONFIG, kv_pool=cp.kv), 60, 8)
    p = Posts()
    # 10 pages (40 tokens) per write: posts at 48 (12 complete pages) and at the end,
    # each carrying the compute seconds since the post before.
    cp.submit(req, 16, 10, CONFIG.page_size, p.post, p.stop)
    await p.wait()
    assert [end for end, *_ in p.items] == [48, 60]


@ON_MODULE_LOOP
async def test_prompts_take_turns_chunk_by_chunk(cp: ComputeProcess) -> None:
    local = ReferenceEngine(CONFIG, kv_pool=cp.kv)
    order: list[tuple[str, int]] = []
    jobs = []
    # Both prompts are waiting when the process looks (it is stopped while they are
    # sent), so how busy this host is cannot decide which arrives first.
    assert cp.proc is not None
    os.kill(cp.proc.pid, signal.SIGSTOP)
    try:
        for name, seed in (("a", 1), ("b", 2)):
            p = Posts(name, order)
            jobs.append(p)
            cp.submit(_request(local, 48, seed), 16, 0, CONFIG.page_size, p.post, p.stop)
    finally:
        os.kill(cp.proc.pid, signal.SIGCONT)
    for p in jobs:
        await p.wait()
    # One chunk each in turn: neither prompt waits for the other to finish.
    assert order == [("a", 16), ("b", 16), ("a", 32), ("b", 32), ("a", 48), ("b", 48)]


@ON_MODULE_LOOP
async def test_a_cancelled_prompt_stops_and_says_so(cp: ComputeProcess) -> None:
    req = _request(ReferenceEngine(CONFIG, kv_pool=cp.kv), 64, 9)
    p = Posts()
    job = cp.submit(req, 4, 0, CONFIG.page_size, p.post, p.stop)
    await eventually_async(lambda: p.items, 30, what="a chunk posted", interval=0.001)
    cp.cancel(job)
    await p.wait()
    assert len(p.items) < 16 and p.items[-1][0] < 64  # stopped before the last of 16 chunks
    # The process serves the next prompt as usual.
    q = Posts()
    cp.submit(req, 32, 0, CONFIG.page_size, q.post, q.stop)
    await q.wait()
    assert [end for end, *_ in q.items] == [32, 64]


@ON_MODULE_LOOP
async def test_an_engine_error_fails_that_prompt_only(cp: ComputeProcess) -> None:
    local = ReferenceEngine(CONFIG, kv_pool=cp.kv)
    p = Posts()
    cp.submit(PrefillRequest(tuple(prompt(8, 1)), (CONFIG.num_pages + 5, 1)), 16, 0, CONFIG.page_size, p.post, p.stop)
    await p.wait()
    [(end, token, _, err)] = p.items
    assert token is None and isinstance(err, InvalidRequest) and "outside the pool" in str(err)
    ok = Posts()
    pages = local.alloc_pages(2)
    assert pages is not None
    cp.submit(PrefillRequest(tuple(prompt(8, 1)), tuple(pages)), 16, 0, CONFIG.page_size, ok.post, ok.stop)
    await ok.wait()
    assert ok.items[-1][0] == 8 and ok.items[-1][3] is None and ok.items[-1][1] is not None


@ON_MODULE_LOOP
async def test_its_death_fails_the_prompts_in_flight_and_later_ones(own_cp: ComputeProcess) -> None:
    cp = own_cp
    local = ReferenceEngine(CONFIG, kv_pool=cp.kv)
    lost: list[str] = []
    cp.on_lost = lost.append
    pages = local.alloc_pages(16)
    assert pages is not None
    p = Posts()
    cp.submit(PrefillRequest(tuple(prompt(64, 4)), tuple(pages)), 4, 0, CONFIG.page_size, p.post, p.stop)
    await eventually_async(lambda: p.items, 30, what="a chunk posted", interval=0.001)
    assert cp.proc is not None
    os.kill(cp.proc.pid, signal.SIGKILL)
    await p.wait()
    end, token, _, err = p.items[-1]
    assert isinstance(err, ComputeProcessLost) and f"compute process {cp.proc.pid} is gone" in str(err)
    assert "exit code -9" in str(err)
    assert lost == [str(err)]
    with pytest.raises(ComputeProcessLost):
        cp.submit(PrefillRequest(tuple(prompt(4, 1)), tuple(pages)), 4, 0, CONFIG.page_size, p.post, p.stop)


@ON_MODULE_LOOP
async def test_kv_huge_pages_still_computes_the_same() -> None:
    # --kv-huge-pages asks for huge pages on the shared pool (granted only where the host
    # allows them for shared memory); the pool and the results must not change.
    config = dataclasses.replace(CONFIG, kv_huge_pages=True)
    c = await ComputeProcess.start(config, name="test")
    try:
        local = ReferenceEngine(config, kv_pool=c.kv)
        ref = ReferenceEngine(CONFIG)
        ids = tuple(prompt(30, 3))
        pages, ref_pages = local.alloc_pages(8), ref.alloc_pages(8)
        assert pages is not None and ref_pages is not None
        expected = ref.prefill_chunk(PrefillRequest(ids, tuple(ref_pages)), 0, 30)
        p = Posts()
        c.submit(PrefillRequest(ids, tuple(pages)), 64, 0, CONFIG.page_size, p.post, p.stop)
        await p.wait()
        assert p.items[-1][1] == expected
        for got, want in zip(_kv(local, pages), _kv(ref, ref_pages)):
            assert torch.equal(got, want)
    finally:
        await c.aclose()


@ON_MODULE_LOOP
async def test_close_ends_the_child() -> None:
    for how in ("close", "aclose"):
        c = await ComputeProcess.start(CONFIG, name="test")
        assert c.proc is not None and pid_alive(c.proc.pid)
        if how == "close":
            c.close()
        else:
            await c.aclose()
        assert c.proc.returncode == 0
        with pytest.raises(ComputeProcessLost, match="closed"):
            c.submit(PrefillRequest((1,), (0,)), 4, 0, CONFIG.page_size, lambda *a: None, lambda: None)


def test_the_shared_pool_is_mapped_in_full_at_start_not_during_prompts() -> None:
    # A page's first use must not fault inside a prompt's compute, as it did on the first
    # pass through the pool: writing every page of a fresh pool faults (almost) nowhere,
    # since the pages were allocated and mapped at start.
    import mmap
    import resource

    layout = CONFIG.kv_layout()
    fd = os.memfd_create("pdgrpc-kv-test", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, pool_bytes(layout))
        kv, region = shared_kv_pool(layout, fd)
        tensors = (*kv.k, *kv.v)
        pages = sum(t.nbytes for t in tensors) // mmap.PAGESIZE
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for t in tensors:
            t.fill_(1)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        assert faults < pages // 10, f"{faults} page faults writing a pool of {pages} pages"
        del kv, t, tensors
        region.close()
    finally:
        os.close(fd)


def test_the_engine_refuses_a_pool_of_the_wrong_shape() -> None:
    bad = ReferenceEngine(dataclasses.replace(CONFIG, num_pages=CONFIG.num_pages * 2)).kv_buffers()
    with pytest.raises(ConfigError, match="kv_pool tensors must be contiguous"):
        ReferenceEngine(CONFIG, kv_pool=bad)


# ---- a real prefill worker ----------------------------------------------------------------


@ON_MODULE_LOOP
async def test_a_worker_whose_compute_process_dies_fails_its_request_and_exits(tmp_path: Path) -> None:
    p = PrefillProc(
        [*ENGINE_FLAGS, "--transport", "fake", "--dp-size", "2", "--load-balance-method", "round_robin",
         "--handshake-timeout", "30"],
        tmp_path, "cp",
    )
    d = FakeDecode(CONFIG, transport="fake")
    await d.start()
    ch, stub = await prefill_stub(p)
    try:
        worker = p.worker_pids[1]
        [compute] = child_pids(worker)
        # Held by dp1 waiting for a handshake that never comes: its prompt is computing or
        # computed; the compute process dies under it.
        _, held = await hold_on_dp1(stub, prompt(60, 2))
        os.kill(compute, signal.SIGKILL)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await asyncio.wait_for(held, 30)
        assert ei.value.code() is grpc.StatusCode.UNAVAILABLE
        # The worker exits non-zero, saying why; its controller sees the rank gone.
        await eventually_async(lambda: not pid_alive(worker), 30, what="the worker exits with its compute process", interval=0.1)
        await eventually_async(lambda: re.search(r"prefill worker dp1 \(pid \d+\) exited with code 1", p.log()), 15,
                               what="the controller reports the worker's exit", interval=0.1)
        assert re.search(rf"dp1: exiting: prefill dp1: compute process {compute} is gone", p.log())
        # dp0 (and its compute process) keeps serving.
        for i in range(2):
            resp, r = await run_one(p, d, prompt(20, 10 + i), SamplingParams(), query=True)
            assert resp.dp_rank == 0 and resp.prompt_tokens == 20
            d.free(r)
        # A worker killed outright takes its compute process with it (PR_SET_PDEATHSIG).
        survivor = p.worker_pids[0]
        [survivor_compute] = child_pids(survivor)
        os.kill(survivor, signal.SIGKILL)
        await eventually_async(lambda: not pid_alive(survivor_compute), 15, what="the compute process dies with its worker", interval=0.1)
    finally:
        await ch.close()
        await d.close()
        p.stop()


@pytest.mark.parametrize(
    "flags, memfd, want, said",
    [
        ([], True, "process", None),
        (["--compute-in", "thread"], True, "thread", None),
        (["--model", "/a/checkpoint"], True, "thread", "a --model engine computes on a thread"),
        (["--tp-size", "2", "--tp-rank", "1"], True, "thread", "its gloo group lives in the worker"),
        ([], False, "thread", "needs memfd_create (Linux)"),
    ],
)
def test_where_a_worker_computes(flags: list[str], memfd: bool, want: str, said: str | None,
                                 monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from pdgrpc.prefill import worker_role

    if not memfd:
        monkeypatch.delattr(os, "memfd_create", raising=False)
    ns = worker_role.build_parser().parse_args(
        ["--dp-rank", "0", "--dp-size", "1", "--bootstrap", "127.0.0.1:1", "--load-balance-method", "round_robin", *flags]
    )
    with caplog.at_level("INFO", logger="pdgrpc.prefill"):
        assert worker_role.compute_in(ns) == want
    if said is not None:
        assert said in caplog.text
