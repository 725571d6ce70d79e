"""The engine's configuration says which of its fields break which rule, so that a layer
which filled them from something else (flags) can name them its own way."""

from __future__ import annotations

import pytest

from pdgrpc.engine.config import MAX_CONTEXT, EngineConfig, ModelConfig
from pdgrpc.errors import ConfigError

TINY = ModelConfig(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256)

# (the config's keyword arguments, the fields the error names with their values, its message)
Rule = tuple[dict[str, object], dict[str, object], str]

# The sizes both engines' configurations have, refused alike (check_sizes).
SIZE_RULES: list[Rule] = [
    (
        dict(max_prompt_tokens=4096, max_seq_len=4096),
        {"max_prompt_tokens": 4096, "max_seq_len": 4096},
        "EngineConfig.max_prompt_tokens (4096) must be < EngineConfig.max_seq_len (4096)",
    ),
    (
        dict(max_prompt_tokens=1, max_seq_len=1),
        {"max_seq_len": 1},
        "EngineConfig.max_seq_len 1: must be at least 2 (one prompt token and one generated token)",
    ),
    (
        dict(tp_size=2, tp_rank=2),
        {"tp_rank": 2, "tp_size": 2},
        "EngineConfig.tp_rank must be in [0, EngineConfig.tp_size=2), got 2",
    ),
    (dict(num_pages=0), {"num_pages": 0}, "EngineConfig.num_pages must be a positive int, got 0"),
]
ENGINE_RULES: list[Rule] = SIZE_RULES + [
    (
        dict(max_prompt_tokens=10, max_seq_len=MAX_CONTEXT + 1),
        {"max_seq_len": MAX_CONTEXT + 1},
        f"EngineConfig.max_seq_len {MAX_CONTEXT + 1}: the reference engine takes at most {MAX_CONTEXT} tokens",
    ),
    (
        dict(model=TINY, tp_size=4),
        {"tp_size": 4, "model.num_kv_heads": 2},
        "EngineConfig.tp_size 4 must divide EngineConfig.model.num_kv_heads (2)",
    ),
    (dict(intra_op_threads=-1), {"intra_op_threads": -1}, "EngineConfig.intra_op_threads must be an int >= 0, got -1"),
]


@pytest.mark.parametrize("kwargs, fields, message", ENGINE_RULES, ids=[m.split(" ")[0] for _, _, m in ENGINE_RULES])
def test_an_engine_config_refusal_names_its_fields_and_their_values(
    kwargs: dict[str, object], fields: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        EngineConfig(**kwargs)  # type: ignore[arg-type]
    assert err.value.fields == fields
    assert str(err.value) == message


@pytest.mark.parametrize("kwargs, fields, message", SIZE_RULES, ids=[m.split(" ")[0] for _, _, m in SIZE_RULES])
def test_the_checkpoint_engines_config_refuses_the_same_sizes_alike(
    kwargs: dict[str, object], fields: dict[str, object], message: str
) -> None:
    from pdgrpc.engine.hf.engine import HFEngineConfig

    with pytest.raises(ConfigError) as err:
        HFEngineConfig("checkpoint", **kwargs)  # type: ignore[arg-type]
    assert err.value.fields == fields
    assert str(err.value) == message.replace("EngineConfig.", "HFEngineConfig.")


def test_a_model_config_refusal_names_its_fields_and_their_values() -> None:
    with pytest.raises(ConfigError) as err:
        ModelConfig(num_heads=6, num_kv_heads=4)
    assert err.value.fields == {"num_heads": 6, "num_kv_heads": 4}
    assert str(err.value) == "ModelConfig.num_heads (6) must be a multiple of ModelConfig.num_kv_heads (4)"


@pytest.mark.parametrize("seed", [-1, 2**64, 10**30])
def test_a_model_seed_outside_64_bits_is_refused(seed: int) -> None:
    # A seed is a 64-bit value wherever pdgrpc takes one (sampling's too), and the model's
    # is part of its identity, which handshake refusals repeat.
    with pytest.raises(ConfigError) as err:
        ModelConfig(seed=seed)
    assert str(err.value) == f"ModelConfig.seed must be an int in [0, 2**64), got {seed}"
    ModelConfig(seed=2**64 - 1)


def test_a_refusal_is_worded_with_other_names_for_its_fields() -> None:
    with pytest.raises(ConfigError) as err:
        EngineConfig(max_prompt_tokens=5000, max_seq_len=4096)
    names = {"max_prompt_tokens": "the prompt limit", "max_seq_len": "the length limit"}
    assert err.value.worded(names.__getitem__) == "the prompt limit (5000) must be < the length limit (4096)"


def test_an_error_about_no_field_is_worded_as_it_is() -> None:
    err = ConfigError("--transport nope: unknown")
    assert err.fields == {}
    assert err.worded(str.upper) == "--transport nope: unknown"
