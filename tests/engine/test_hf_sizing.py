"""Sizes a checkpoint decides when the flags leave them unset (pdgrpc.engine.hf.sizing)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pdgrpc.engine.hf.config import HFConfig, RopeScaling
from pdgrpc.engine.hf.sizing import KV_MEMORY_FRACTION, checkpoint_sizing
from pdgrpc.errors import ConfigError

# SmolLM2-135M's shape: 30 layers, 3 KV heads of 64, hidden 576, 49152 tokens, tied.
SMOLLM2 = HFConfig(
    path=Path("/models/smollm2"), architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
    intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
    rope_theta=1e5, rope_scaling=RopeScaling(), max_position_embeddings=8192, tie_word_embeddings=True,
    qkv_bias=False, qk_norm=False, sliding_window=None, bos_token_id=1, eos_token_ids=(2,), digest="",
)
GB = 10**9


def test_plenty_of_memory_takes_the_checkpoints_context_and_two_sequences_of_pool():
    s = checkpoint_sizing(SMOLLM2, dtype_bytes=4, page_size=16, available=64 * GB)
    assert (s.max_seq_len, s.max_prompt_tokens, s.num_pages) == (8192, 2048, 1024)
    assert s.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4
    assert round(s.weights_bytes / GB, 2) == 0.54  # 134.5 M parameters in float32
    assert "weights 0.54 GB + KV pool 0.75 GB" in s.describe() and "max-seq-len 8192," in s.describe()


def test_short_contexts_lower_the_prompt_limit_and_the_pool():
    s = checkpoint_sizing(dataclasses.replace(SMOLLM2, max_position_embeddings=2048), dtype_bytes=2, page_size=16, available=64 * GB)
    assert (s.max_seq_len, s.max_prompt_tokens, s.num_pages) == (2048, 2047, 256)


def test_little_memory_caps_the_pool_then_the_context_and_says_so():
    per_token = 2 * 30 * 3 * 64 * 4
    weights = checkpoint_sizing(SMOLLM2, dtype_bytes=4, page_size=16, available=None).weights_bytes
    # Budget for 1.5 sequences: the pool shrinks to what fits, never under one sequence.
    s = checkpoint_sizing(SMOLLM2, dtype_bytes=4, page_size=16, available=weights + int(1.5 * 8192 * per_token / KV_MEMORY_FRACTION))
    assert (s.max_seq_len, s.num_pages, s.capped) == (8192, 768, False)
    # Budget for 1000 tokens: the context is capped to whole pages of it.
    s = checkpoint_sizing(SMOLLM2, dtype_bytes=4, page_size=16, available=weights + int(1000 * per_token / KV_MEMORY_FRACTION))
    assert (s.max_seq_len, s.num_pages, s.capped) == (992, 62, True)
    assert "max-seq-len 992 (capped by memory)" in s.describe()
    with pytest.raises(ConfigError, match="not enough memory for the KV of one sequence"):
        checkpoint_sizing(SMOLLM2, dtype_bytes=4, page_size=16, available=weights)


def test_given_values_are_kept():
    s = checkpoint_sizing(SMOLLM2, dtype_bytes=4, page_size=16, available=1 * GB,
                          max_seq_len=4096, max_prompt_tokens=100, num_pages=7)
    assert (s.max_seq_len, s.max_prompt_tokens, s.num_pages) == (4096, 100, 7)


def test_a_tp_size_that_does_not_divide_the_kv_heads_is_refused_naming_the_fields():
    # 4 ranks share neither the 9 query heads nor the 3 KV heads evenly (a rank would hold no KV head).
    with pytest.raises(ConfigError) as err:
        checkpoint_sizing(SMOLLM2, dtype_bytes=4, page_size=16, tp_size=4, available=64 * GB)
    assert err.value.fields == {"tp_size": 4, "model.num_heads": 9}

