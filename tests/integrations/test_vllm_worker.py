"""The vLLM connector's worker side without vLLM: two worker sides in one process, a
prefill's and a decode's, over the real tcp transport and gRPC handshake, with KV caches
shaped as vLLM's CPU backend shapes them (``[blocks, kv_heads, block_size, 2 * head_size]``
per layer)."""

from __future__ import annotations

import time

import pytest
import torch

from pdgrpc.integrations.vllm.jobs import Jobs, LoadJob, ReleaseJob, SendJob
from pdgrpc.integrations.vllm.params import TransferParams
from pdgrpc.integrations.vllm.worker import Finished, WorkerOptions, WorkerSide, compat_hash
from pdgrpc.serving.room_proof import draw_secret
from pdgrpc.state.room import Room

LAYERS = 3


def kv_caches(num_blocks: int, *, random: bool, block_size: int = 32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    make = (lambda: torch.randn(num_blocks, 2, block_size, 128, generator=gen)) if random else (
        lambda: torch.zeros(num_blocks, 2, block_size, 128))
    return {f"model.layers.{i}.self_attn.attn": make() for i in range(LAYERS)}


def side(caches: dict[str, torch.Tensor], **options: float) -> WorkerSide:
    w = WorkerSide(WorkerOptions(**options))  # type: ignore[arg-type]
    w.register(caches, compat_hash(caches, next(iter(caches.values())).shape[2], "test"))
    return w


@pytest.fixture
def pair():
    made: list[WorkerSide] = []

    def build(p_caches=None, d_caches=None, p_opts=None, d_opts=None):
        p = side(p_caches if p_caches is not None else kv_caches(16, random=True), **(p_opts or {}))
        made.append(p)
        d = side(d_caches if d_caches is not None else kv_caches(16, random=False), **(d_opts or {}))
        made.append(d)
        return p, d

    yield build
    for w in made:
        w.close()


def collect(worker: WorkerSide, done: Finished, until, timeout: float = 10.0) -> Finished:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = worker.take_finished()
        done.sending |= got.sending
        done.recving |= got.recving
        done.failed_recving |= got.failed_recving
        if until(done):
            return done
        time.sleep(0.01)
    raise AssertionError(f"timed out; so far {done}")


def params_for(p: WorkerSide, room: int, secret: bytes, blocks: tuple[int, ...]) -> TransferParams:
    return TransferParams(Room(room), secret, p.address, p.writer_id, blocks, 32 * len(blocks))


def test_blocks_land_in_the_decodes_blocks_byte_for_byte(pair):
    p_caches, d_caches = kv_caches(16, random=True), kv_caches(16, random=False)
    p, d = pair(p_caches, d_caches)
    secret = draw_secret()
    src, dst = (3, 5, 6, 9), (10, 2, 3, 4)
    p.submit(Jobs(sends=[SendJob("p1", Room(11), secret, src, 30.0)]))
    d.submit(Jobs(loads=[LoadJob("d1", params_for(p, 11, secret, src), dst, 0)]))
    got = collect(d, Finished(), lambda f: "d1" in f.recving)
    assert not got.failed_recving
    for name in d_caches:
        for s, t in zip(src, dst):
            assert torch.equal(d_caches[name][t], p_caches[name][s])
        untouched = [b for b in range(16) if b not in dst]
        assert not d_caches[name][untouched].any(), "a block outside the grant was written"
    collect(p, Finished(), lambda f: "p1" in f.sending)  # the prefill frees its blocks


def test_cached_leading_blocks_are_not_sent(pair):
    p_caches, d_caches = kv_caches(16, random=True), kv_caches(16, random=False)
    p, d = pair(p_caches, d_caches)
    secret = draw_secret()
    src, dst = (1, 2, 3), (4, 5, 6)
    p.submit(Jobs(sends=[SendJob("p1", Room(12), secret, src, 30.0)]))
    d.submit(Jobs(loads=[LoadJob("d1", params_for(p, 12, secret, src), dst, 1)]))
    got = collect(d, Finished(), lambda f: "d1" in f.recving)
    assert not got.failed_recving
    for name in d_caches:
        assert not d_caches[name][4].any()  # held by the decode's prefix cache: not written
        assert torch.equal(d_caches[name][5], p_caches[name][2])


def test_a_handshake_without_the_rooms_secret_is_refused_and_the_lease_frees_the_blocks(pair):
    p, d = pair(p_opts={"handshake_wait_s": 1.0})
    p.submit(Jobs(sends=[SendJob("p1", Room(13), draw_secret(), (1, 2), 1.0)]))
    d.submit(Jobs(loads=[LoadJob("d1", params_for(p, 13, draw_secret(), (1, 2)), (3, 4), 0)]))
    got = collect(d, Finished(), lambda f: "d1" in f.recving)
    assert got.failed_recving == {"d1"}
    t0 = time.monotonic()
    collect(p, Finished(), lambda f: "p1" in f.sending, timeout=5.0)
    assert time.monotonic() - t0 < 3.0


def test_a_mismatched_cache_layout_is_refused(pair):
    p, d = pair(p_caches=kv_caches(16, random=True), d_caches=kv_caches(16, random=False, block_size=64))
    secret = draw_secret()
    p.submit(Jobs(sends=[SendJob("p1", Room(14), secret, (1,), 30.0)]))
    d.submit(Jobs(loads=[LoadJob("d1", params_for(p, 14, secret, (1,)), (2,), 0)]))
    assert collect(d, Finished(), lambda f: "d1" in f.recving).failed_recving == {"d1"}
    collect(p, Finished(), lambda f: "p1" in f.sending)  # the failed load aborted the room


def test_an_abort_is_acknowledged_then_the_load_is_reported_and_the_prefill_frees(pair):
    p, d = pair(p_opts={"handshake_wait_s": 30.0})
    secret = draw_secret()
    params = params_for(p, 15, secret, (1, 2))
    d.submit(Jobs(loads=[LoadJob("d1", params, (3, 4), 0)]))  # the handshake waits: no send job yet
    time.sleep(0.3)
    p.submit(Jobs(sends=[SendJob("p1", Room(15), secret, (1, 2), 30.0)]))
    d.submit(Jobs(releases=[ReleaseJob("d1", params)]))
    assert collect(d, Finished(), lambda f: "d1" in f.recving).failed_recving == {"d1"}
    collect(p, Finished(), lambda f: "p1" in f.sending)


def test_a_prefill_gone_mid_handshake_fails_the_load_within_two_seconds(pair):
    p, d = pair(p_opts={"handshake_wait_s": 30.0})
    d.submit(Jobs(loads=[LoadJob("d1", params_for(p, 16, draw_secret(), (1,)), (2,), 0)]))
    time.sleep(0.3)
    p.close()
    t0 = time.monotonic()
    assert collect(d, Finished(), lambda f: "d1" in f.recving).failed_recving == {"d1"}
    assert time.monotonic() - t0 < 2.0
