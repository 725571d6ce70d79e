"""Sampling: greedy is the argmax, seeded sampling is reproducible anywhere and follows
the distribution, logprobs are the model's, and bad parameters name themselves."""

from __future__ import annotations

import collections
import math

import numpy as np
import pytest
import torch

from engine_helpers import PROMPTS, make_engine
from pdgrpc.engine import InvalidRequest, SamplingParams, generate
from pdgrpc.engine.sampling import draw_u64, sample_rows


def test_greedy_picks_the_argmax_of_the_models_logits() -> None:
    e = make_engine()
    g = generate(e, [PROMPTS[1]], 10, SamplingParams(top_logprobs=3))[0]
    logits = e.compute_logits(list(g.prompt_token_ids) + list(g.token_ids[:-1]))
    n = len(g.prompt_token_ids)
    assert list(g.token_ids) == logits[n - 1 :].argmax(dim=-1).tolist()
    logprobs = torch.log_softmax(logits[n - 1 :], dim=-1)
    for tok, lp in zip(g.tokens, logprobs):
        assert tok.logprob == pytest.approx(lp[tok.token_id].item(), abs=1e-5)
        assert tok.logprob == float(np.float32(tok.logprob))  # survives a float32 row
        assert tok.top_ids[0] == tok.token_id and len(tok.top_ids) == 3
        assert list(tok.top_logprobs) == sorted(tok.top_logprobs, reverse=True)
        assert list(tok.top_ids) == lp.topk(3).indices.tolist()


def test_seeded_sampling_is_reproducible_and_seeds_matter() -> None:
    runs = {seed: generate(make_engine(), PROMPTS[:2], 24, SamplingParams(temperature=1.0, seed=seed)) for seed in range(4)}
    again = generate(make_engine(), PROMPTS[:2], 24, SamplingParams(temperature=1.0, seed=2))
    assert again == runs[2]
    assert len({tuple(g.token_ids for g in gens) for gens in runs.values()}) == 4
    greedy = generate(make_engine(), PROMPTS[:2], 24)
    assert all(gens != greedy for gens in runs.values())


def test_top_k_1_and_tiny_top_p_are_greedy() -> None:
    greedy = [g.token_ids for g in generate(make_engine(), PROMPTS, 12)]
    top_k = [g.token_ids for g in generate(make_engine(), PROMPTS, 12, SamplingParams(temperature=1.5, top_k=1, seed=3))]
    top_p = [g.token_ids for g in generate(make_engine(), PROMPTS, 12, SamplingParams(temperature=1.5, top_p=1e-6, seed=3))]
    assert greedy == top_k == top_p


def test_top_k_only_ever_picks_among_the_k_most_likely() -> None:
    gens = generate(make_engine(), PROMPTS, 24, SamplingParams(temperature=5.0, top_k=3, top_logprobs=3, seed=11))
    tokens = [t for g in gens for t in g.tokens]
    assert all(t.token_id in t.top_ids for t in tokens)
    assert any(t.token_id != t.top_ids[0] for t in tokens)  # high temperature: not just greedy


def test_draws_follow_the_distribution_at_temperature_and_top_p() -> None:
    logits = torch.tensor([[0.0, math.log(2.0), math.log(4.0), -30.0]], dtype=torch.float64)
    n = 3000  # fixed seeds 0..n-1: deterministic; one sigma is at most 0.009

    def freq(params_for: "callable[[int], SamplingParams]") -> list[float]:  # type: ignore[valid-type]
        rows = sample_rows(logits.expand(n, -1), [params_for(s) for s in range(n)], [5] * n)
        counts = collections.Counter(t.token_id for t in rows)
        return [counts[i] / n for i in range(4)]

    f = freq(lambda s: SamplingParams(temperature=1.0, seed=s))
    assert f == pytest.approx([1 / 7, 2 / 7, 4 / 7, 0.0], abs=0.03)
    f = freq(lambda s: SamplingParams(temperature=2.0, seed=s))  # p ~ sqrt(1, 2, 4)
    z = 1 + math.sqrt(2) + 2
    assert f == pytest.approx([1 / z, math.sqrt(2) / z, 2 / z, 0.0], abs=0.03)
    f = freq(lambda s: SamplingParams(temperature=1.0, top_p=0.8, seed=s))  # keeps {2, 1}: 4/6, 2/6
    assert f == pytest.approx([0.0, 1 / 3, 2 / 3, 0.0], abs=0.03)


def test_the_draw_depends_only_on_seed_and_position() -> None:
    assert draw_u64(5, 100) == draw_u64(5, 100)
    assert len({draw_u64(5, p) for p in range(1000)}) == 1000
    assert draw_u64(5, 100) != draw_u64(6, 100)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.1), "sampling.temperature"),
        (dict(temperature=float("nan")), "sampling.temperature"),
        (dict(top_p=0.0), "sampling.top_p"),
        (dict(top_k=-1), "sampling.top_k"),
        (dict(seed=2**64), "sampling.seed"),
        (dict(seed=-1), "sampling.seed"),
        (dict(top_logprobs=21), "sampling.top_logprobs"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequest, match=field):
        SamplingParams(**kwargs)  # type: ignore[arg-type]
