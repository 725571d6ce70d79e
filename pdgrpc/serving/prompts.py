"""A front door's request: prompt -> token ids (``input_ids``, ``prompt`` text or chat
``messages``), and the sampling seed.

The router and the colocated server both call :func:`request_ids`. Text is tokenized with
the served tokenizer (the checkpoint's with ``--model``, else the byte tokenizer); chat
``messages`` are first rendered with the served tokenizer's chat template (a checkpoint's
``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template``, Jinja; the
tokenizer's ``chat_template`` attribute, wherever it came from) in a sandboxed environment, the way
``transformers``' ``apply_chat_template(..., add_generation_prompt=True)`` renders it, and
the rendered text is tokenized without adding specials again (the template writes them).

A request that names no ``sampling.seed`` gets one where it enters (router, colocated
server) through :func:`with_seed`, once, never per hop: the prefill and the decode then
sample with the same seed, every retry too, and the first response returns it.

Torch-free: the router imports it.
"""

from __future__ import annotations

import secrets
from typing import Any, Callable, Sequence

from pdgrpc.engine.chat_template import compiled
from pdgrpc.engine.errors import InvalidRequest
from pdgrpc.errors import EngineError
from pdgrpc.v1 import common_pb2

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "render_chat", "request_ids", "with_seed"]

DEFAULT_MAX_NEW_TOKENS = 16  # generate.proto: max_new_tokens defaults to 16 when 0
MAX_MESSAGES = 1024  # messages per request; more is refused
SEED_BITS = 64  # common.proto: the seed is any 64-bit value


def with_seed(msg: common_pb2.SamplingParams, randbits: Callable[[int], int] = secrets.randbits) -> common_pb2.SamplingParams:
    """A copy of ``msg`` whose ``seed`` is set: the caller's (0 included), else a fresh
    random 64-bit draw."""
    out = common_pb2.SamplingParams()
    out.CopyFrom(msg)
    if not out.HasField("seed"):
        out.seed = randbits(SEED_BITS)
    return out


def render_chat(template: str | None, messages: Sequence[Any], specials: dict[str, str | None]) -> str:
    """The conversation as prompt text (``messages``: objects with ``role``, ``content``)."""
    if not template:
        raise InvalidRequest("messages: the served model has no chat template (chat_template.jinja or tokenizer_config.json's chat_template); send prompt or input_ids")
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequest(f"messages: {len(messages)} messages, over the limit of {MAX_MESSAGES}")
    import jinja2

    try:
        text: str = compiled(template).render(
            messages=[{"role": m.role, "content": m.content} for m in messages], add_generation_prompt=True,
            **{k: v for k, v in specials.items() if v is not None},
        )
    except InvalidRequest:
        raise
    except jinja2.TemplateError as exc:
        raise InvalidRequest(f"messages: the chat template failed: {exc}") from None
    return text


def request_ids(request: Any, tokenizer: Any) -> list[int]:
    """Token ids of a ``GenerateRequest``; raises :class:`InvalidRequest` naming the field."""
    if request.input_ids:
        ids = list(request.input_ids)
        tokenizer.check_ids(ids, "input_ids")
        return ids
    if len(request.messages):
        if request.prompt:
            raise InvalidRequest("prompt: set prompt or messages, not both")
        specials = {k: tokenizer.special_token(k) for k in ("bos_token", "eos_token")} if hasattr(tokenizer, "special_token") else {}
        text = render_chat(getattr(tokenizer, "chat_template", None), request.messages, specials)
        try:
            ids = tokenizer.encode(text, add_bos=False)
        except EngineError as exc:
            raise InvalidRequest(f"messages: {exc}") from None
    else:
        try:
            ids = tokenizer.encode(request.prompt)
        except EngineError as exc:
            raise InvalidRequest(f"prompt: {exc}") from None
    if not ids:
        raise InvalidRequest("prompt: it is empty and this tokenizer adds no BOS token; send some text")
    return list(ids)
