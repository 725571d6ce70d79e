"""Both engines over the prefix cache, driven the way a prefill worker drives them: a
prompt's cached pages are locked, the compute starts at the cached offset, and finished
prompts insert their full pages. The pools are small, so prompts evict each other's pages
while the test runs. Output with hits equals output without them: the reference engine
bit for bit against a cold run, over chunk sizes; the checkpoint engine against
``transformers``."""

from __future__ import annotations

import random
from typing import Sequence

import pytest
import torch

from engine_helpers import TINY, decode_from, make_engine
from pdgrpc.engine.base import Engine, PrefillRequest, SampledToken, SamplingParams
from pdgrpc.engine.colocated import generate
from pdgrpc.state.prefix_cache import PrefixCache

NEW_TOKENS = 6


def _grouped_prompts(vocab: int, page: int, seed: int) -> list[list[int]]:
    """Three prefixes of 3-5 pages (one not page-aligned), each with questions of 1-20
    tokens and one question that is the prefix alone, interleaved."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randint(3, 5) * page + (i == 1) * 3)] for i in range(3)]
    groups = [[p + [rng.randrange(vocab) for _ in range(rng.randint(1, 20))] for _ in range(3)] + [p] for p in prefixes]
    return [g[i] for i in range(4) for g in groups]


def _run(engine: Engine, cache: PrefixCache, prompt: Sequence[int], chunk: int, sampling: SamplingParams) -> tuple[list[SampledToken], int]:
    """One request: its tokens and how many prompt tokens came from the cache."""
    lease = cache.acquire(prompt, engine.pages_needed(len(prompt) + NEW_TOKENS))
    assert lease is not None, "the pool holds one request"
    try:
        req = PrefillRequest(tuple(prompt), lease.pages, sampling)
        first = None
        for start in range(lease.cached_tokens, len(prompt), chunk):
            first = engine.prefill_chunk(req, start, min(len(prompt), start + chunk))
        assert first is not None
        return decode_from(engine, len(prompt), first, lease.pages, NEW_TOKENS - 1, sampling), lease.cached_tokens  # type: ignore[arg-type]
    finally:
        cache.release(lease, insert=True)


@pytest.mark.parametrize("chunk", [5, 16, 40], ids=["mid-page", "page", "multi-page"])
def test_reference_engine_with_hits_and_evictions_equals_a_cold_run(chunk: int) -> None:
    engine = make_engine(TINY, num_pages=12)
    cache = PrefixCache(engine, engine.kv_layout.page_size)
    prompts = _grouped_prompts(engine.tokenizer.vocab_size, engine.kv_layout.page_size, seed=chunk)
    samplings = [SamplingParams(temperature=0.9, seed=i, top_k=20) if i % 2 else SamplingParams() for i in range(len(prompts))]
    cold = make_engine(TINY)
    hits = 0
    for prompt, sampling in zip(prompts, samplings):
        got, cached = _run(engine, cache, prompt, chunk, sampling)
        hits += cached
        (want,) = generate(cold, [prompt], NEW_TOKENS, sampling)
        assert got == list(want.tokens), f"prompt of {len(prompt)} tokens, {cached} cached"
    assert hits > 0 and cache.evictions > 0


def test_checkpoint_engine_with_hits_and_evictions_equals_transformers(hf_checkpoint) -> None:
    transformers = pytest.importorskip("transformers", reason="the reference implementation (test extra)")
    from pdgrpc.engine.hf.engine import HFEngine, HFEngineConfig

    path = hf_checkpoint("llama")
    engine = HFEngine(HFEngineConfig(str(path), num_pages=12, max_prompt_tokens=256, max_seq_len=512))
    page = engine.kv_layout.page_size
    cache = PrefixCache(engine, page)
    prompts = _grouped_prompts(engine.tokenizer.vocab_size, page, seed=3)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    hits = 0
    for prompt in prompts:
        got, cached = _run(engine, cache, prompt, 24, SamplingParams())
        hits += cached
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True,
            )
        expected = out.sequences[0, len(prompt):].tolist()
        assert [t.token_id for t in got] == expected, f"prompt of {len(prompt)} tokens, {cached} cached"
        want = [torch.log_softmax(lg[0].double(), -1)[t].item() for lg, t in zip(out.logits, expected)]
        assert [t.logprob for t in got] == pytest.approx(want, abs=1e-4)
    assert hits > 0 and cache.evictions > 0


def test_checkpoint_engine_steps_requests_that_share_read_only_pages(hf_checkpoint) -> None:
    """A decode's prefix cache hands requests the same prefix pages: the checkpoint engine
    steps them together exactly as each alone, and refuses a page one of them writes."""
    from pdgrpc.engine.base import DecodeRequest
    from pdgrpc.engine.errors import InvalidRequest
    from pdgrpc.engine.hf.engine import HFEngine, HFEngineConfig

    engine = HFEngine(HFEngineConfig(str(hf_checkpoint("llama")), num_pages=8, max_prompt_tokens=256, max_seq_len=512))
    ps = engine.kv_layout.page_size
    assert engine.prefill_chunk(PrefillRequest(tuple(range(1, ps + 1)), (0,), SamplingParams()), 0, ps) is not None
    a, b = DecodeRequest(5, ps, (0, 1)), DecodeRequest(6, ps, (0, 2))
    assert engine.decode_step([a, b]) == engine.decode_step([a]) + engine.decode_step([b])
    with pytest.raises(InvalidRequest, match="which one of them writes"):
        engine.decode_step([a, DecodeRequest(6, ps, (0, 1))])


def test_a_batch_resuming_at_a_cached_offset_moves_whole_to_a_device() -> None:
    """The one device branch on a cached prompt's path: a GPU pool's batch carries its
    page table and positions from the cached offset on to the device (``meta`` stands in
    for CUDA here; on the CPU the batch is used as built). The cache itself holds page
    numbers only, the same on every device."""
    from pdgrpc.engine.model import SegmentBatch

    built = SegmentBatch.build([([3, 7, 9], 32, 5), ([4], 0, 2)])  # 32 cached tokens, then a cold prompt
    assert built.to(torch.device("cpu")) is built
    moved = built.to(torch.device("meta"))
    for name in ("page_table", "seq_lens", "seg_of", "row_of", "positions"):
        a, b = getattr(built, name), getattr(moved, name)
        assert (b.device.type, b.shape, b.dtype) == ("meta", a.shape, a.dtype), name
    assert built.positions.tolist() == [32, 33, 34, 35, 36, 0, 1] and built.seq_lens.tolist() == [37, 2]
    assert moved.max_rows == built.max_rows == 5
