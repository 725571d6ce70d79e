"""Prefill in one engine, copy only the pages' bytes (and the first token) into another,
decode there: the tokens equal colocated generation. Also across TP sizes, where each
side holds a different head slice of every page."""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable, Sequence, TypeVar

import pytest

from engine_helpers import PROMPTS, TINY, make_engine, prefill_into
from local_all_reduce import LocalAllReduce
from transfer_sim import copy_pages
from pdgrpc.engine import DecodeRequest, Generation, ReferenceEngine, SampledToken, SamplingParams, generate, stop_reason
from pdgrpc.errors import CompatibilityError, ConfigError, EngineError

T = TypeVar("T")
MAX_NEW = 16
PARAMS = [SamplingParams(temperature=0.0, top_logprobs=2), SamplingParams(temperature=1.0, seed=7, top_logprobs=2)]


def poison(engine: ReferenceEngine) -> None:
    for t in engine.kv_buffers().k + engine.kv_buffers().v:
        t.fill_(float("nan"))


def colocated(sampling: SamplingParams) -> list[Generation]:
    return generate(make_engine(), PROMPTS, MAX_NEW, sampling)


def decode_all(engine: ReferenceEngine, prompts: list[list[int]], firsts: list[SampledToken], pages: list[list[int]], sampling: SamplingParams) -> list[tuple[SampledToken, ...]]:
    """A decode server's loop: all requests batched, each leaving when it stops."""
    out = [[f] for f in firsts]
    live = [i for i in range(len(prompts)) if stop_reason(firsts[i].token_id, 1, MAX_NEW, sampling, 257) is None]
    while live:
        batch = [DecodeRequest(out[i][-1].token_id, len(prompts[i]) + len(out[i]) - 1, tuple(pages[i]), sampling) for i in live]
        for i, tok in zip(live, engine.decode_step(batch)):
            out[i].append(tok)
        live = [i for i in live if stop_reason(out[i][-1].token_id, len(out[i]), MAX_NEW, sampling, 257) is None]
    return [tuple(o) for o in out]


def on_ranks(engines: Sequence[ReferenceEngine], fn: Callable[[ReferenceEngine], T]) -> list[T]:
    """Run ``fn`` on every TP rank at once (one thread each), as TP servers would."""
    results: list[T | None] = [None] * len(engines)
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            results[r] = fn(engines[r])
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a TP rank hung"
    if errors:
        raise errors[0]
    return results  # type: ignore[return-value]


def tp_group(size: int, timeout: float = 60.0) -> list[ReferenceEngine]:
    ar = LocalAllReduce(size, timeout=timeout)
    return [
        ReferenceEngine(dataclasses.replace(make_engine().config, tp_size=size, tp_rank=r), all_reduce=ar.for_rank(r))
        for r in range(size)
    ]


def prefill_batch(engine: ReferenceEngine, prompts: list[list[int]], sampling: SamplingParams) -> tuple[list[SampledToken], list[list[int]]]:
    firsts, pages = [], []
    for ids in prompts:
        p = engine.alloc_pages(engine.pages_needed(len(ids)))
        assert p is not None
        firsts.append(prefill_into(engine, ids, p, sampling, chunk=32))
        pages.append(p)
    return firsts, pages


def dst_pages_for(engine: ReferenceEngine, prompts: list[list[int]]) -> list[list[int]]:
    engine.alloc_pages(5)  # so destination page numbers differ from the source's
    out = []
    for ids in prompts:
        p = engine.alloc_pages(engine.pages_needed(len(ids) + MAX_NEW))
        assert p is not None
        out.append(p[::-1])
    return out


@pytest.mark.parametrize("sampling", PARAMS, ids=["greedy", "seeded"])
def test_decode_from_transferred_pages_equals_colocated(sampling: SamplingParams) -> None:
    prefill_e, decode_e = make_engine(), make_engine()
    poison(decode_e)
    prompts = [prefill_e.tokenizer.encode(p) for p in PROMPTS]
    firsts, src = prefill_batch(prefill_e, prompts, sampling)
    dst = dst_pages_for(decode_e, prompts)
    for s, d in zip(src, dst):
        copied = copy_pages(prefill_e, s, decode_e, d[: len(s)])
        assert copied == len(s) * 2 * prefill_e.config.model.num_layers * prefill_e.kv_layout.page_bytes
        prefill_e.free_pages(s)
    assert prefill_e.num_free_pages == prefill_e.num_pages
    got = decode_all(decode_e, prompts, firsts, dst, sampling)
    assert got == [g.tokens for g in colocated(sampling)]


def test_tensor_parallel_2_generates_exactly_what_tp1_does() -> None:
    sampling = PARAMS[1]
    ranks = tp_group(2)
    assert [r.kv_layout.head_start for r in ranks] == [0, 1]
    assert all(r.kv_layout.local_kv_heads == 1 for r in ranks)
    tp2 = on_ranks(ranks, lambda e: generate(e, PROMPTS, MAX_NEW, sampling))
    assert tp2[0] == tp2[1] == colocated(sampling)
    assert all(r.num_free_pages == r.num_pages for r in ranks)


def test_prefill_tp2_to_decode_tp1_and_tp1_to_tp2() -> None:
    sampling = PARAMS[1]
    want = [g.tokens for g in colocated(sampling)]
    prompts = [make_engine().tokenizer.encode(p) for p in PROMPTS]

    # TP2 prefill -> TP1 decode: each prefill rank fills its own head of every page.
    p_ranks = tp_group(2)
    results = on_ranks(p_ranks, lambda e: prefill_batch(e, prompts, sampling))
    assert results[0] == results[1]  # same first tokens and page numbers on both ranks
    firsts, src = results[0]
    d = make_engine()
    poison(d)
    dst = dst_pages_for(d, prompts)
    for rank in p_ranks:
        for s, dp in zip(src, dst):
            assert copy_pages(rank, s, d, dp[: len(s)]) == len(s) * 2 * rank.config.model.num_layers * rank.kv_layout.page_bytes
    assert decode_all(d, prompts, firsts, dst, sampling) == want

    # TP1 prefill -> TP2 decode: each decode rank takes its head slice of every page.
    p = make_engine()
    firsts, src = prefill_batch(p, prompts, sampling)
    d_ranks = tp_group(2)
    for rank in d_ranks:
        poison(rank)
    dsts = [dst_pages_for(rank, prompts) for rank in d_ranks]
    for rank, dst in zip(d_ranks, dsts):
        for s, dp in zip(src, dst):
            copy_pages(p, s, rank, dp[: len(s)])
    got = on_ranks(d_ranks, lambda e: decode_all(e, prompts, firsts, dsts[d_ranks.index(e)], sampling))
    assert got[0] == got[1] == want


def test_copy_refuses_incompatible_engines_and_mismatched_page_lists() -> None:
    a = make_engine(TINY)
    with pytest.raises(CompatibilityError, match="compatibility hashes differ"):
        copy_pages(a, [0], make_engine(TINY, page_size=8), [0])
    with pytest.raises(CompatibilityError):
        copy_pages(a, [0], make_engine(dataclasses.replace(TINY, seed=3)), [0])
    with pytest.raises(ConfigError, match="2 source pages but 1 destination"):
        copy_pages(a, [0, 1], make_engine(TINY), [0])


def test_a_rank_that_never_arrives_fails_the_others_instead_of_hanging() -> None:
    ranks = tp_group(2, timeout=0.5)
    ids = ranks[0].tokenizer.encode(b"lonely")
    with pytest.raises(EngineError, match="did not arrive"):
        prefill_into(ranks[0], ids, [0])  # rank 1 is never called
