"""Shared helpers for the engine tests (a uniquely named module: several test folders have a conftest)."""

from __future__ import annotations

from typing import Sequence


from pdgrpc.engine import DecodeRequest, EngineConfig, ModelConfig, PrefillRequest, ReferenceEngine, SampledToken, SamplingParams
from pdgrpc.engine.colocated import prefill

# A smaller model for tests that build many engines; the default model is what servers run.
TINY = ModelConfig(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256)

# Lengths in tokens (BOS included): below one page, exactly one page, exactly two pages,
# longer than a 32-token prefill chunk and not page aligned.
PROMPTS: list[bytes] = [b"Hi", b"fifteen bytes!!", b"x" * 31, "Grüße aus Köln — a longer prompt, 日本語 too: ".encode() * 2]


def make_engine(model: ModelConfig = ModelConfig(), **overrides: object) -> ReferenceEngine:
    cfg = dict(num_pages=64, max_seq_len=512, max_prompt_tokens=256)
    cfg.update(overrides)
    return ReferenceEngine(EngineConfig(model=model, **cfg))  # type: ignore[arg-type]


def decode_from(
    engine: ReferenceEngine, prompt_len: int, first: SampledToken, pages: Sequence[int], steps: int, sampling: SamplingParams = SamplingParams()
) -> list[SampledToken]:
    """Continue a request whose prompt KV is in ``pages`` from its first token, one
    request per step. Returns the first token followed by ``steps`` more."""
    out = [first]
    for _ in range(steps):
        pos = prompt_len + len(out) - 1
        out += engine.decode_step([DecodeRequest(out[-1].token_id, pos, tuple(pages), sampling)])
    return out


def prefill_into(
    engine: ReferenceEngine, ids: Sequence[int], pages: Sequence[int], sampling: SamplingParams = SamplingParams(), chunk: int | None = None
) -> SampledToken:
    return prefill(engine, PrefillRequest(tuple(ids), tuple(pages), sampling), chunk)


