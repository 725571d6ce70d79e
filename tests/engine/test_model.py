"""The reference model is a real transformer: it agrees with a textbook float
implementation over contiguous K/V, and produces varied, prompt-dependent text."""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest
import torch

from engine_float_reference import float_forward
from engine_helpers import PROMPTS, TINY, make_engine
from pdgrpc.engine import EngineConfig, ModelConfig, ReferenceEngine, generate
from pdgrpc.errors import ConfigError

TEXT = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs."


@pytest.mark.parametrize("kv_dtype, max_tv", [("float32", 0.01), ("float16", 0.1)])
def test_paged_fixed_point_forward_matches_textbook_float_attention(kv_dtype: str, max_tv: float) -> None:
    e = make_engine(kv_dtype=kv_dtype, page_size=8)
    ids = e.tokenizer.encode(TEXT)  # 86 tokens over 11 pages of 8
    got = e.compute_logits(ids)
    want, _ = float_forward(e.config.model, ids)
    p_got, p_want = torch.softmax(got, dim=-1), torch.softmax(want, dim=-1)
    tv = 0.5 * (p_got - p_want).abs().sum(dim=-1)  # total variation per position
    assert tv.max() < max_tv
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.95


def test_paged_kv_holds_the_textbook_k_and_v_at_the_documented_places() -> None:
    e = make_engine(TINY, page_size=4)
    ids = e.tokenizer.encode(TEXT[:22])  # 23 tokens over 6 pages
    pages = e.alloc_pages(e.pages_needed(len(ids)))
    assert pages is not None
    pages = pages[::-1]  # scattered, descending
    from engine_helpers import prefill_into

    prefill_into(e, ids, pages)
    _, kvs = float_forward(e.config.model, ids)
    bufs = e.kv_buffers()
    for layer, (k_ref, v_ref) in enumerate(kvs):
        # Reassemble contiguous [T, heads, d] from the pages using only the documented layout.
        k = bufs.k[layer][pages].permute(0, 2, 1, 3).reshape(-1, 2, 32)[: len(ids)].double()
        v = bufs.v[layer][pages].permute(0, 2, 1, 3).reshape(-1, 2, 32)[: len(ids)].double()
        assert (k - k_ref).abs().max() < 0.05 and (v - v_ref).abs().max() < 0.05
        assert k_ref.abs().mean() > 0.3  # the comparison is not between near-zero tensors


def test_outputs_depend_on_the_prompt_and_are_not_one_repeated_token() -> None:
    e = make_engine()
    prompts = PROMPTS + [b"Hello, world", b"0123456789", b"The cat sat on the mat"]
    gens = generate(e, prompts, max_new_tokens=32)
    outputs = [g.token_ids for g in gens]
    assert len(set(outputs)) == len(outputs)  # every prompt leads somewhere else
    for g in gens:
        assert len(set(g.token_ids)) >= 4, g.text
        longest_run = max(len(list(run)) for _, run in itertools.groupby(g.token_ids))
        assert longest_run < len(g.token_ids), g.text


def test_weights_are_fixed_by_the_seed() -> None:
    a = make_engine(TINY).compute_logits([256, 72, 105])
    again = make_engine(TINY).compute_logits([256, 72, 105])
    other = make_engine(dataclasses.replace(TINY, seed=7)).compute_logits([256, 72, 105])
    assert torch.equal(a, again)
    assert not torch.allclose(a, other, atol=0.5)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_heads=6, num_kv_heads=4), "num_heads"),
        (dict(head_dim=31), "head_dim"),
        (dict(hidden_size=0), "hidden_size"),
        (dict(intermediate_size=5000), "intermediate_size"),
        (dict(vocab_size=100), "vocab_size"),
        (dict(seed=-1), "seed"),
    ],
)
def test_bad_model_config_names_the_field(kwargs: dict[str, int], field: str) -> None:
    with pytest.raises(ConfigError, match=f"ModelConfig.{field}"):
        ModelConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(page_size=0), "page_size"),
        (dict(kv_dtype="fp8"), "kv_dtype"),
        (dict(max_prompt_tokens=4096, max_seq_len=4096), "max_prompt_tokens"),
        (dict(max_seq_len=100_000, max_prompt_tokens=10), "max_seq_len"),
        (dict(tp_size=4), "tp_size"),  # 2 KV heads cannot be split 4 ways
        (dict(tp_size=2, tp_rank=2), "tp_rank"),
        (dict(intra_op_threads=-1), "intra_op_threads"),
    ],
)
def test_bad_engine_config_names_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**kwargs)  # type: ignore[arg-type]


def test_tensor_parallel_engine_needs_an_all_reduce() -> None:
    with pytest.raises(ConfigError, match="needs an all_reduce"):
        ReferenceEngine(EngineConfig(model=TINY, tp_size=2, tp_rank=0, num_pages=4))


@pytest.mark.parametrize(
    "bad, shown",
    [(300, "300"), (-1, "-1"), (True, "True"), (7.0, "7.0"), ("7", "'7'"), (torch.tensor(7), "tensor(7)")],
)
def test_a_prompt_with_a_bad_token_id_is_refused_naming_the_first(bad: object, shown: str) -> None:
    """Checked whole in C first; a prompt that fails is walked to name the first bad id."""
    from pdgrpc.engine.errors import InvalidRequest

    engine = make_engine()
    vocab = engine.tokenizer.vocab_size
    ids = [256, 1, 2, bad, 3, bad]
    with pytest.raises(InvalidRequest, match=rf"^token_ids\[3\] = {re.escape(shown)} is not a token id in \[0, {vocab}\)$"):
        engine.validate_request(ids, 1)
    engine.validate_request([256, 0, vocab - 1], 1)  # the edges of the vocabulary pass
