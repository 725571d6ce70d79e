"""Colocated generation: stop rules, bounded resources (no page leak, even on errors),
and clear errors for requests the engine refuses."""

from __future__ import annotations

from typing import Sequence

import pytest

from engine_helpers import PROMPTS, TINY, make_engine
from pdgrpc.engine import EOS_ID, DecodeRequest, InvalidRequest, PrefillRequest, ReferenceEngine, SampledToken, SamplingParams, generate
from pdgrpc.errors import EngineError


def test_max_new_tokens_is_respected_and_every_page_comes_back() -> None:
    e = make_engine(num_pages=12)  # too small for all prompts at once: requests wait for pages
    gens = generate(e, PROMPTS * 2, 9, SamplingParams(ignore_eos=True), prefill_chunk_tokens=16)
    assert [len(g.token_ids) for g in gens] == [9] * 8
    assert {g.finish_reason for g in gens} == {"length"}
    assert gens[:4] == gens[4:]
    assert e.num_free_pages == e.num_pages


def test_generation_stops_at_eos_unless_told_to_ignore_it() -> None:
    e = make_engine(TINY)
    prompt = [PROMPTS[0]]
    # Search (deterministically) for a seed whose sample hits EOS before the limit.
    for seed in range(200):
        g = generate(e, prompt, 40, SamplingParams(temperature=3.0, seed=seed))[0]
        if g.finish_reason == "eos":
            break
    else:
        pytest.fail("no seed in 0..199 sampled EOS: the output prior makes EOS impossible?")
    assert g.token_ids[-1] == EOS_ID and EOS_ID not in g.token_ids[:-1] and len(g.token_ids) < 40
    assert g.text == e.tokenizer.decode(g.token_ids[:-1])  # EOS itself adds no text
    longer = generate(e, prompt, 40, SamplingParams(temperature=3.0, seed=seed, ignore_eos=True))[0]
    assert longer.finish_reason == "length" and len(longer.token_ids) == 40
    assert longer.token_ids[: len(g.token_ids)] == g.token_ids


class FailingEngine(ReferenceEngine):
    """Fails its third decode step, as an engine error mid-generation would."""

    calls = 0

    def decode_step(self, batch: Sequence[DecodeRequest]) -> list[SampledToken]:
        self.calls += 1
        if self.calls == 3:
            raise EngineError("injected failure")
        return super().decode_step(batch)


def test_an_engine_failure_mid_generation_leaks_no_pages() -> None:
    e = FailingEngine(make_engine(TINY, num_pages=20).config)
    with pytest.raises(EngineError, match="injected failure"):
        generate(e, PROMPTS, 8)
    assert e.num_free_pages == e.num_pages


@pytest.mark.parametrize(
    "prompts, max_new, match",
    [
        ([b"ok", b"x" * 300], 4, r"prompts\[1\]: token_ids: prompt has 301 tokens, over max_prompt_tokens=256"),
        ([[]], 4, r"prompts\[0\]: token_ids: the prompt is empty"),
        ([[256, 300]], 4, r"token_ids\[1\] = 300 is not a token id"),
        ([b"ok"], 0, "max_new_tokens must be an int >= 1"),
        ([b"x" * 250], 300, r"prompt \(251\) \+ max_new_tokens \(300\) exceeds max_seq_len=512"),
    ],
)
def test_refused_requests_name_the_problem(prompts: list[object], max_new: int, match: str) -> None:
    e = make_engine(TINY)
    with pytest.raises(InvalidRequest, match=match) as info:
        generate(e, prompts, max_new)  # type: ignore[arg-type]
    assert isinstance(info.value, EngineError) and isinstance(info.value, ValueError)
    assert e.num_free_pages == e.num_pages


def test_a_request_larger_than_the_whole_pool_is_refused() -> None:
    e = make_engine(TINY, num_pages=2)
    with pytest.raises(InvalidRequest, match=r"prompts\[0\]: needs more KV pages than the whole pool"):
        generate(e, [b"x" * 40], 4)
    with pytest.raises(InvalidRequest, match="2 SamplingParams for 1 prompts"):
        generate(e, [b"x"], 4, [SamplingParams(), SamplingParams()])
    assert e.num_free_pages == 2


def test_prefill_chunk_and_decode_step_check_their_inputs() -> None:
    e = make_engine(TINY, num_pages=8)
    ids = tuple(e.tokenizer.encode(b"x" * 20))  # 21 tokens: 2 pages
    bad_prefills = [
        (PrefillRequest(ids, (0, 1)), 5, 3, r"need 0 <= start < end <= 21, got start=5, end=3"),
        (PrefillRequest(ids, (0, 1)), 0, 22, "end=22"),
        (PrefillRequest(ids, (0,)), 0, 21, "pages: 21 tokens need 2 pages of 16, got 1"),
        (PrefillRequest(ids, (0, 8)), 0, 21, r"pages: page 8 outside the pool \[0, 8\)"),
        (PrefillRequest(ids, (3, 3)), 0, 21, "pages: page indices repeat"),
    ]
    for req, start, end, match in bad_prefills:
        with pytest.raises(InvalidRequest, match=match):
            e.prefill_chunk(req, start, end)
    bad_batches = [
        ([DecodeRequest(65, 0, (0,))], r"batch\[0\].position must be in \(0, max_seq_len=512\)"),
        ([DecodeRequest(65, 512, tuple(range(8)))], r"batch\[0\].position"),
        ([DecodeRequest(65, 3, (0,)), DecodeRequest(999, 3, (1,))], r"batch\[1\].token_id = 999"),
        ([DecodeRequest(65, 16, (0,))], r"batch\[0\].pages: 17 tokens need 2 pages"),
        ([DecodeRequest(65, 3, (0,)), DecodeRequest(66, 3, (0,))], r"batch\[1\].pages: shared with another request"),
    ]
    for batch, match in bad_batches:
        with pytest.raises(InvalidRequest, match=match):
            e.decode_step(batch)
    assert e.decode_step([]) == []


def test_a_decode_step_may_share_pages_its_requests_only_read() -> None:
    """Two requests over one cached prefix page (a decode's prefix cache) step together
    exactly as each steps alone; a page one of them writes stays its own."""
    e = make_engine(TINY)
    ps = e.kv_layout.page_size
    prefix = tuple(range(1, ps + 1))
    assert e.prefill_chunk(PrefillRequest(prefix, (0,)), 0, ps) is not None
    a, b = DecodeRequest(65, ps, (0, 1)), DecodeRequest(66, ps, (0, 2))
    together = e.decode_step([a, b])
    assert together == e.decode_step([a]) + e.decode_step([b])
    with pytest.raises(InvalidRequest, match=r"batch\[1\].pages: shared with another request of the batch, which one of them writes"):
        e.decode_step([a, DecodeRequest(66, ps, (0, 1))])
