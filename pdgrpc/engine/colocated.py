"""Colocated generation: prefill and decode in one process, the reference output.

:func:`generate` drives any :class:`~pdgrpc.engine.base.Engine` through the same hooks
the servers use -- chunked ``prefill_chunk``, batched ``decode_step``, the shared
:func:`~pdgrpc.engine.base.stop_reason` -- with a small scheduler: requests are admitted
in order while their pages fit the pool, decoded together, and their pages freed as
each finishes. Disaggregated serving of the same prompts with the same sampling
parameters must produce exactly these tokens.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

from pdgrpc.engine.base import (
    DecodeRequest,
    Engine,
    InvalidRequest,
    PrefillRequest,
    SampledToken,
    SamplingParams,
    stop_reason,
)

__all__ = ["Generation", "generate", "prefill"]

Prompt = str | bytes | Sequence[int]


@dataclasses.dataclass(frozen=True)
class Generation:
    prompt_token_ids: tuple[int, ...]
    tokens: tuple[SampledToken, ...]
    finish_reason: str  # "eos" | "length"
    text: str  # the generated tokens, detokenized

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(t.token_id for t in self.tokens)


def prefill(engine: Engine, request: PrefillRequest, chunk_tokens: int | None = None) -> SampledToken:
    """Prefill a whole prompt in chunks of ``chunk_tokens`` (``None``: one chunk);
    returns the first generated token."""
    n = len(request.token_ids)
    step = n if chunk_tokens is None else chunk_tokens
    if step <= 0:
        raise InvalidRequest(f"chunk_tokens must be > 0, got {chunk_tokens}")
    first = None
    for start in range(0, n, step):
        first = engine.prefill_chunk(request, start, min(n, start + step))
    if first is None:
        raise InvalidRequest("prefill: the prompt is empty")
    return first


@dataclasses.dataclass
class _Running:
    index: int
    prompt: tuple[int, ...]
    pages: list[int]
    sampling: SamplingParams
    tokens: list[SampledToken]
    finished: bool = False


def _to_ids(engine: Engine, prompt: Prompt) -> tuple[int, ...]:
    if isinstance(prompt, (str, bytes)):
        return tuple(engine.tokenizer.encode(prompt))
    return tuple(prompt)


def generate(
    engine: Engine,
    prompts: Sequence[Prompt],
    max_new_tokens: int,
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    prefill_chunk_tokens: int | None = 64,
    max_batch: int | None = None,
) -> list[Generation]:
    """Generate up to ``max_new_tokens`` tokens for each prompt (text, bytes, or token
    ids; text and bytes get a BOS). ``sampling`` is one :class:`SamplingParams` for all
    prompts or one per prompt. Returns one :class:`Generation` per prompt, in order.

    Raises :class:`~pdgrpc.engine.base.InvalidRequest` for a prompt the engine refuses
    (before any work) or one that cannot fit the pool even alone. All pages are free
    again when this returns or raises.
    """
    ids = [_to_ids(engine, p) for p in prompts]
    if sampling is None:
        params = [SamplingParams()] * len(ids)
    elif isinstance(sampling, SamplingParams):
        params = [sampling] * len(ids)
    else:
        params = list(sampling)
        if len(params) != len(ids):
            raise InvalidRequest(f"sampling: {len(params)} SamplingParams for {len(ids)} prompts")
    if max_batch is not None and max_batch < 1:
        raise InvalidRequest(f"max_batch must be >= 1, got {max_batch}")
    for i, p in enumerate(ids):
        try:
            engine.validate_request(p, max_new_tokens)
        except InvalidRequest as e:
            raise InvalidRequest(f"prompts[{i}]: {e}") from None

    results: list[Generation | None] = [None] * len(ids)
    pending = collections.deque(range(len(ids)))
    running: list[_Running] = []

    def finish(r: _Running, reason: str) -> None:
        r.finished = True
        engine.free_pages(r.pages)
        out = tuple(r.tokens)
        results[r.index] = Generation(r.prompt, out, reason, engine.tokenizer.decode([t.token_id for t in out]))

    def step_done(r: _Running, tok: SampledToken) -> bool:
        r.tokens.append(tok)
        reason = stop_reason(tok.token_id, len(r.tokens), max_new_tokens, r.sampling, engine.tokenizer.eos_token_ids)
        if reason is not None:
            finish(r, reason)
        return reason is not None

    try:
        while pending or running:
            while pending and (max_batch is None or len(running) < max_batch):
                i = pending[0]
                # Every KV the request will write: the prompt and all generated tokens
                # but the last (which is returned, never fed back).
                pages = engine.alloc_pages(engine.pages_needed(len(ids[i]) + max_new_tokens - 1))
                if pages is None:
                    if not running:
                        raise InvalidRequest(
                            f"prompts[{i}]: needs more KV pages than the whole pool has free ({engine.num_free_pages})"
                        )
                    break  # wait for running requests to free theirs
                pending.popleft()
                r = _Running(i, ids[i], pages, params[i], [])
                try:
                    first = prefill(engine, PrefillRequest(ids[i], tuple(pages), params[i]), prefill_chunk_tokens)
                except BaseException:
                    engine.free_pages(pages)
                    raise
                if not step_done(r, first):
                    running.append(r)
            if running:
                batch = [
                    DecodeRequest(r.tokens[-1].token_id, len(r.prompt) + len(r.tokens) - 1, tuple(r.pages), r.sampling)
                    for r in running
                ]
                outs = engine.decode_step(batch)
                running = [r for r, tok in zip(running, outs) if not step_done(r, tok)]
    finally:
        for r in running:
            if not r.finished:
                engine.free_pages(r.pages)
    return [g for g in results if g is not None]
