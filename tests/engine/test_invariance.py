"""Bit-reproducibility: a request's tokens and KV bytes do not depend on how its prompt
was chunked, what else was in its decode batch, which pages it got (or what stale bytes
they held), or torch's thread count. Disaggregated serving relies on all four."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import PROMPTS, decode_from, make_engine, prefill_into
from pdgrpc.engine import DecodeRequest, SamplingParams, generate

SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, top_logprobs=5)


def page_bytes(engine, pages):  # type: ignore[no-untyped-def]
    """All K and V bytes of ``pages``, in page order, as one tensor."""
    bufs = engine.kv_buffers()
    return torch.cat([t[list(pages)].flatten().view(torch.uint8) for t in bufs.k + bufs.v])


@pytest.mark.parametrize("kv_dtype, chunks", [("float32", [1, 7, 16, 32, 50]), ("float16", [7, 16])])
def test_chunked_prefill_equals_unchunked(kv_dtype: str, chunks: list[int]) -> None:
    e = make_engine(kv_dtype=kv_dtype)
    ids = e.tokenizer.encode(PROMPTS[3])  # 82 tokens
    n = e.pages_needed(len(ids))
    results = {}
    for chunk in [None, *chunks]:
        pages = e.alloc_pages(n)
        assert pages is not None
        first = prefill_into(e, ids, pages, SEEDED, chunk)
        results[chunk] = (first, page_bytes(e, pages))
        e.free_pages(pages)
    whole_first, whole_kv = results[None]
    for chunk, (first, kv) in results.items():
        assert first == whole_first, f"chunk={chunk}"
        assert torch.equal(kv, whole_kv), f"chunk={chunk}"


def test_decode_is_batch_invariant() -> None:
    """The same request decoded alone and next to others (in any order) gives the same
    tokens, logprobs and top-logprobs at every step."""
    e = make_engine()
    reqs = []
    for i, p in enumerate(PROMPTS):
        ids = e.tokenizer.encode(p)
        pages = e.alloc_pages(e.pages_needed(len(ids) + 12))
        assert pages is not None
        params = SamplingParams(temperature=0.8, seed=i, top_logprobs=3)
        reqs.append((ids, pages, params, prefill_into(e, ids, pages, params)))

    def run(order: list[int]) -> dict[int, list]:  # type: ignore[type-arg]
        out = {i: [reqs[i][3]] for i in order}
        for _ in range(12):
            batch = [DecodeRequest(out[i][-1].token_id, len(reqs[i][0]) + len(out[i]) - 1, tuple(reqs[i][1]), reqs[i][2]) for i in order]
            for i, tok in zip(order, e.decode_step(batch)):
                out[i].append(tok)
        return out

    together = run([0, 1, 2, 3])
    reversed_ = run([3, 2, 1, 0])
    for i in range(4):
        assert run([i])[i] == together[i] == reversed_[i]
    assert run([2, 0])[0] == together[0]


def test_generate_is_the_same_at_any_batch_size_and_pool_size() -> None:
    e_big, e_small = make_engine(num_pages=64), make_engine(num_pages=9)
    one_by_one = generate(e_big, PROMPTS, 20, SEEDED, max_batch=1)
    all_at_once = generate(e_big, PROMPTS, 20, SEEDED)
    squeezed = generate(e_small, PROMPTS, 20, SEEDED, prefill_chunk_tokens=16)  # waits for pages
    assert one_by_one == all_at_once == squeezed


def test_page_indices_and_stale_page_contents_do_not_matter() -> None:
    ids = make_engine().tokenizer.encode(PROMPTS[3])
    steps = 16
    n = make_engine().pages_needed(len(ids) + steps)
    a = make_engine(num_pages=n)
    b = make_engine(num_pages=64)
    for t in b.kv_buffers().k + b.kv_buffers().v:
        t.fill_(float("nan"))  # stale garbage everywhere the request does not write
    pages_a = list(range(n))
    pages_b = [63 - 3 * i for i in range(n)]  # descending, scattered
    out_a = decode_from(a, len(ids), prefill_into(a, ids, pages_a, SEEDED, 32), pages_a, steps, SEEDED)
    out_b = decode_from(b, len(ids), prefill_into(b, ids, pages_b, SEEDED, 32), pages_b, steps, SEEDED)
    assert out_a == out_b
    # The written rows are identical; only the unwritten tail of the last page differs.
    written = len(ids) + steps
    for ta, tb in zip(a.kv_buffers().k, b.kv_buffers().k):
        ka = ta[pages_a].permute(0, 2, 1, 3).reshape(-1, ta.shape[1], ta.shape[3])[:written]
        kb = tb[pages_b].permute(0, 2, 1, 3).reshape(-1, tb.shape[1], tb.shape[3])[:written]
        assert torch.equal(ka, kb)


def test_results_do_not_depend_on_the_thread_count() -> None:
    outs = []
    for threads in (1, 2):
        e = make_engine(intra_op_threads=threads)
        gens = generate(e, PROMPTS[1:2], 3, SEEDED)  # short: 2 threads crawl on a busy CI box
        outs.append((gens, e.compute_logits(e.tokenizer.encode(PROMPTS[3]))))
    for gens, logits in outs[1:]:
        assert gens == outs[0][0]
        assert torch.equal(logits, outs[0][1])
